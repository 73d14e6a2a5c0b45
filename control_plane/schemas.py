"""Request and response bodies, kept separate from the ORM tables."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from functools import cache
from typing import Annotated, Any, Literal, get_args, get_origin

from fastapi import Path
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from modelforge_contracts.digests import DIGEST_PATTERN
from modelforge_contracts.text import UNSAFE_LINE, UNSAFE_TEXT


def _refuse(unsafe: re.Pattern[str], allowed: str) -> Callable[[str], str]:
    """A validator refusing text shown to people that holds control characters (ANSI escapes
    included) or bidirectional-text controls; `allowed` names the exceptions."""

    def check(value: str) -> str:
        if unsafe.search(value):
            raise ValueError(
                f"must not contain control characters{allowed} (ANSI escapes included) or "
                "bidirectional-text controls"
            )
        return value

    return check


#: A line of text for people: no control characters, no bidirectional-text controls.
Line = Annotated[str, AfterValidator(_refuse(UNSAFE_LINE, " (line breaks too)"))]
#: Text of several lines: the same, but tabs and line breaks allowed.
Text = Annotated[str, AfterValidator(_refuse(UNSAFE_TEXT, " other than tab and line breaks"))]

LabelKey = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([a-z0-9._/-]{0,62})$")]
LabelValue = Annotated[Line, StringConstraints(max_length=128)]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=32)]
Hostname = Annotated[Line, StringConstraints(min_length=1, max_length=255, pattern=r"^[^\s]+$")]
Version = Annotated[Line, StringConstraints(min_length=1, max_length=64)]
NonNegative = Annotated[float, Field(ge=0)]
#: The largest value an INTEGER column holds on PostgreSQL (int4; SQLite holds up to 2**63 - 1):
#: an integer sent to be stored in one, or compared with one, is refused above it.
DB_INT_MAX = 2**31 - 1
#: Path parameters naming a resource (`node_…`, `enr_…`).
ResourceId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
ShortText = Annotated[Line, StringConstraints(max_length=96)]


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(key) or _has_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_has_nul(item) for item in value)
    return False


class StrictModel(BaseModel):
    """Input bodies: unknown fields refused; NUL characters refused (no database stores them)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: Any) -> Any:
        # The message names the field when it is one of the model's, never a key it was sent.
        if isinstance(data, dict):
            for key, item in data.items():
                if _has_nul(key) or _has_nul(item):
                    name = key if key in cls.model_fields else "a field"
                    raise ValueError(f"{name} must not contain NUL characters")
        elif _has_nul(data):
            raise ValueError("the value must not contain NUL characters")
        return data


@cache
def schema_words() -> frozenset[str]:
    """The field names of every request body, and the values of their literal fields (the tags
    of a union among them): the words a validation error may name without quoting the input."""
    words: set[str] = set()
    pending: list[type[BaseModel]] = [StrictModel]
    while pending:
        model = pending.pop()
        pending.extend(model.__subclasses__())
        for name, field in model.model_fields.items():
            words.add(name)
            if field.alias:
                words.add(field.alias)
            if get_origin(field.annotation) is Literal:
                words.update(str(value) for value in get_args(field.annotation))
    return frozenset(words)


# -- errors ------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    code: str
    message: str
    next_step: str


class ErrorBody(BaseModel):
    error: ErrorDetail


# -- enrollments -------------------------------------------------------------------------------


class EnrollmentCreate(StrictModel):
    display_name: Annotated[Line, StringConstraints(min_length=1, max_length=120)]
    expires_in_seconds: int = Field(ge=60, le=86400)
    labels: Labels = Field(default_factory=dict)
    production_eligible: bool = False

    @field_validator("display_name")
    @classmethod
    def _strip(cls, value: str) -> str:
        value = value.strip()
        if not value:
            raise ValueError("display_name must not be blank")
        return value


class EnrollmentPublic(BaseModel):
    enrollment_id: str
    node_id: str
    display_name: str
    labels: dict[str, str]
    state: Literal["pending", "claimed", "revoked", "expired"]
    created_at: datetime
    expires_at: datetime
    claimed_at: datetime | None
    revoked_at: datetime | None
    production_eligible: bool


class EnrollmentMinted(EnrollmentPublic):
    token: str = Field(repr=False)
    api_origin: str


# -- agent -------------------------------------------------------------------------------------


class Fingerprint(StrictModel):
    machine_id: Annotated[Line, StringConstraints(max_length=128)] | None = None
    gpu_uuids: Annotated[
        list[Annotated[Line, StringConstraints(max_length=96)]], Field(max_length=64)
    ] = Field(default_factory=list)


