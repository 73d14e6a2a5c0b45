"""The fleet's request and response bodies: enrollments, the agent's enroll, heartbeat,
inventory and telemetry, the node views (state, readiness, telemetry history, credentials) and
the Enroll node wizard's node image and setup."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from control_plane.schemas import (
    DB_INT_MAX,
    Hostname,
    Labels,
    Line,
    NodeState,
    NonNegative,
    ShortText,
    StrictModel,
    Text,
    Version,
)
from modelforge_contracts import gpu_health as gpu_contract

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


#: A counter an agent reports (JSON numbers past 64 bits are refused).
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
#: What an agent judges a GPU to be (issue 28); the control plane's rules make `state` of it.
GpuHealthJudgement = Literal["healthy", "degraded", "unhealthy"]


class GpuEvidence(StrictModel):
    """One thing the agent saw of a GPU: an XID event, an ECC count, row remapping, retired
    pages, the GPU lost, a persistent slowdown, a growing corrected-ECC count."""

    kind: Literal["xid", "ecc", "remap", "retired_pages", "lost", "throttle", "corrected_ecc"]
    at: AwareDatetime
    detail: Annotated[Line, StringConstraints(max_length=gpu_contract.MAX_DETAIL)] = ""
    xid: int | None = Field(default=None, ge=0, le=DB_INT_MAX)
    value: Count | None = None

    @model_validator(mode="after")
    def _xid_with_its_kind(self) -> GpuEvidence:
        if (self.kind == "xid") != (self.xid is not None):
            raise ValueError("xid is given for evidence of kind xid, and only for it")
        return self

    def stored(self) -> dict[str, Any]:
        """As kept in the GPU's evidence: JSON, `at` in ISO-8601 UTC, absent values left out."""
        entry: dict[str, Any] = {
            "kind": self.kind,
            "at": self.at.astimezone(UTC).isoformat(),
            "detail": self.detail,
        }
        if self.xid is not None:
            entry["xid"] = self.xid
        if self.value is not None:
            entry["value"] = self.value
        return entry


class GpuHealthReport(StrictModel):
    index: int = Field(ge=0, le=255)
    uuid: Annotated[Line, StringConstraints(min_length=1, max_length=96)]
    state: GpuHealthJudgement
    reason: Annotated[Line, StringConstraints(max_length=gpu_contract.MAX_REASON)] = ""
    evidence: Annotated[list[GpuEvidence], Field(max_length=gpu_contract.MAX_EVIDENCE)] = Field(
        default_factory=list
    )
    #: Application XIDs (13, 31, 43, 45, ...) counted by code; never a change alone.
    xid_counts: (
        Annotated[
            dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,6}$")], Count],
            Field(max_length=gpu_contract.MAX_XID_COUNTS),
        ]
        | None
    ) = None


class GpuHealthRequest(StrictModel):
    """`POST /api/v1/agent/gpu-health`: the agent's current judgement of every GPU at once."""

    gpus: Annotated[list[GpuHealthReport], Field(max_length=gpu_contract.MAX_GPUS)]

    @model_validator(mode="after")
    def _each_gpu_once(self) -> GpuHealthRequest:
        if len({gpu.uuid for gpu in self.gpus}) != len(self.gpus):
            raise ValueError("each GPU (uuid) is reported once")
        return self


# -- nodes -------------------------------------------------------------------------------------


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


class AssignedGpu(BaseModel):
    """One GPU of the node a job holds: its NVML index and its UUID."""

    index: int
    uuid: str


# -- a GPU's health as operators see and change it (issue 28) ----------------------------------

GpuState = Literal["healthy", "degraded", "unhealthy", "quarantined"]
GpuRulesState = Literal["healthy", "degraded", "unhealthy"]


class GpuQuarantine(BaseModel):
    reason: str
    at: datetime


class GpuCheck(BaseModel):
    """The active check running on a GPU: its job and that job's state."""

    job_id: str
    state: str


class GpuHealthPublic(BaseModel):
    """One GPU of a node: the state the scheduler reads and why."""

    index: int
    uuid: str
    name: str | None
    state: GpuState
    rules_state: GpuRulesState
    reported: GpuRulesState
    reason: str
    evidence: list[dict[str, Any]]
    since: datetime | None
    quarantine: GpuQuarantine | None
    check: GpuCheck | None


