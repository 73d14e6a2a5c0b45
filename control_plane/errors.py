"""The one error hierarchy of the control plane.

Every refusal is a `ModelForgeError` with a stable `code`, a human `message` and a `next_step`.
Services raise these; the app factory maps them to HTTP exactly once. Messages must never contain
a secret value (token, credential, key) — name the thing, never quote it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from modelforge_contracts.errors import error_body


class ModelForgeError(Exception):
    """Base class: a refusal the caller can act on."""

    http_status: ClassVar[int] = 400
    code: str = "BAD_REQUEST"

    def __init__(self, message: str, next_step: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.next_step = next_step
        if code is not None:
            self.code = code

    def to_body(self) -> dict[str, Any]:
        return error_body(self.code, self.message, self.next_step)


class InvalidRequest(ModelForgeError):
    http_status = 422
    code = "INVALID_REQUEST"


class NotFound(ModelForgeError):
    http_status = 404
    code = "NOT_FOUND"


class Conflict(ModelForgeError):
    http_status = 409
    code = "CONFLICT"


class AdminAuthError(ModelForgeError):
    http_status = 401
    code = "ADMIN_TOKEN_INVALID"


class CsrfError(ModelForgeError):
    """A console session made a change without its CSRF token."""

    http_status = 403
    code = "CSRF_TOKEN_INVALID"


class CredentialError(ModelForgeError):
    """The node credential is missing, malformed, forged or revoked."""

    http_status = 401
    code = "CREDENTIAL_INVALID"


class CredentialRevoked(CredentialError):
    http_status = 403
    code = "CREDENTIAL_REVOKED"


class EnrollmentRefused(ModelForgeError):
    """An enrollment token cannot be claimed; `code` says why."""

    http_status = 401
    code = "ENROLLMENT_TOKEN_UNKNOWN"


class EnrollmentTokenUsed(EnrollmentRefused):
    http_status = 409
    code = "ENROLLMENT_TOKEN_USED"


class EnrollmentTokenGone(EnrollmentRefused):
    """Expired or revoked: the token existed but can never be claimed."""

    http_status = 410
    code = "ENROLLMENT_TOKEN_EXPIRED"


class ProtocolIncompatible(ModelForgeError):
    """The agent or runtime worker speaks a protocol outside the accepted range."""

    http_status = 426
    code = "UNKNOWN"

    def __init__(self, message: str, next_step: str, *, code: str, component: str) -> None:
        super().__init__(message, next_step, code=code)
        self.component = component

    def to_body(self) -> dict[str, Any]:
        return error_body(self.code, self.message, self.next_step, component=self.component)


class TooManyRequests(ModelForgeError):
    http_status = 429
    code = "TOO_MANY_REQUESTS"


class ServiceUnavailable(ModelForgeError):
    http_status = 503
    code = "SERVICE_UNAVAILABLE"