class EnrollRequest(StrictModel):
    token: Annotated[Line, StringConstraints(min_length=1, max_length=256)] = Field(repr=False)
    claim_nonce: Annotated[Line, StringConstraints(min_length=16, max_length=128)] = Field(
        repr=False
    )
    hostname: Hostname
    protocol_version: Any = None
    agent_version: Version
    fingerprint: Fingerprint | None = None


class AgentIntervals(BaseModel):
    heartbeat_interval_seconds: float
    telemetry_interval_seconds: float
    #: The agent resends its inventory at least this often, even unchanged.
    inventory_interval_seconds: float


class EnrollResponse(AgentIntervals):
    node_id: str
    credential: str = Field(repr=False)
    labels: dict[str, str]


class AgentHealth(StrictModel):
    status: Literal["healthy", "degraded", "unhealthy"]
    preflight: Literal["passed", "failed", "not_run"]
    message: Annotated[Line, StringConstraints(max_length=500)] | None = None


class HeartbeatRequest(StrictModel):
    protocol_version: Any = None
    agent_version: Version
    health: AgentHealth


class Compatibility(BaseModel):
    status: Literal["compatible"]
    protocol_version: int
    accepted: list[int]


class HeartbeatResponse(AgentIntervals):
    compatibility: Compatibility


class GpuInventory(StrictModel):
    index: int = Field(ge=0, le=255)
    uuid: Annotated[Line, StringConstraints(min_length=1, max_length=96)]
    name: Annotated[Line, StringConstraints(max_length=128)]
    memory_total_mb: NonNegative | None = None
    driver_version: Annotated[Line, StringConstraints(max_length=64)] | None = None
    cuda_version: Annotated[Line, StringConstraints(max_length=32)] | None = None


class RuntimeWorkerInventory(StrictModel):
    version: Version
    protocol_version: Any = None
    healthy: bool = True


class InventoryRequest(StrictModel):
    hostname: Hostname
    os: Annotated[Line, StringConstraints(max_length=200)]
    agent_version: Version
    accelerator_mode: Literal["nvidia", "cpu"]
    cpu_count: int = Field(ge=1, le=100_000)
    memory_mb: int = Field(ge=1)
    gpus: Annotated[list[GpuInventory], Field(max_length=64)] = Field(default_factory=list)
    runtime_worker: RuntimeWorkerInventory | None = None
    slurm: (
        Annotated[
            dict[
                Annotated[Line, StringConstraints(max_length=64)],
                Annotated[Line, StringConstraints(max_length=1024)],
            ],
            Field(max_length=64),
        ]
        | None
    ) = None


class GpuTelemetry(StrictModel):
    index: int = Field(ge=0, le=255)
    uuid: Annotated[Line, StringConstraints(min_length=1, max_length=96)]
    utilization_percent: Annotated[float, Field(ge=0, le=100)] | None = None
    memory_used_mb: NonNegative | None = None
    memory_total_mb: NonNegative | None = None
    temperature_c: Annotated[float, Field(ge=-50, le=200)] | None = None
    power_draw_w: NonNegative | None = None
    power_limit_w: NonNegative | None = None
    ecc_volatile_corrected: Annotated[int, Field(ge=0)] | None = None
    ecc_volatile_uncorrected: Annotated[int, Field(ge=0)] | None = None
    throttle_reasons: Annotated[list[ShortText], Field(max_length=32)] | None = None


class HostTelemetry(StrictModel):
    cpu_percent: Annotated[float, Field(ge=0, le=100)] | None = None
    memory_used_mb: NonNegative | None = None
    memory_total_mb: NonNegative | None = None


class TelemetryRequest(StrictModel):
    host: HostTelemetry = Field(default_factory=HostTelemetry)
    gpus: Annotated[list[GpuTelemetry], Field(max_length=64)] = Field(default_factory=list)


class Accepted(BaseModel):
    accepted: bool = True
    received_at: datetime


# -- nodes -------------------------------------------------------------------------------------

NodeState = Literal["online", "stale", "offline"]


class NeedsUpgrade(BaseModel):
    code: str
    component: str
    detail: str


class DuplicateIdentity(BaseModel):
    other_node_ids: list[str]
    message: str
    next_step: str


