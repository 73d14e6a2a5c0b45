"""Where the admin token comes from, and checking a presented one.

Order: `MODELFORGE_ADMIN_TOKEN`, then `MODELFORGE_ADMIN_TOKEN_FILE`, then `<data dir>/admin-token`
(generated on first start with mode 0600). Only a SHA-256 digest is kept in memory.
"""

from __future__ import annotations

import hmac
import stat
from dataclasses import dataclass, field
from pathlib import Path

from control_plane.access.console_sessions import SignInThrottle
from control_plane.clock import Clock
from control_plane.errors import AdminAuthError
from control_plane.security import new_admin_token, sha256_hex
from control_plane.settings import Settings
from modelforge_contracts.files import write_private

GENERATED_TOKEN_FILE = "admin-token"  # noqa: S105 - a file name
_MIN_LENGTH = 16


class AdminTokenConfigError(Exception):
    """The configured admin token cannot be used; the message says which setting and why."""


@dataclass(frozen=True)
class AdminTokenSource:
    origin: str
    generated: bool
    file: Path | None
    _digest: str = field(repr=False)

    def matches(self, presented: str) -> bool:
        return hmac.compare_digest(sha256_hex(presented), self._digest)


def check_presented(
    *,
    source: AdminTokenSource,
    throttle: SignInThrottle,
    clock: Clock,
    address: str,
    presented: str,
    then: str,
) -> None:
    """The one check of a presented admin token (header or console sign-in), throttled per
    client address: refused with 429 after too many wrong ones, before the token is compared,
    so that a right token answers the same as a wrong one until the wait is over."""
    throttle.check(address, clock.now(), then=then)
    if not source.matches(presented):
        throttle.failed(address, clock.now())
        raise AdminAuthError(
            "The admin token is not valid.",
            f"Use the token from {source.origin}.",
            code="ADMIN_TOKEN_INVALID",
        )
    throttle.succeeded(address)


def resolve_admin_token(settings: Settings) -> AdminTokenSource:
    if settings.admin_token is not None:
        value = settings.admin_token.get_secret_value().strip()
        _check_strength(value, "MODELFORGE_ADMIN_TOKEN")
        return AdminTokenSource("MODELFORGE_ADMIN_TOKEN", False, None, sha256_hex(value))
    if settings.admin_token_file is not None:
        path = settings.admin_token_file
        try:
            value = path.read_text().strip()
        except OSError as exc:
            raise AdminTokenConfigError(
                f"MODELFORGE_ADMIN_TOKEN_FILE: cannot read {path} ({exc.strerror})"
            ) from None
        _check_strength(value, "MODELFORGE_ADMIN_TOKEN_FILE")
        return AdminTokenSource(str(path), False, path, sha256_hex(value))
    path = settings.data_dir / GENERATED_TOKEN_FILE
    generated = False
    if not path.exists():
        try:
            # Exclusive: of two processes starting on one data dir, both use the first token.
            write_private(path, new_admin_token() + "\n", exclusive=True)
            generated = True
        except FileExistsError:
            pass
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise AdminTokenConfigError(
            f"{path} is readable by other users (mode {mode:o}); run: chmod 600 {path}"
        )
    value = path.read_text().strip()
    _check_strength(value, str(path))
    return AdminTokenSource(str(path), generated, path, sha256_hex(value))


def _check_strength(value: str, origin: str) -> None:
    if len(value) < _MIN_LENGTH:
        raise AdminTokenConfigError(
            f"{origin}: the admin token must be at least {_MIN_LENGTH} characters"
        )
