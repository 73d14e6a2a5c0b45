"""The scheduler's request and response bodies: an agent's work claim and the job assigned to
it, the queued work a node could run, and the resources view (`GET /api/v1/admin/resources`)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from control_plane.fleet.schemas import AssignedGpu
from control_plane.schemas import NodeState, StrictModel


class QueuedWork(BaseModel):
    """A queued job or pending service a node could run (the console's node details)."""

    kind: Literal["job", "service"]
    id: str
    name: str
    created_at: datetime
    labels: dict[str, Any]


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
    #: The agent kills the job after this long without reaching the control plane (None:
    #: never; an agent older than this field ignores it).
    stop_after_disconnect_seconds: float | None = None
    #: The job's secrets by name (WL-6a): for its process's environment only.
    secrets: dict[str, str] = Field(default_factory=dict)


# -- the resources view (GET /api/v1/admin/resources) ------------------------------------------


class ResourceAmounts(BaseModel):
    cpus: float
    memory_mb: int
    gpus: int


class NodeCapacity(BaseModel):
    """A node's (or the fleet's) inventory, what running jobs and deployed services hold of it,
    and what is free, as the scheduler counts it when it places work. A GPU out of the schedule
    (unhealthy or quarantined) that no work holds is neither held nor free: total GPUs less held
    less free."""

    total: ResourceAmounts
    held: ResourceAmounts
    free: ResourceAmounts


class HolderRef(BaseModel):
    kind: Literal["job", "service"]
    id: str
    #: A service's name; a job's model (`name@version`), or its id when it runs no model.
    name: str


class ResourceHolder(HolderRef):
    """A running job or deployed service, and what it holds on its node."""

    cpus: float
    memory_mb: int
    #: The indexes of the GPUs it holds.
    gpus: list[int]


class GpuHolding(BaseModel):
    index: int
    uuid: str
    #: The GPU's model, as the node's inventory reports it.
    model: str | None
    #: healthy | degraded (placed on last) | unhealthy | quarantined (both out of the
    #: schedule: no new work), as `GET /api/v1/admin/nodes/{id}/gpus` explains it.
    health: str = "healthy"
    #: Who holds it; null while it is free.
    held_by: HolderRef | None


class WorkSlots(BaseModel):
    """Jobs running on the node (a service takes no work slot). The agent's number of slots
    (`--parallel`) is not reported to the control plane: `total` is null."""

    in_use: int
    total: int | None = None


class TakeableWork(BaseModel):
    """The queued jobs and pending services the node could run (its labels and size fit
    theirs, as `GET /api/v1/admin/nodes/{id}/queued-work` lists them), the oldest ids first."""

    jobs: int
    job_ids: list[str]
    services: int
    service_ids: list[str]


class NodeResources(BaseModel):
    node_id: str
    name: str
    state: NodeState
    needs_upgrade: bool
    labels: dict[str, Any]
    #: Online, compatible and with an inventory: the scheduler places work on it.
    schedulable: bool
    #: Null until the node reports its inventory.
    capacity: NodeCapacity | None
    gpus: list[GpuHolding]
    holders: list[ResourceHolder]
    slots: WorkSlots
    could_take: TakeableWork


class FleetTotals(BaseModel):
    nodes: int
    nodes_by_state: dict[NodeState, int]
    needs_upgrade: int
    #: Summed over every node that reported its inventory.
    capacity: NodeCapacity
    #: Summed over the schedulable nodes only: what work can be placed on now.
    schedulable: NodeCapacity
    slots_in_use: int
    queued_jobs: int
    pending_services: int


class OutstandingRequest(BaseModel):
    request_id: str
    profile: str
    state: str
    slurm_job_id: str | None
    age_seconds: float


class ProvisionerStatus(BaseModel):
    """A provisioner's requests not yet answered by a node (`submitting`, `pending`), oldest
    first, and how many of the nodes it brought are attached now."""

    name: str
    type: str
    outstanding: int
    attached: int
    requests: list[OutstandingRequest]


class ResourcesView(BaseModel):
    read_at: datetime
    fleet: FleetTotals
    nodes: list[NodeResources]
    provisioning: list[ProvisionerStatus]
