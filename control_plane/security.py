"""Secret material helpers: generation, hashing and constant-time comparison.

Nothing here logs or formats a secret. Callers keep raw secrets only as long as a request lasts.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

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
