"""The resources view (`GET /api/v1/admin/resources`): per node its total, held and free CPUs,
memory and GPUs (which GPUs, held by which job or service), its jobs running and the queued work
it could take; the fleet's sums; the provisioners' outstanding requests. Only reads.

One source of truth: the nodes are read by `waiting.read_fleet` and their free capacity counted
by `placement.held_back`, as the scheduler counts it when it places work, and what a node could
take is `waiting.could_take`'s rule (the node's queued-work list uses the same). The provisioning
part is handed in: provisioning lies above scheduling.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.fleet.liveness import Liveness
from control_plane.models import Job, ServiceReplica
from control_plane.scheduling.placement import Holding
from control_plane.scheduling.schemas import (
    FleetTotals,
    GpuHolding,
    HolderRef,
    NodeCapacity,
    NodeResources,
    ProvisionerStatus,
    QueuedWork,
    ResourceAmounts,
    ResourceHolder,
    ResourcesView,
    TakeableWork,
    WorkSlots,
)
from control_plane.scheduling.shapes import Capacity, Shape
from control_plane.scheduling.waiting import FleetNode, could_take, queued_work, read_fleet
from control_plane.schemas import NodeState

#: The provisioners' outstanding requests, read in the view's session.
ProvisioningStatus = Callable[[Session], list[ProvisionerStatus]]

#: How many queued job ids (and pending service ids) each node lists, by default and at most.
LISTED_DEFAULT = 5
LISTED_MAX = 50


def read_resources(
    *,
    session: Session,
    now: datetime,
    liveness: Liveness,
    provisioning: ProvisioningStatus,
    listed: int = LISTED_DEFAULT,
) -> ResourcesView:
    """Every node (by name), the fleet's sums and the provisioning status, as of `now`."""
    holdings: dict[str, list[Holding]] = {}
    fleet = read_fleet(session, now=now, liveness=liveness, holdings=holdings)
    by_shape = _by_shape(queued_work(session))
    nodes = [
        _node_resources(node, holdings.get(node.id, []), by_shape, listed)
        for node in sorted(fleet.nodes, key=lambda node: (node.name, node.id))
    ]
    return ResourcesView(
        read_at=now,
        fleet=_fleet_totals(session, nodes),
        nodes=nodes,
        provisioning=provisioning(session),
    )


def _by_shape(queued: list[tuple[QueuedWork, Shape]]) -> dict[Shape, list[QueuedWork]]:
    """The queued work by shape, each oldest first: a node is judged once per shape."""
    found: dict[Shape, list[QueuedWork]] = {}
    for work, shape in queued:
        found.setdefault(shape, []).append(work)
    return found


def _node_resources(
    node: FleetNode,
    held: list[Holding],
    by_shape: dict[Shape, list[QueuedWork]],
    listed: int,
) -> NodeResources:
    gpus, indexes = _gpus(node, held)
    return NodeResources(
        node_id=node.id,
        name=node.name,
        state=node.state,
        needs_upgrade=node.needs_upgrade,
        labels=node.labels,
        schedulable=node.usable,
        capacity=(
            _capacity(node.size, node.free)
            if node.size is not None and node.free is not None
            else None
        ),
        gpus=gpus,
        holders=[
            ResourceHolder(
                kind=holding.kind,
                id=holding.id,
                name=holding.name,
                cpus=_cpus(holding.request.cpus),
                memory_mb=holding.request.memory_mb,
                gpus=indexes.get((holding.kind, holding.id), []),
            )
            for holding in held
        ],
        slots=WorkSlots(in_use=sum(holding.kind == "job" for holding in held)),
        could_take=_takeable(node, by_shape, listed),
    )