class GpuHealthEventPublic(BaseModel):
    id: int
    at: datetime
    kind: Literal["state", "quarantine", "readmit", "check"]
    from_state: str | None
    to_state: str | None
    reason: str
    evidence: list[dict[str, Any]] | None
    actor: str


class QuarantineRequest(StrictModel):
    reason: Annotated[Text, StringConstraints(min_length=1, max_length=500)]

    @field_validator("reason")
    @classmethod
    def _strip(cls, value: str) -> str:
        value = value.strip()
        if not value:
            raise ValueError("reason must not be blank")
        return value


# -- the console's telemetry history -----------------------------------------------------------


class GpuPoint(BaseModel):
    index: int
    uuid: str
    utilization_percent: float | None
    memory_used_mb: float | None
    memory_total_mb: float | None
    #: Where the GPU reports them (NVML may not, for a given board).
    temperature_c: float | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None


class TelemetryPoint(BaseModel):
    at: datetime
    cpu_percent: float | None
    gpus: list[GpuPoint]


# -- the Enroll node wizard --------------------------------------------------------------------

#: The node agent's bound on MODELFORGE_AGENT_PARALLEL (a work slot is a held claim and a thread).
AGENT_MAX_PARALLEL = 256
#: The longest idle exit the wizard writes: a year (0 writes "never").
AGENT_MAX_IDLE_SECONDS = 365 * 24 * 3600


class NodeImageRequest(StrictModel):
    image_source: Literal["bundle", "registry"] = "bundle"
    #: Bundle mode: the pasted `images.modelforge-node-agent` entry of the release manifest.
    manifest_entry: Annotated[Text, StringConstraints(max_length=65536)] | None = None
    #: Registry mode: an image reference pinned by digest, `name@sha256:<64 hex>`.
    registry_image: Annotated[str, StringConstraints(max_length=400)] | None = None


class NodeImage(BaseModel):
    image: str
    #: What the pasted entry was checked against: the configured release manifest, or only
    #: what this control plane knows of its own release.
    checked_against: str


class NodeSetupRequest(NodeImageRequest):
    #: The console's own origin; the node agent is pointed at exactly this.
    api_origin: Annotated[str, StringConstraints(min_length=1, max_length=300)]
    accelerator_mode: Literal["nvidia", "cpu"] = "nvidia"
    #: The operator's confirmation that a plain `http://` origin beyond loopback is a trusted
    #: LAN: the node's token, credential and calls cross it unencrypted
    #: (MODELFORGE_AGENT_ALLOW_INSECURE_HTTP). Refused where the origin needs none.
    allow_insecure_http: Annotated[bool, Field(strict=True)] = False
    # What the node offers and its idle exit: the agent's MODELFORGE_AGENT_* variables, within
    # the agent's own bounds (docs/nodes.md). Each left out is left to the agent (detected, or
    # its default), so the `.env` gets no line for it. Strict: `"3"`, `true` or `3.5` is refused.
    #: Jobs at once (MODELFORGE_AGENT_PARALLEL).
    parallel: Annotated[int, Field(strict=True, ge=1, le=AGENT_MAX_PARALLEL)] | None = None
    #: CPUs offered (MODELFORGE_AGENT_CPUS).
    cpus: Annotated[int, Field(strict=True, ge=1, le=100_000)] | None = None
    #: At most this many GPUs offered, 0: none (MODELFORGE_AGENT_GPUS).
    gpus: Annotated[int, Field(strict=True, ge=0, le=64)] | None = None
    #: Memory offered in MB (MODELFORGE_AGENT_RAM_MB).
    ram_mb: Annotated[int, Field(strict=True, ge=1, le=DB_INT_MAX)] | None = None
    #: Exit after this long with no job or service, 0: never (MODELFORGE_AGENT_MAX_IDLE_SECONDS).
    max_idle_seconds: Annotated[int, Field(strict=True, ge=0, le=AGENT_MAX_IDLE_SECONDS)] | None = (
        None
    )


class NodeSetup(NodeImage):
    enrollment_id: str
    node_id: str
    #: The `.env` lets the agent use plain http:// (confirmed with `allow_insecure_http`).
    insecure_http: bool
    env_file: str
    start_command: str
    recreate_command: str
