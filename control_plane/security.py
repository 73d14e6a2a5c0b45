"""Secret material helpers: generation, hashing and constant-time comparison.

Nothing here logs or formats a secret. Callers keep raw secrets only as long as a request lasts.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

ENROLLMENT_TOKEN_PREFIX = "mfe_"  # noqa: S105 - a prefix, not a secret
ADMIN_TOKEN_PREFIX = "mfa_"  # noqa: S105 - a prefix, not a secret


def new_enrollment_token() -> str:
    return ENROLLMENT_TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_admin_token() -> str:
    return ADMIN_TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


def sha256_hex(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def constant_time_equal(a: str, b: str) -> bool:
    # Hash first so the comparison time depends on neither value's length.
    return hmac.compare_digest(sha256_hex(a), sha256_hex(b))


def write_private_file(path: Path, content: str) -> None:
    """Atomically write `content` to `path` with mode 0600 (never world- or group-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
