"""The model services' request and response bodies (WL-5a): deployment, the service and event
views, and the agents' service sync."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from control_plane.catalog.schemas import ModelRef
from control_plane.fleet.schemas import AssignedGpu
from control_plane.schemas import (
    DB_INT_MAX,
    Digest,
    JobResources,
    Labels,
    Line,
    Name,
    StrictModel,
    Text,
)
from control_plane.vault.schemas import SecretNames

EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")]
EnvValue = Annotated[Line, StringConstraints(max_length=4096)]
Argument = Annotated[Line, StringConstraints(min_length=1, max_length=4096)]


# -- deployment --------------------------------------------------------------------------------


class ServiceHealth(StrictModel):
    #: Strict: `"5"` or `true` for a number is refused, not read as 5.
    model_config = ConfigDict(strict=True)

    #: None: the runner's own (`/v2/health/ready` for onnx, `/` for a command).
    path: Annotated[str, StringConstraints(pattern=r"^/[\x21-\x7e]{0,500}$")] | None = None
    interval_seconds: Annotated[float, Field(ge=0.2, le=3600)] = 5.0
    timeout_seconds: Annotated[float, Field(gt=0, le=600)] = 2.0
    failure_threshold: Annotated[int, Field(ge=1, le=100)] = 3
    start_period_seconds: Annotated[float, Field(ge=0, le=86400)] = 60.0


class ServiceRestart(StrictModel):
    model_config = ConfigDict(strict=True)

    initial_backoff_seconds: Annotated[float, Field(gt=0, le=3600)] = 1.0
    max_backoff_seconds: Annotated[float, Field(gt=0, le=86400)] = 60.0

    @model_validator(mode="after")
    def _ordered(self) -> ServiceRestart:
        if self.max_backoff_seconds < self.initial_backoff_seconds:
            raise ValueError("max_backoff_seconds must not be below initial_backoff_seconds")
        return self


class ServiceBatching(StrictModel):
    """Dynamic batching of an onnx service, in Triton's fields (docs/services.md); 0 is off
    (max_batch_size), never wait (max_queue_delay_microseconds), unbounded (max_queue_size)."""

    model_config = ConfigDict(strict=True)

    max_batch_size: Annotated[int, Field(ge=0, le=1 << 20)] = 0
    preferred_batch_size: Annotated[
        list[Annotated[int, Field(ge=1, le=1 << 20)]], Field(max_length=32)
    ] = Field(default_factory=list)
    max_queue_delay_microseconds: Annotated[int, Field(ge=0, le=60_000_000)] = 0
    max_queue_size: Annotated[int, Field(ge=0, le=1 << 20)] = 0

    @model_validator(mode="after")
    def _preferred_fit(self) -> ServiceBatching:
        if any(size > self.max_batch_size for size in self.preferred_batch_size):
            raise ValueError("preferred_batch_size must not exceed max_batch_size")
        return self


#: Sessions of an onnx service's model (default: one per GPU it holds, one on the CPU).
Instances = Annotated[int, Field(ge=1, le=64, strict=True)]


class ServiceAutoscale(StrictModel):
    """Replicas sized by the requests in flight at the gateway (docs/services.md, Autoscaling
    and scale to zero): `ceil(in flight / target_in_flight)` within `[min, max]`; fewer only
    after `scale_down_seconds` of wishing for fewer; zero (`min` 0) after `idle_seconds`
    without a request."""

    model_config = ConfigDict(strict=True)

    min: Annotated[int, Field(ge=0, le=16)] = 1
    max: Annotated[int, Field(ge=1, le=16)]
    target_in_flight: Annotated[float, Field(gt=0, le=100_000)]
    idle_seconds: Annotated[float, Field(ge=1, le=7 * 86400)] = 300.0
    scale_down_seconds: Annotated[float, Field(ge=0, le=86400)] = 60.0

    @model_validator(mode="after")
    def _ordered(self) -> ServiceAutoscale:
        if self.min > self.max:
            raise ValueError("min must not exceed max")
        return self


class ServiceLlm(StrictModel):
    """An LLM runner's engine (`llama.cpp`; docs/llm.md): each request's context in tokens, the
    requests the engine runs at once (its slots, each holding a context), the layers it puts
    on the GPU (None: all of them when the replica holds a GPU, none on the CPU), the most
    `max_tokens` a request may ask for (None: up to its context), and whether it serves
    `/v1/embeddings` with which pooling of the token vectors (None: it does not)."""

    model_config = ConfigDict(strict=True)

    context_length: Annotated[int, Field(ge=64, le=1 << 20)] = 4096
    slots: Annotated[int, Field(ge=1, le=256)] = 4
    gpu_layers: Annotated[int, Field(ge=0, le=100_000)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    embeddings: Literal["mean", "cls", "last"] | None = None

    @model_validator(mode="after")
    def _within_context(self) -> ServiceLlm:
        if self.max_tokens is not None and self.max_tokens > self.context_length:
            raise ValueError("max_tokens must not exceed context_length")
        return self


#: The runners a service may name: the ONNX model server, and llama.cpp's `llama-server` for a
#: GGUF (an LLM, called through the OpenAI API at `/v1`).
Runner = Literal["onnx", "llama.cpp"]
#: The runners that serve an LLM (their services are the OpenAI API's models).
LLM_RUNNERS = frozenset({"llama.cpp"})


#: An LLM service's other names at the OpenAI API: a service name's shape, at most 8.
Aliases = Annotated[list[Name], Field(max_length=8)]

#: How many copies run, each placed on a node of its own where one fits (else on other GPUs).
ReplicaCount = Annotated[int, Field(ge=1, le=16, strict=True)]


#: The refusal of `batching` or `instances` beside a `command`, deploy's and a change's alike.
SERVING_OPTIONS_NOT_FOR_A_COMMAND = (
    "batching and instances are the onnx runner's; not for a command"
)
#: The refusal of `llm` for anything but an LLM runner.
LLM_OPTIONS_NOT_FOR_THIS_RUNNER = "llm is the llama.cpp runner's; give runner 'llama.cpp'"


class ServiceCreate(StrictModel):
    name: Name
    #: argv; `{weights}` becomes the local path of the weights, `{port}` a free port.
    command: Annotated[list[Argument], Field(min_length=1, max_length=200)] | None = None
    runner: Runner | None = None
    weights: Digest | None = None
    model: ModelRef | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    labels: Labels = Field(default_factory=dict)
    worker_policy: Literal["require", "prefer"] = "require"
    resources: JobResources = Field(default_factory=JobResources)
    health: ServiceHealth | None = None
    restart: ServiceRestart = Field(default_factory=ServiceRestart)
    env: Annotated[dict[EnvName, EnvValue], Field(max_length=100)] = Field(default_factory=dict)
    secrets: SecretNames = Field(default_factory=list)
    #: The onnx runner's dynamic batching and model instances (kept with its params).
    batching: ServiceBatching | None = None
    instances: Instances | None = None
    #: The `llama.cpp` runner's engine (kept with its params; None: the defaults).
    llm: ServiceLlm | None = None
    #: An LLM service's other names at the OpenAI API (`services/aliases.py`).
    aliases: Aliases = Field(default_factory=list)
    #: How many copies run, each placed on a node of its own where one fits (else on other GPUs).
    replicas: ReplicaCount = 1
    #: Replicas that follow the gateway's traffic (then `replicas` is only the start, kept in
    #: its bounds); None: `replicas` fixed.
    autoscale: ServiceAutoscale | None = None

    @model_validator(mode="after")
    def _what_runs(self) -> ServiceCreate:
        if self.command is None and self.runner is None and self.model is None:
            raise ValueError(
                "give a command, a runner (onnx or llama.cpp) or a model (name@version)"
            )
        if self.command is not None and self.runner is not None:
            raise ValueError("give either command or runner, not both")
        if self.weights is not None and self.model is not None:
            raise ValueError("give either weights or model, not both")
        if self.runner is not None and self.weights is None and self.model is None:
            raise ValueError(f"the {self.runner} runner needs weights (a digest) or a model")
        if self.llm is not None and self.runner not in (None, *LLM_RUNNERS):
            raise ValueError(LLM_OPTIONS_NOT_FOR_THIS_RUNNER)
        if self.llm is not None and self.command is not None:
            raise ValueError(LLM_OPTIONS_NOT_FOR_THIS_RUNNER)
        if self.command is not None and self.weights is None and self.model is None:
            if any("{weights}" in argument for argument in self.command):
                raise ValueError("the command names {weights} but no weights or model is given")
        if len(set(self.secrets)) != len(self.secrets):
            raise ValueError("secrets must not name a secret twice")
        if self.command is not None and (self.batching, self.instances) != (None, None):
            raise ValueError(SERVING_OPTIONS_NOT_FOR_A_COMMAND)
        return self


class ServiceUpdate(StrictModel):
    """A change of a deployed service (`PATCH`): each field given replaces the service's; one of
    what runs (all but `replicas` and `autoscale`) makes a new revision and rolls it out.
    A new `model` or `weights` brings its own params, batching and instances unless given."""

    command: Annotated[list[Argument], Field(min_length=1, max_length=200)] | None = None
    runner: Runner | None = None
    weights: Digest | None = None
    model: ModelRef | None = None
    params: dict[str, Any] | None = None
    labels: Labels | None = None
    worker_policy: Literal["require", "prefer"] | None = None
    resources: JobResources | None = None
    health: ServiceHealth | None = None
    restart: ServiceRestart | None = None
    env: Annotated[dict[EnvName, EnvValue], Field(max_length=100)] | None = None
    secrets: SecretNames | None = None
    batching: ServiceBatching | None = None
    instances: Instances | None = None
    llm: ServiceLlm | None = None
    #: Replaces an LLM service's aliases ([] drops them), with no rollout.
    aliases: Aliases | None = None
    replicas: ReplicaCount | None = None
    #: null turns autoscaling off (`replicas` stays as it is).
    autoscale: ServiceAutoscale | None = None

    @model_validator(mode="after")
    def _something(self) -> ServiceUpdate:
        if not self.model_fields_set:
            raise ValueError("give at least one field to change")
        for name in self.model_fields_set - {
            "autoscale",
            "batching",
            "instances",
            "llm",
            "health",
        }:
            if getattr(self, name) is None and name not in (
                "command",
                "runner",
                "weights",
                "model",
            ):
                raise ValueError(f"{name} must not be null")
        if self.command is not None and (self.batching, self.instances) != (None, None):
            raise ValueError(SERVING_OPTIONS_NOT_FOR_A_COMMAND)
        if self.command is not None and self.llm is not None:
            raise ValueError(LLM_OPTIONS_NOT_FOR_THIS_RUNNER)
        return self


# -- views -------------------------------------------------------------------------------------


ServiceState = Literal[
    "pending",
    "starting",
    "healthy",
    "degraded",
    "unhealthy",
    "restarting",
    "stopped",
    "failed",
    "idle",
]


class EngineLoad(StrictModel):
    """The requests an engine generates for now and holds in its own queue, as it reports them
    (llama-server's `requests_processing` and `requests_deferred`)."""

    processing: Annotated[int, Field(ge=0, le=DB_INT_MAX)]
    waiting: Annotated[int, Field(ge=0, le=DB_INT_MAX)]


class ServiceReplicaPublic(BaseModel):
    """One running copy of a service (issue 27)."""

    id: str
    ordinal: int
    revision: int
    state: str
    node_id: str | None
    url: str | None
    grpc_url: str | None
    restarts: int
    last_exit: dict[str, Any] | None
    #: When it last turned healthy (warm); None while it is not.
    ready_at: datetime | None
    assigned_gpus: list[AssignedGpu]
    #: An LLM replica's engine's own load (requests generating and waiting in its queue), as
    #: its node last read it; None for other runners or when unknown.
    engine: EngineLoad | None = None


class ServicePublic(BaseModel):
    service_id: str
    name: str
    #: Its replicas' summary: `healthy` when all are, `degraded` when some are.
    state: ServiceState
    #: `node_id`, `url`, `grpc_url`, `gpus`, `last_exit` and `log_tail` are those of its first
    #: healthy replica (else its first placed one); `restarts` counts all its replicas'.
    node_id: str | None
    url: str | None
    #: `host:port` of the service's gRPC front (the `onnx` runner), as gRPC clients take it.
    grpc_url: str | None = None
    restarts: int
    last_exit: dict[str, Any] | None
    gpus: list[AssignedGpu]
    command: list[str] | None
    runner: str | None
    weights: str | None
    model: str | None
    labels: dict[str, str]
    worker_policy: str
    resources: dict[str, Any]
    health: dict[str, Any]
    restart: dict[str, Any]
    env: dict[str, str]
    secrets: list[str]
    generation: int
    created_at: datetime
    updated_at: datetime
    stopped_at: datetime | None
    #: Only while pending: what keeps it from being placed.
    waiting_reason: dict[str, str] | None = None
    #: The last lines of its output, as its node last reported them.
    log_tail: list[str] = Field(default_factory=list)
    #: The onnx runner's dynamic batching and instances, as deployed (None: off, the default).
    batching: dict[str, Any] | None = None
    instances: int | None = None
    #: An LLM runner's engine, as deployed (`ServiceLlm`, its defaults filled in).
    llm: dict[str, Any] | None = None
    #: An LLM service's other names at the OpenAI API.
    aliases: list[str] = Field(default_factory=list)
    #: How many replicas it runs, and each of them (stopped ones left out).
    desired_replicas: int = 1
    replicas: list[ServiceReplicaPublic] = Field(default_factory=list)
    #: The revision its new replicas run; its autoscaling (None: `desired_replicas` fixed).
    revision: int = 1
    autoscale: dict[str, Any] | None = None
    #: The last rolling update: `state` running, succeeded, failed (with `reason`) or cancelled.
    rollout: dict[str, Any] | None = None
    #: The last request the gateway carried to it (scale to zero counts idleness from it).
    last_request_at: datetime | None = None


class ServiceEventPublic(BaseModel):
    seq: int
    at: datetime
    kind: str
    data: Any
    #: The replica it happened to; None for the service as a whole.
    replica_id: str | None = None


# -- the agents' service sync ------------------------------------------------------------------


class AgentServiceEvent(StrictModel):
    at: datetime | None = None
    kind: Annotated[Line, StringConstraints(min_length=1, max_length=16)]
    data: Any = None


class AgentServiceStatus(StrictModel):
    #: The id the agent runs it by: the `replica_id` of its spec (an agent from before replicas:
    #: the service's id).
    service_id: Annotated[str, StringConstraints(max_length=64)]
    generation: Annotated[int, Field(ge=0, le=DB_INT_MAX)]
    state: Literal["starting", "healthy", "unhealthy", "restarting", "failed", "stopped"]
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    grpc_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    restarts: Annotated[int, Field(ge=0, le=DB_INT_MAX)] = 0
    last_exit: dict[str, Any] | None = None
    events: Annotated[list[AgentServiceEvent], Field(max_length=500)] = Field(default_factory=list)
    log_tail: Annotated[
        list[Annotated[Text, StringConstraints(max_length=4096)]], Field(max_length=200)
    ] = Field(default_factory=list)
    #: The requests in flight to it through the node's tunnel: reported for a replica whose
    #: spec said `draining`, so only to control planes that read it (while control-plane
    #: replicas of two releases serve together, an older one refuses such a sync 422 until the
    #: drain ends; the agent tries again each poll).
    in_flight: Annotated[int, Field(ge=0, le=DB_INT_MAX)] | None = None
    #: The engine's own load at its last healthy probe: reported for a replica whose spec said
    #: `engine_load` (an LLM runner's), None when it could not be read.
    engine: EngineLoad | None = None


ServiceHost = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9.:\[\]-]{1,255}$")]


class AgentServicesSync(StrictModel):
    service_host: ServiceHost | None = None
    services: Annotated[list[AgentServiceStatus], Field(max_length=256)] = Field(
        default_factory=list
    )


class AgentServiceSpec(BaseModel):
    service_id: str
    #: The id the agent runs it by (the runtime worker's service id) and reports it by.
    replica_id: str
    generation: int
    name: str
    command: list[str] | None
    runner: str | None
    weights: str | None
    params: dict[str, Any]
    env: dict[str, str]
    secrets: dict[str, str] = Field(repr=False)
    assigned_gpus: list[AssignedGpu]
    resources: dict[str, Any]
    health: dict[str, Any]
    restart: dict[str, Any]
    #: Out of the gateway's rotation, finishing its requests: the agent reports its
    #: `in_flight` until it is stopped.
    draining: bool = False
    #: An engine whose own load the agent reports (`engine`: an LLM runner's requests
    #: generating and waiting), so only to control planes that read it.
    engine_load: bool = False


class AgentServicesDesired(BaseModel):
    services: list[AgentServiceSpec]
    poll_interval_seconds: float
