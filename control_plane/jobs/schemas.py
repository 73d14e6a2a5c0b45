"""The jobs' request and response bodies: submission (an entrypoint or a model), the job and
event views, and what an agent reports of a job it runs (events, watch, completion)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints, model_validator

from control_plane.catalog.schemas import ModelRef
from control_plane.fleet.schemas import AssignedGpu
from control_plane.schemas import Digest, JobResources, Labels, Line, StrictModel, Text
from control_plane.vault.schemas import SecretNames

# -- submission --------------------------------------------------------------------------------


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
    #: The interpreter: the node's Python (its agent's MODELFORGE_AGENT_PYTHON; the runtime
    #: worker's own where the node names none) or always the runtime worker's own.
    python: Literal["node", "worker"] = "node"

    @model_validator(mode="after")
    def _source_size(self) -> PythonEntrypoint:
        if sum(len(text.encode()) for text in self.source.values()) > MAX_SOURCE_BYTES:
            raise ValueError(f"source must not exceed {MAX_SOURCE_BYTES} bytes in total")
        return self


class OnnxEntrypoint(StrictModel):
    kind: Literal["onnx"]
    model: Digest


Entrypoint = Annotated[PythonEntrypoint | OnnxEntrypoint, Field(discriminator="kind")]


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
    #: Once its node has not reached the control plane for this long, the node's agent kills
    #: the job itself and reports it `JOB_NODE_CUT_OFF` when contact returns. Unset (the
    #: default): it runs on through any outage, as a control plane's restart must not end work;
    #: the control plane fails it `JOB_CONTACT_LOST` after its contact timeout all the same.
    stop_after_disconnect_seconds: Annotated[float, Field(strict=True, ge=1, le=86400)] | None = (
        None
    )

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


# -- views -------------------------------------------------------------------------------------


class JobError(BaseModel):
    code: str
    message: str


JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class WaitingReason(BaseModel):
    """Why a queued job has not started, as the scheduler last saw the fleet (SC-4)."""

    code: str
    message: str
    next_step: str


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
    stop_after_disconnect_seconds: float | None = None
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


# -- the agent's reports -----------------------------------------------------------------------


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