class NodePublic(BaseModel):
    node_id: str
    enrollment_id: str
    display_name: str
    hostname: str
    labels: dict[str, str]
    state: NodeState
    created_at: datetime
    last_heartbeat_at: datetime | None
    agent_version: str | None
    protocol_version: int | None
    health: dict[str, Any] | None
    needs_upgrade: NeedsUpgrade | None
    duplicate_identity: DuplicateIdentity | None
    inventory: dict[str, Any] | None
    inventory_at: datetime | None
    telemetry: dict[str, Any] | None
    telemetry_at: datetime | None
    #: When the node's active credential expires (CR-3); null with none active, or one issued
    #: before credentials expired.
    credential_expires_at: datetime | None = None


class NodeEventPublic(BaseModel):
    id: int
    at: datetime
    kind: str
    from_state: str | None
    to_state: str | None
    reason: str


class ReadinessCheck(BaseModel):
    name: str
    status: Literal["pass", "fail", "unknown"]
    detail: str
    next_step: str


class Readiness(BaseModel):
    node_id: str
    ready: bool
    checks: list[ReadinessCheck]


class CredentialRevocation(BaseModel):
    node_id: str
    revoked: int


class CredentialPublic(BaseModel):
    """A node credential as the admin API lists it (CR-3): never the credential itself."""

    jti: str
    node_id: str
    labels: dict[str, Any]
    issuer: str | None
    issued_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    revoked_reason: str | None


class KeyRotation(BaseModel):
    kid: str
    revoked_credentials: int


class StorageHealth(BaseModel):
    """The room left in the data dir (the least of its file systems, the artifacts' included)."""

    status: Literal["ok", "low"]
    free_bytes: int
    total_bytes: int
    #: `MODELFORGE_STORAGE_LOW_FREE_BYTES`: below this much free room the status is `low`.
    low_below_bytes: int


class Health(BaseModel):
    #: `degraded`: it serves, but needs an operator soon (the storage is low).
    status: Literal["ok", "degraded"]
    database: Literal["ok"]
    storage: StorageHealth


class VersionInfo(BaseModel):
    version: str
    protocol_version: int
    accepted_protocols: list[int]


# -- jobs ------------------------------------------------------------------------------

Digest = Annotated[str, StringConstraints(pattern=f"^{DIGEST_PATTERN}$")]
Identifier = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=100)]
ModuleName = Annotated[
    str,
    StringConstraints(
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", max_length=200
    ),
]
SourcePath = Annotated[
    str,
    StringConstraints(
        pattern=r"^([A-Za-z_][A-Za-z0-9_]*/)*[A-Za-z_][A-Za-z0-9_]*\.py$", max_length=200
    ),
]
MAX_SOURCE_BYTES = 1_000_000


class PythonEntrypoint(StrictModel):
    kind: Literal["python"]
    module: ModuleName
    function: Identifier
    source: Annotated[dict[SourcePath, str], Field(max_length=200)] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _source_size(self) -> PythonEntrypoint:
        if sum(len(text.encode()) for text in self.source.values()) > MAX_SOURCE_BYTES:
            raise ValueError(f"source must not exceed {MAX_SOURCE_BYTES} bytes in total")
        return self


class OnnxEntrypoint(StrictModel):
    kind: Literal["onnx"]
    model: Digest


Entrypoint = Annotated[PythonEntrypoint | OnnxEntrypoint, Field(discriminator="kind")]


class JobResources(StrictModel):
    #: Strict: `"1"` or `true` for a number is refused, not read as 1.
    model_config = ConfigDict(strict=True)

    cpus: Annotated[float, Field(ge=0, le=4096)] = 1.0
    gpus: Annotated[int, Field(ge=0, le=64)] = 0
    memory_mb: Annotated[int, Field(ge=0, le=16_000_000)] = 0


ModelRef = Annotated[
    str,
    StringConstraints(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}@[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$",
        max_length=201,
    ),
]
SecretName = Annotated[str, StringConstraints(pattern=r"^[A-Z_][A-Z0-9_]{0,99}$")]
SecretNames = Annotated[list[SecretName], Field(max_length=32)]