def _gpus(
    node: FleetNode, held: list[Holding]
) -> tuple[list[GpuHolding], dict[tuple[str, str], list[int]]]:
    """Every GPU of the node's inventory, its health and who holds it; and per holder its GPUs'
    indexes."""
    if node.size is None or node.free is None:
        return [], {}
    free = {gpu["uuid"] for gpu in node.free.gpus + node.free.blocked}
    owners: dict[str, Holding] = {}
    for holding in held:
        for uuid in holding.gpus or ():
            owners.setdefault(uuid, holding)
    # A job from before GPUs were assigned holds as many as it asked for, which ones unknown:
    # the held GPUs no one is on record for are put down to it.
    unknown = [
        holding for holding in held if holding.gpus is None for _ in range(holding.request.gpus)
    ]
    models = _gpu_models(node.inventory or {})
    rows: list[GpuHolding] = []
    indexes: dict[tuple[str, str], list[int]] = {}
    for gpu in node.size.gpus:
        holder: Holding | None = None
        if gpu["uuid"] not in free:
            holder = owners.get(gpu["uuid"]) or (unknown.pop(0) if unknown else None)
        if holder is not None:
            indexes.setdefault((holder.kind, holder.id), []).append(gpu["index"])
        rows.append(
            GpuHolding(
                index=gpu["index"],
                uuid=gpu["uuid"],
                model=models.get(gpu["uuid"]),
                health=node.gpu_health.get(gpu["uuid"], "healthy"),
                held_by=(
                    None
                    if holder is None
                    else HolderRef(kind=holder.kind, id=holder.id, name=holder.name)
                ),
            )
        )
    return rows, indexes


def _gpu_models(inventory: dict[str, Any]) -> dict[str, str]:
    return {
        str(gpu["uuid"]): str(gpu["name"])
        for gpu in inventory.get("gpus") or []
        if isinstance(gpu, dict) and gpu.get("uuid") and gpu.get("name")
    }


def _takeable(
    node: FleetNode, by_shape: dict[Shape, list[QueuedWork]], listed: int
) -> TakeableWork:
    take = could_take(node.id, node.labels, node.size)
    fitting = [work for shape, works in by_shape.items() if take(shape) for work in works]
    fitting.sort(key=lambda work: (work.created_at, work.id))
    jobs = [work.id for work in fitting if work.kind == "job"]
    services = [work.id for work in fitting if work.kind == "service"]
    return TakeableWork(
        jobs=len(jobs),
        job_ids=jobs[:listed],
        services=len(services),
        service_ids=services[:listed],
    )


def _capacity(size: Capacity, free: Capacity) -> NodeCapacity:
    """Free GPUs out of the schedule are neither held nor free: total less held less free."""
    return NodeCapacity(
        total=_amounts(size),
        held=ResourceAmounts(
            cpus=_cpus(size.cpus - free.cpus),
            memory_mb=size.memory_mb - free.memory_mb,
            gpus=len(size.gpus) - len(free.gpus) - len(free.blocked),
        ),
        free=_amounts(free),
    )


def _amounts(capacity: Capacity) -> ResourceAmounts:
    return ResourceAmounts(
        cpus=_cpus(capacity.cpus), memory_mb=capacity.memory_mb, gpus=len(capacity.gpus)
    )


def _cpus(cpus: float) -> float:
    """Without the float arithmetic's noise (16 - 0.1 - 0.2 is 15.700000000000001)."""
    return round(cpus, 6)


def _fleet_totals(session: Session, nodes: list[NodeResources]) -> FleetTotals:
    by_state: dict[NodeState, int] = {"online": 0, "stale": 0, "offline": 0}
    for node in nodes:
        by_state[node.state] += 1
    queued_jobs = session.scalar(select(func.count()).where(Job.state == "queued")) or 0
    pending_services = (
        session.scalar(
            select(func.count(func.distinct(ServiceReplica.service_id))).where(
                ServiceReplica.state == "pending"
            )
        )
        or 0
    )
    return FleetTotals(
        nodes=len(nodes),
        nodes_by_state=by_state,
        needs_upgrade=sum(node.needs_upgrade for node in nodes),
        capacity=_sum(node.capacity for node in nodes),
        schedulable=_sum(node.capacity for node in nodes if node.schedulable),
        slots_in_use=sum(node.slots.in_use for node in nodes),
        queued_jobs=queued_jobs,
        pending_services=pending_services,
    )


def _sum(capacities: Any) -> NodeCapacity:
    parts = [capacity for capacity in capacities if capacity is not None]

    def total(pick: Callable[[NodeCapacity], ResourceAmounts]) -> ResourceAmounts:
        return ResourceAmounts(
            cpus=_cpus(sum(pick(part).cpus for part in parts)),
            memory_mb=sum(pick(part).memory_mb for part in parts),
            gpus=sum(pick(part).gpus for part in parts),
        )

    return NodeCapacity(
        total=total(lambda part: part.total),
        held=total(lambda part: part.held),
        free=total(lambda part: part.free),
    )
