"""Why a queued job waits (SC-4), whether a `prefer` job's labelled nodes have room, and which
queued work a node could take at all (`could_take`, `queued_work`).

The first two read a `Fleet`: every node's labels, liveness, compatibility, inventory and free
capacity, read in two queries and kept by the scheduler for about a second, so the answer follows
the fleet as it changes without a query per job or per node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.errors import InvalidRequest, NotFound
from control_plane.fleet.gpu_health import OUT_OF_SCHEDULE
from control_plane.fleet.liveness import Liveness
from control_plane.jobs.schemas import WaitingReason
from control_plane.models import Job, Node, Service, ServiceReplica
from control_plane.scheduling.gpu_reasons import GpuNotes, OutOfSchedule, name_out_of_schedule
from control_plane.scheduling.placement import Holding, gpu_health, held_back
from control_plane.scheduling.queue import QUEUED_COLUMNS, queued_job
from control_plane.scheduling.schemas import QueuedWork
from control_plane.scheduling.shapes import Capacity, Request, Shape, labels_match
from control_plane.schemas import NodeState
from control_plane.services.placement import shape_of

#: Node ids per `IN (…)` list when re-reading changed nodes.
_READ_CHUNK = 500


@dataclass(frozen=True)
class FleetNode:
    id: str
    name: str
    labels: dict[str, Any]
    state: NodeState
    needs_upgrade: bool
    inventory: dict[str, Any] | None
    total: Capacity | None
    free: Capacity | None
    #: The services deployed here, which hold their resources while deployed.
    services: tuple[str, ...] = ()
    #: When its inventory was last reported: the next read parses it again only if it moved.
    inventory_at: datetime | None = None
    #: Its GPUs that are not healthy, by UUID: their state (issue 28). `total` and `free` keep
    #: those out of the schedule apart (`Capacity.blocked`).
    gpu_health: dict[str, str] = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        return self.state == "online" and not self.needs_upgrade and self.total is not None

    @property
    def size(self) -> Capacity | None:
        """Its whole inventory, GPUs out of the schedule included: whether it is big enough at
        all (a GPU's health changes by the second; the batch judges it)."""
        return None if self.total is None else self.total.counting_blocked()


@dataclass(frozen=True)
class Fleet:
    nodes: tuple[FleetNode, ...]
    read_at: datetime

    @cached_property
    def by_id(self) -> dict[str, FleetNode]:
        return {node.id: node for node in self.nodes}

    def may_take(self, node_id: str, shapes: list[Shape]) -> bool:
        """Whether the node, as last seen, could run a job of one of `shapes` at all: its
        labels (unless `prefer`) and its size. Liveness, compatibility and free capacity change
        by the second; the batch judges them exactly. A node not seen yet, or without an
        inventory then, may."""
        node = self.by_id.get(node_id)
        if node is None or node.size is None:
            return True
        size = node.size
        return any(
            (shape.prefer or labels_match(shape.labels, node.labels))
            and shape.admits(node.labels, node_id)
            and shape.fits(size)
            for shape in shapes
        )

    def room_for(self, shape: Shape) -> bool:
        """An online, compatible node carrying the shape's labels had room for it."""
        return any(
            node.usable
            and node.free is not None
            and labels_match(shape.labels, node.labels)
            and shape.admits(node.labels, node.id)
            and shape.fits(node.free)
            for node in self.nodes
        )

    def carrying(self, shape: Shape) -> dict[str, dict[str, Any]]:
        """The inventories of the usable nodes that carry the shape's labels."""
        return {
            node.id: node.inventory
            for node in self.nodes
            if node.usable
            and node.inventory
            and labels_match(shape.labels, node.labels)
            and shape.admits(node.labels, node.id)
        }


def read_fleet(
    session: Session,
    *,
    now: datetime,
    liveness: Liveness,
    previous: Fleet | None = None,
    holdings: dict[str, list[Holding]] | None = None,
) -> Fleet:
    """Every node, as now. With `previous` (the last view), only the nodes whose inventory
    changed since, or that are new, have their labels and inventory read and parsed again: a
    node's labels never change (they are signed into its credential at enrollment), and its
    inventory changes only with `inventory_at`. At a thousand nodes that is most of the cost of
    a read, which runs every second while claims wait. The GPUs not healthy are read once per
    read (few rows), and a node's capacity built again only when its inventory or its GPUs'
    health changed. `holdings`, when given, receives what each node's free capacity was counted
    without (`placement.held_back`)."""
    rows = session.execute(
        select(
            Node.id, Node.display_name, Node.compat_code, Node.last_heartbeat_at, Node.inventory_at
        ).order_by(Node.id)
    ).all()
    known = previous.by_id if previous is not None else {}
    stale = [
        row.id
        for row in rows
        if (seen := known.get(row.id)) is None or seen.inventory_at != row.inventory_at
    ]
    fresh: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {}
    for start in range(0, len(stale), _READ_CHUNK):
        chunk = stale[start : start + _READ_CHUNK]
        for node_id, labels, inventory in session.execute(
            select(Node.id, Node.labels, Node.inventory).where(Node.id.in_(chunk))
        ):
            fresh[node_id] = (dict(labels or {}), inventory)

    health = gpu_health(session, [row.id for row in rows])

    def described(row: Any) -> tuple[dict[str, Any], dict[str, Any] | None, Capacity | None]:
        if row.id in fresh:
            labels, inventory = fresh[row.id]
        else:
            seen = known[row.id]
            if seen.gpu_health == health.get(row.id, {}):
                return seen.labels, seen.inventory, seen.total
            labels, inventory = seen.labels, seen.inventory
        total = Capacity.of_inventory(inventory, health.get(row.id)) if inventory else None
        return labels, inventory, total

    # A node deleted between the two reads has no fresh row: it is left out.
    nodes = {row.id: (row, *described(row)) for row in rows if row.id in fresh or row.id in known}
    holders: dict[str, list[str]] = {}
    free = held_back(
        session,
        {node_id: total for node_id, (_, _, _, total) in nodes.items() if total},
        holders,
        holdings=holdings,
    )
    return Fleet(
        tuple(
            FleetNode(
                id=row.id,
                name=row.display_name,
                labels=labels,
                state=liveness.state_of(row.id, row.last_heartbeat_at, now),
                needs_upgrade=row.compat_code is not None,
                inventory=inventory,
                total=total,
                free=free.get(row.id),
                services=tuple(holders.get(row.id, ())),
                inventory_at=row.inventory_at,
                gpu_health=health.get(row.id, {}),
            )
            for row, labels, inventory, total in nodes.values()
        ),
        now,
    )


def explain(fleet: Fleet, shape: Shape, notes: GpuNotes | None = None) -> WaitingReason:
    """The first thing that keeps a job of `shape` from running, in the order an operator
    would check: a node with the labels, online, compatible, big enough, with room now. GPUs
    out of the schedule that are why are named, with their reasons when `notes` reads them."""
    if shape.pinned is not None:
        return _explain_pinned(fleet, shape, *shape.pinned)
    wanted = shape.label_text()
    required = bool(shape.labels) and not shape.prefer
    pool = [
        n
        for n in fleet.nodes
        if (not required or labels_match(shape.labels, n.labels)) and shape.admits(n.labels, n.id)
    ]
    carrying = f" carrying {wanted}" if required else ""
    if shape.prefer and shape.labels and not fleet.room_for(shape):
        # It may run anywhere now; say why nowhere.
        carrying = ""
    if shape.required:
        secret_labels = ", ".join(f"{key}={value}" for key, value in shape.required)
        carrying += f"{' and' if carrying else ''} carrying its secrets' labels ({secret_labels})"
    if not pool:
        if shape.required:
            return _reason(
                "NO_MATCHING_NODE",
                f"no node{carrying}",
                "Enroll a node whose labels allow the job's secrets, or change the secrets' "
                "labels (PUT /api/v1/admin/secrets/{name}).",
            )
        if required:
            return _reason(
                "NO_MATCHING_NODE",
                f"no node carries {wanted}",
                "Enroll a node with these labels, or change the job's labels.",
            )
        return _reason("NO_NODES", "no node is enrolled", "Enroll a node (see docs/nodes.md).")
    compatible = [n for n in pool if n.state == "online" and not n.needs_upgrade]
    if not compatible:
        # An agent the control plane refuses is refused its heartbeats too, so it also looks
        # offline: the upgrade is the thing to fix.
        refused = [n for n in pool if n.needs_upgrade]
        if refused:
            names = ", ".join(n.name for n in refused[:5])
            return _reason(
                "NODES_NEED_UPGRADE",
                f"the nodes{carrying} that could run it need an upgrade ({names})",
                "Upgrade their node agent or runtime worker: see docs/COMPATIBILITY.md.",
            )
        offline = sum(n.state == "offline" for n in pool)
        return _reason(
            "NODES_OFFLINE",
            f"{_count(pool)}{carrying}, none online ({offline} offline, "
            f"{len(pool) - offline} stale)",
            "Check that their node agents run and reach the control plane "
            "(docs/nodes.md#troubleshooting-by-message).",
        )
    usable = [n for n in compatible if n.total is not None]
    if not usable:
        return _reason(
            "NO_INVENTORY",
            f"no online node{carrying} has reported its inventory yet",
            "Wait for the agents' first inventory report.",
        )
    totals = [n.size for n in usable if n.size is not None]
    short = _shortfall(shape.request, totals, f"the most any online node{carrying} has")
    if short:
        return _reason("TOO_LARGE", short, "Lower the job's resources, or add a larger node.")
    frees = [n.free for n in usable if n.free is not None]
    short = _shortfall(shape.request, frees, f"the most free on any online node{carrying}")
    if short and shape.request.gpus > max(len(free.gpus) for free in frees):
        # GPUs are short: those out of the schedule, on nodes big enough, are part of why.
        out = [found for n in usable if (found := _out_of_schedule(n, shape.request))]
        if out:
            return _reason(
                "NO_ROOM",
                f"{short} ({name_out_of_schedule(out, notes)})",
                "It starts when running work ends or those GPUs are back in the schedule (a "
                "quarantined GPU once an operator re-admits it, an unhealthy one once its "
                "re-admission's active check passes: docs/nodes.md#gpu-health); or add nodes.",
            )
    if short:
        services = sorted({name for n in usable for name in n.services})
        if services:
            held = ", ".join(services[:5]) + (" and more" if len(services) > 5 else "")
            return _reason(
                "NO_ROOM",
                f"{short}; deployed services hold resources there ({held})",
                "It starts when running work ends or one of those services is undeployed "
                "(DELETE /api/v1/services/{id}); or add nodes.",
            )
        return _reason("NO_ROOM", short, "It starts when running work ends; or add nodes.")
    roomy = sum(1 for n in usable if n.free is not None and n.free.fits(shape.request))
    return _reason(
        "WAITING_FOR_CLAIM",
        f"{_count(usable[:roomy] if roomy else usable)}{carrying} "
        f"{'has' if roomy == 1 else 'have'} room; waiting for one to ask for work",
        "Nothing to do: it starts when one of them claims it (their work slots may be busy).",
    )


def _out_of_schedule(node: FleetNode, request: Request) -> OutOfSchedule | None:
    """The node's GPUs out of the schedule, if it has some and is big enough for `request`."""
    size = node.size
    if size is None or not size.fits(request):
        return None
    gpus = tuple(
        (gpu["index"], gpu["uuid"], state)
        for gpu in size.gpus
        if (state := node.gpu_health.get(gpu["uuid"], "healthy")) in OUT_OF_SCHEDULE
    )
    return OutOfSchedule(node.id, node.name, gpus) if gpus else None


def _explain_pinned(fleet: Fleet, shape: Shape, node_id: str, uuid: str) -> WaitingReason:
    """Why a job pinned to one GPU (a GPU's active check) waits: that node, that GPU."""
    node = fleet.by_id.get(node_id)
    if node is None:
        return _reason(
            "NO_MATCHING_NODE",
            f"pinned to GPU {uuid} of node {node_id}, which is not enrolled",
            "Cancel the job: it can run on that node only.",
        )
    gpu = next((g for g in node.size.gpus if g["uuid"] == uuid), None) if node.size else None
    where = f"pinned to GPU {gpu['index'] if gpu else uuid} of node {node.name}"
    if node.needs_upgrade:
        return _reason(
            "NODES_NEED_UPGRADE",
            f"{where}, which needs an upgrade",
            "Upgrade its node agent or runtime worker: see docs/COMPATIBILITY.md.",
        )
    if node.state != "online":
        return _reason(
            "NODES_OFFLINE",
            f"{where}, which is {node.state}",
            "Check that its node agent runs and reaches the control plane "
            "(docs/nodes.md#troubleshooting-by-message).",
        )
    if node.free is None:
        return _reason(
            "NO_INVENTORY",
            f"{where}, which has not reported its inventory yet",
            "Wait for the agent's first inventory report.",
        )
    if gpu is None:
        return _reason(
            "NO_MATCHING_NODE",
            f"{where}, whose inventory has no such GPU",
            "Cancel the job: the GPU it is pinned to is gone from its node.",
        )
    if not shape.admits(node.labels, node.id) or not (
        shape.prefer or labels_match(shape.labels, node.labels)
    ):
        return _reason(
            "NO_MATCHING_NODE",
            f"{where}, which does not carry the job's labels",
            "Cancel the job and submit it without those labels.",
        )
    free = node.free
    if not any(g["uuid"] == uuid for g in free.gpus + free.blocked):
        return _reason(
            "NO_ROOM",
            f"{where}, which running work holds",
            "It starts when that work ends (a GPU out of the schedule takes no new work).",
        )
    short = _shortfall(shape.request._replace(gpus=0), [free], f"the most free on {node.name}")
    if short:
        return _reason("NO_ROOM", f"{where}; {short}", "It starts when running work ends.")
    return _reason(
        "WAITING_FOR_CLAIM",
        f"{where}, which is free; waiting for the node to ask for work",
        "Nothing to do: it starts when the node claims it (its work slots may be busy).",
    )


def _shortfall(request: Request, capacities: list[Capacity], most: str) -> str | None:
    """`needs 2 GPUs; <most> is 1` for the first resource no capacity covers, or None when
    some single capacity covers the whole request."""
    if any(capacity.fits(request) for capacity in capacities):
        return None
    most_gpus = max(len(capacity.gpus) for capacity in capacities)
    if request.gpus > most_gpus:
        return f"needs {_n(request.gpus, 'GPU')}; {most} is {most_gpus}"
    most_cpus = max(capacity.cpus for capacity in capacities)
    if request.cpus > most_cpus + 1e-9:
        return f"needs {request.cpus:g} CPUs; {most} is {most_cpus:g}"
    most_memory = max(capacity.memory_mb for capacity in capacities)
    if request.memory_mb > most_memory:
        return f"needs {request.memory_mb} MB of memory; {most} is {most_memory} MB"
    return (
        f"needs {request.cpus:g} CPUs, {_n(request.gpus, 'GPU')} and {request.memory_mb} MB "
        f"on one node; no node offers all three ({most} is less in one)"
    )


def _count(nodes: list[FleetNode]) -> str:
    return _n(len(nodes), "node")


def _n(count: int, thing: str) -> str:
    return f"{count} {thing}{'' if count == 1 else 's'}"


def _reason(code: str, message: str, next_step: str) -> WaitingReason:
    return WaitingReason(code=code, message=message, next_step=next_step)


def could_run_on(session: Session, node: Node, *, limit: int, scan: int = 5000) -> list[QueuedWork]:
    """The queued jobs and pending services `node` could run, oldest first (`could_take`).
    Whether it has room now is the scheduler's business. Looks at the `scan` oldest of each."""
    inventory = node.inventory or {}
    take = could_take(node.id, node.labels, Capacity.of_inventory(inventory) if inventory else None)
    return [work for work, shape in queued_work(session, scan=scan) if take(shape)][:limit]


def could_take(
    node_id: str, labels: dict[str, Any] | None, size: Capacity | None
) -> Callable[[Shape], bool]:
    """Whether node `node_id` carrying `labels`, of size `size` (its whole inventory, its GPUs
    out of the schedule included; None: not reported yet), could run work of a shape at all:
    its labels satisfy the shape's (or it only `prefer`s them), it carries the secrets' labels,
    it is the node of a pinned job, and it is big enough for it once empty."""
    carried = dict(labels or {})

    def fits(shape: Shape) -> bool:
        return (
            (shape.prefer or labels_match(shape.labels, carried))
            and shape.admits(carried, node_id)
            and (size is None or shape.fits(size))
        )

    return fits


def queued_work(session: Session, *, scan: int = 5000) -> list[tuple[QueuedWork, Shape]]:
    """The `scan` oldest queued jobs and the `scan` oldest pending services, oldest first, each
    with its shape. A service naming a secret that is gone is left out: no node can run it until
    the secret is set again."""
    found: list[tuple[QueuedWork, Shape]] = []
    rows = session.execute(
        select(*QUEUED_COLUMNS)
        .where(Job.state == "queued")
        .order_by(Job.created_at, Job.id)
        .limit(scan)
    ).all()
    for row in rows:
        work = QueuedWork(
            kind="job",
            id=row.id,
            name=row.id,
            created_at=row.created_at,
            labels=dict(row.labels or {}),
        )
        found.append((work, queued_job(row).shape))
    # A service waits while one of its replicas does.
    services = session.scalars(
        select(Service)
        .where(
            Service.id.in_(
                select(ServiceReplica.service_id).where(ServiceReplica.state == "pending")
            )
        )
        .order_by(Service.created_at, Service.id)
        .limit(scan)
    )
    for service in services:
        try:
            shape = shape_of(session, service)
        except (NotFound, InvalidRequest):
            continue
        work = QueuedWork(
            kind="service",
            id=service.id,
            name=service.name,
            created_at=service.created_at,
            labels=dict(service.labels or {}),
        )
        found.append((work, shape))
    found.sort(key=lambda pair: (pair[0].created_at, pair[0].id))
    return found