class JobCreate(StrictModel):
    entrypoint: Entrypoint | None = None
    #: `name@version` of a model (WL-5c): its weights run with its runner and default params
    #: (the job's own params override them). Either this or `entrypoint`.
    model: ModelRef | None = None
    #: Secrets (WL-6a) given to the job's process as environment variables; the job runs only
    #: on nodes whose signed labels carry every secret's labels.
    secrets: SecretNames = Field(default_factory=list)
    params: dict[str, Any] = Field(default_factory=dict)
    inputs: Annotated[dict[Identifier, Digest], Field(max_length=100)] = Field(default_factory=dict)
    resources: JobResources = Field(default_factory=JobResources)
    labels: Labels = Field(default_factory=dict)
    worker_policy: Literal["require", "prefer"] = "require"
    timeout_seconds: Annotated[float, Field(strict=True, gt=0, le=7 * 86400)] = 3600.0
    silence_timeout_seconds: Annotated[float, Field(strict=True, gt=0, le=86400)] = 600.0

    @model_validator(mode="after")
    def _entrypoint_or_model(self) -> JobCreate:
        if (self.entrypoint is None) == (self.model is None):
            raise ValueError("give either entrypoint or model (name@version), not both")
        if len(set(self.secrets)) != len(self.secrets):
            raise ValueError("secrets must not name a secret twice")
        return self


class JobBatchCreate(StrictModel):
    """`POST /api/v1/jobs:batch`: many jobs, queued together or not at all."""

    jobs: Annotated[list[JobCreate], Field(min_length=1, max_length=1000)]


class JobError(BaseModel):
    code: str
    message: str


class AssignedGpu(BaseModel):
    """One GPU of the node a job holds: its NVML index and its UUID."""

    index: int
    uuid: str


JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class WaitingReason(BaseModel):
    """Why a queued job has not started, as the scheduler last saw the fleet (SC-4)."""

    code: str
    message: str
    next_step: str


class QueuedWork(BaseModel):
    """A queued job or pending service a node could run (the console's node details)."""

    kind: Literal["job", "service"]
    id: str
    name: str
    created_at: datetime
    labels: dict[str, Any]


class JobPublic(BaseModel):
    job_id: str
    state: JobState
    node_id: str | None
    entrypoint: dict[str, Any]
    params: dict[str, Any]
    inputs: dict[str, str]
    resources: dict[str, Any]
    labels: dict[str, str]
    worker_policy: str
    timeout_seconds: float
    silence_timeout_seconds: float
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested: bool
    result: Any = None
    outputs: dict[str, str] | None
    error: JobError | None
    #: The GPUs of its node the job holds (or held): empty while queued and for `gpus: 0`.
    assigned_gpus: list[AssignedGpu] = Field(default_factory=list)
    #: Only while queued: what keeps it from starting.
    waiting_reason: WaitingReason | None = None
    #: The model it was submitted with (`name@version`), if any.
    model: str | None = None
    #: The names of the secrets it receives (never their values).
    secrets: list[str] = Field(default_factory=list)


class JobBatchPublic(BaseModel):
    jobs: list[JobPublic]


class JobEventPublic(BaseModel):
    seq: int
    at: datetime
    kind: str
    data: Any


class WorkClaim(StrictModel):
    hold_seconds: Annotated[float, Field(ge=0, le=60)] = 25.0


class JobAssignment(BaseModel):
    job_id: str
    entrypoint: dict[str, Any]
    params: dict[str, Any]
    inputs: dict[str, str]
    resources: dict[str, Any]
    #: Exactly the GPUs the job may see; empty for `gpus: 0`.
    assigned_gpus: list[AssignedGpu]
    timeout_seconds: float
    silence_timeout_seconds: float
    progress_interval_seconds: float
    #: The job's secrets by name (WL-6a): for its process's environment only.
    secrets: dict[str, str] = Field(default_factory=dict)


class AgentJobEvent(StrictModel):
    kind: Literal["event", "log", "progress"]
    data: Any = None


class AgentJobReport(StrictModel):
    events: Annotated[list[AgentJobEvent], Field(max_length=1000)] = Field(default_factory=list)


class AgentJobControl(BaseModel):
    cancel: bool


class AgentJobWatch(StrictModel):
    job_ids: Annotated[
        list[Annotated[str, StringConstraints(max_length=64)]], Field(max_length=256)
    ]
    hold_seconds: Annotated[float, Field(ge=0, le=60)] = 25.0


class AgentJobCancellations(BaseModel):
    cancel: list[str]


class JobErrorReport(StrictModel):
    """A failed job's error as its node reports it; the message may span lines (a traceback)."""

    code: Annotated[Line, StringConstraints(min_length=1, max_length=100)]
    message: Annotated[Text, StringConstraints(max_length=65536)] = ""


class AgentJobComplete(StrictModel):
    state: Literal["succeeded", "failed"]
    result: Any = None
    outputs: Annotated[dict[Identifier, Digest], Field(max_length=100)] = Field(
        default_factory=dict
    )
    error: JobErrorReport | None = None


class ArtifactPublic(BaseModel):
    digest: str
    size_bytes: int
    created_at: datetime
