"""The one error hierarchy of the control plane.

Every refusal is a `ModelForgeError` with a stable `code`, a human `message` and a `next_step`.
Services raise these; the app factory maps them to HTTP exactly once. Messages must never contain
a secret value (token, credential, key) — name the thing, never quote it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from control_plane.db import is_database_busy, is_database_unavailable
from control_plane.storage import is_storage_full
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

    def response_headers(self) -> dict[str, str] | None:
        """Headers the refusal's response needs besides its body (none for most)."""
        return None


class InvalidRequest(ModelForgeError):
    http_status = 422
    code = "INVALID_REQUEST"


class NotFound(ModelForgeError):
    http_status = 404
    code = "NOT_FOUND"


class Conflict(ModelForgeError):
    http_status = 409
    code = "CONFLICT"


class GpuNotFound(NotFound):
    """A node's GPU that neither its inventory lists nor any health report named."""

    code = "GPU_NOT_FOUND"

    def __init__(self) -> None:
        super().__init__(
            "This node has no GPU with this UUID (its inventory does not list it and no health "
            "report named it).",
            "List the node's GPUs with GET /api/v1/admin/nodes/{node_id}/gpus and use a UUID "
            "from there.",
        )


class GpuNotClean(Conflict):
    """Re-admission refused: the agent still reports the GPU unhealthy."""

    code = "GPU_NOT_CLEAN"

    def __init__(self, *, gpu: str, evidence: str) -> None:
        super().__init__(
            f"{gpu} cannot be re-admitted: its agent still reports it unhealthy ({evidence}).",
            "Reset the GPU (nvidia-smi --gpu-reset) or reboot the node; once the agent reports "
            "it healthy or degraded, re-admit it again to run its active check.",
        )


class GpuCheckRunning(Conflict):
    """Re-admission refused: the GPU's active check has not ended yet."""

    code = "GPU_CHECK_RUNNING"

    def __init__(self, *, gpu: str, job_id: str) -> None:
        super().__init__(
            f"{gpu} is already being checked (job {job_id}).",
            f"Wait for that job to end (GET /api/v1/jobs/{job_id}); the GPU's view and its "
            "events then say how the check went.",
        )


class GpuInService(Conflict):
    """Re-admission refused: the GPU is in the schedule already."""

    code = "GPU_IN_SERVICE"

    def __init__(self, *, gpu: str, state: str) -> None:
        super().__init__(
            f"{gpu} is {state} and not quarantined: there is nothing to re-admit.",
            "Nothing to do; to take it out of the schedule, quarantine it: POST "
            "/api/v1/admin/nodes/{node_id}/gpus/{uuid}/quarantine.",
        )


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


class CredentialExpired(CredentialError):
    """Past its `exp` (CR-3): the node enrolls again."""

    http_status = 401
    code = "CREDENTIAL_EXPIRED"


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


class RequestTooLarge(ModelForgeError):
    """The request body is larger than the endpoint's limit; refused before it is all read."""

    http_status = 413
    code = "REQUEST_TOO_LARGE"


class RangeNotSatisfiable(ModelForgeError):
    """No range of a `Range` header lies within the file; says how long the file is."""

    http_status = 416
    code = "RANGE_NOT_SATISFIABLE"

    def __init__(self, message: str, next_step: str, *, size: int) -> None:
        super().__init__(message, next_step)
        self.size = size

    def response_headers(self) -> dict[str, str] | None:
        return {"Content-Range": f"bytes */{self.size}"}


class TooManyRequests(ModelForgeError):
    http_status = 429
    code = "TOO_MANY_REQUESTS"


class InternalError(ModelForgeError):
    """The control plane failed in a way the caller cannot fix: the log has the cause."""

    http_status = 500
    code = "INTERNAL_ERROR"

    def __init__(self) -> None:
        super().__init__(
            "The control plane failed to handle this request.",
            "Retry; if it persists, read the control plane log for the cause.",
        )


class StorageFull(ModelForgeError):
    """A write found no room (the data dir's file system, a quota, or the database server's
    storage): nothing was stored, and reads still work."""

    http_status = 507
    code = "STORAGE_FULL"

    def __init__(self) -> None:
        super().__init__(
            "The control plane's storage is full: nothing was stored.",
            "Retry once there is room. Operators: GET /api/v1/health shows the free space; free "
            "some (POST /api/v1/admin/artifacts/sweep removes artifacts nothing names) or grow "
            "the volume of the data dir (or of the database).",
        )


class ServiceUnavailable(ModelForgeError):
    http_status = 503
    code = "SERVICE_UNAVAILABLE"


class DatabaseUnavailable(ServiceUnavailable):
    """The database cannot be reached or used right now: an outage, not a bug."""

    code = "DATABASE_UNAVAILABLE"

    def __init__(self) -> None:
        super().__init__(
            "The control plane cannot reach its database right now.",
            "Retry in a few seconds. Operators: check that the database server is running and "
            "reachable; the control plane reconnects by itself, without a restart.",
        )


class Busy(ServiceUnavailable):
    """The control plane is saturated: a request waited its full time for a worker or for the
    database and was not carried out (nothing changed). Not an outage."""

    code = "BUSY"

    def __init__(self, waited_for: str) -> None:
        super().__init__(
            f"The control plane is busy: {waited_for}, so this request was not carried out and "
            "nothing changed.",
            "Retry after the Retry-After seconds, with fewer requests at once. Operators: see "
            "Saturation in docs/operations.md.",
        )

    @classmethod
    def for_lane(cls, lane: str, waited_seconds: float) -> Busy:
        return cls(f"no worker for {lane} requests became free within {waited_seconds:g} s")

    @classmethod
    def for_database(cls) -> Busy:
        return cls("it waited too long for the database (every connection in use, or its lock)")

    def response_headers(self) -> dict[str, str] | None:
        return {"Retry-After": "2"}


def refusal_for(error: BaseException) -> ModelForgeError:
    """What a request that raised `error` is answered with, decided once for the app's handlers
    and the audit log: a refusal itself; `STORAGE_FULL` for a write that found no room;
    `DATABASE_UNAVAILABLE` for a database outage; `INTERNAL_ERROR` for anything else."""
    if isinstance(error, ModelForgeError):
        return error
    if is_storage_full(error):
        return StorageFull()
    if is_database_busy(error):  # a wait that ran out: saturation, not an outage
        return Busy.for_database()
    if is_database_unavailable(error):
        return DatabaseUnavailable()
    return InternalError()
