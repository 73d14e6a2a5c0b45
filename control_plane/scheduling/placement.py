"""Placement: which queued jobs the nodes waiting for work get, in batches (SC-1, SC-2, SC-5).

Only online, compatible nodes with an inventory get work. A job fits a node when the node
carries the job's labels (`require`), or — with `prefer` — when no online node carrying them has
room; and when its resource requests fit the node's inventory minus what its running jobs hold.
GPUs are counted as a set: a job is handed specific GPUs of its node (index and UUID) that no
other running job there holds, and waits, queued, while fewer are free than it asks for. A GPU
out of the schedule (unhealthy or quarantined: `fleet.gpu_health`) is never handed out, except
to a job pinned to it (its active check, on that node only); degraded GPUs are handed out last.

`match` takes the queue (`queue.JobQueue`, by shape) oldest fitting job first for every waiting
node. `place_batch` commits one batch in one transaction: the waiting nodes' rows are locked (in
id order, so replicas never deadlock), their free capacity is read once, the chosen jobs are
locked with `FOR UPDATE SKIP LOCKED` and updated only while still `queued` — so a job is handed
out exactly once, also with several replicas on one PostgreSQL, each scheduling the claims it
holds. The value types it matches with are in `shapes.py`; why a job waits is `waiting.py`'s.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.fleet.gpu_health import out_of_schedule
from control_plane.fleet.liveness import Liveness
from control_plane.jobs.reports import cancel_unstarted
from control_plane.models import JOB_EVENTS, JOBS, Job, JobEvent, Node, Service, ServiceReplica
from control_plane.scheduling.dispatch import CAPACITY, job_key, jobs_changed, queued_key
from control_plane.scheduling.queue import JobQueue, QueuedJob
from control_plane.scheduling.shapes import Capacity, Request, Shape, labels_match
from control_plane.vault.vault import Vault, values_for

#: Matching rounds in one batch: a job lost to another replica (or cancelled) is replaced by
#: the next fitting one while the nodes' locks are held.
_ROUNDS = 3


# -- matching -----------------------------------------------------------------------------------


@dataclass
class WaitingNode:
    """A node with claims waiting in this batch: `slots` jobs at most, within `capacity`."""

    node_id: str
    labels: dict[str, Any]
    capacity: Capacity
    slots: int


@dataclass(frozen=True)
class Placement:
    job: QueuedJob
    node_id: str
    gpus: list[dict[str, Any]]


@dataclass
class _Stream:
    shape: Shape
    jobs: Iterator[QueuedJob]
    candidates: list[WaitingNode] | None = None
    next: int = 0


def match(
    queue: JobQueue,
    nodes: list[WaitingNode],
    room_elsewhere: Callable[[Shape], bool],
    skip: frozenset[str] = frozenset(),
) -> list[Placement]:
    """Oldest fitting job first, for every waiting node. `room_elsewhere(shape)` says whether
    an online node carrying a `prefer` shape's labels has room for it (then it waits for that
    node instead of going to one without the labels).

    Each shape keeps a cursor over its candidate nodes: capacity only shrinks within a batch,
    so a node that cannot take a shape's job now never can in this batch, and the work is
    O(shapes x nodes + placements x log shapes)."""
    slots = sum(node.slots for node in nodes)
    heap: list[tuple[datetime, str, int, QueuedJob]] = []
    streams: list[_Stream] = []
    for shape, live in queue.shapes():
        jobs = (job for job in live if job.id not in skip) if skip else live
        first = next(jobs, None)
        if first is not None:
            heap.append((first.created_at, first.id, len(streams), first))
            streams.append(_Stream(shape, jobs))
    heapq.heapify(heap)
    placements: list[Placement] = []
    while heap and slots:
        _, _, index, job = heapq.heappop(heap)
        stream = streams[index]
        if stream.candidates is None:
            stream.candidates = _candidates(stream.shape, nodes, room_elsewhere)
        node = _pick(stream)
        if node is None:
            continue  # nothing waiting fits this shape: its younger jobs need not be looked at
        gpus = node.capacity.pick_gpus(job.shape.request, job.shape.pinned_gpu)
        node.capacity = node.capacity.minus(job.shape.request, gpus)
        node.slots -= 1
        slots -= 1
        placements.append(Placement(job, node.node_id, gpus))
        following = next(stream.jobs, None)
        if following is not None:
            heapq.heappush(heap, (following.created_at, following.id, index, following))
    return placements


def _candidates(
    shape: Shape, nodes: list[WaitingNode], room_elsewhere: Callable[[Shape], bool]
) -> list[WaitingNode]:
    if shape.required or shape.pinned:
        nodes = [node for node in nodes if shape.admits(node.labels, node.node_id)]
    carrying = [node for node in nodes if labels_match(shape.labels, node.labels)]
    if not shape.prefer or len(carrying) == len(nodes):
        return carrying
    if any(shape.fits(node.capacity) for node in carrying) or room_elsewhere(shape):
        return carrying
    return carrying + [node for node in nodes if not labels_match(shape.labels, node.labels)]


def _pick(stream: _Stream) -> WaitingNode | None:
    candidates = stream.candidates or []
    while stream.next < len(candidates):
        node = candidates[stream.next]
        if node.slots and stream.shape.fits(node.capacity):
            return node
        stream.next += 1
    return None


# -- one batch in one transaction ---------------------------------------------------------------


@dataclass(frozen=True)
class PlacedJob:
    """A job handed to a waiting claim: what the claim answers with."""

    id: str
    node_id: str
    created_at: datetime
    entrypoint: dict[str, Any]
    params: dict[str, Any]
    inputs: dict[str, str]
    resources: dict[str, Any]
    assigned_gpus: list[dict[str, Any]]
    timeout_seconds: float
    silence_timeout_seconds: float
    stop_after_disconnect_seconds: float | None = None  # its agent's limit when cut off
    #: Its secrets, and their values for this node (WL-6a); None when not to be delivered.
    secret_names: tuple[str, ...] = ()
    secrets: dict[str, str] | None = field(default=None, repr=False)
    #: The labels the node's signed credential must carry for the secrets to be delivered.
    secret_labels: dict[str, Any] = field(default_factory=dict)


@dataclass
class BatchResult:
    placed: list[PlacedJob] = field(default_factory=list)
    #: Jobs that were not queued any more (taken by another replica, cancelled, deleted).
    gone: list[str] = field(default_factory=list)
    #: Whether a chosen job was locked by another replica's batch: worth another batch soon.
    contended: bool = False
    #: The nodes that took part (set by the scheduler), and whether waiting nodes were left
    #: out of this batch that might take what is still queued.
    considered: set[str] = field(default_factory=set)
    more: bool = False


def free_capacity(
    session: Session,
    inventories: dict[str, dict[str, Any]],
    holders: dict[str, list[str]] | None = None,
) -> dict[str, Capacity]:
    """Every listed node's inventory minus its running jobs and the services placed on it (a
    service holds its resources and GPUs for as long as it is deployed), its GPUs out of the
    schedule kept apart (`Capacity.blocked`), in three queries. `holders`, when given, receives
    per node the services that hold something there."""
    health = gpu_health(session, list(inventories))
    totals = {
        node_id: Capacity.of_inventory(inventory, health.get(node_id))
        for node_id, inventory in inventories.items()
    }
    return held_back(session, totals, holders)


def gpu_health(session: Session, node_ids: list[str]) -> dict[str, dict[str, str]]:
    """Per node, its GPUs that are not healthy, by UUID (`fleet.gpu_health.out_of_schedule`):
    one query over the few such rows, by node id for a few nodes."""
    if not node_ids:
        return {}
    return out_of_schedule(session, node_ids if len(node_ids) <= _IN_LIST_MAX else None)


@dataclass(frozen=True)
class Holding:
    """What one running job or deployed service holds on its node, as `held_back` counted it."""

    kind: Literal["job", "service"]
    id: str
    #: A service's name; a job's model (`name@version`), or its id when it runs no model.
    name: str
    request: Request
    #: The GPUs it holds by UUID; None for a job from before GPUs were assigned (it holds as
    #: many as it asked for, which ones unknown).
    gpus: tuple[str, ...] | None


def held_back(
    session: Session,
    totals: dict[str, Capacity],
    holders: dict[str, list[str]] | None = None,
    *,
    holdings: dict[str, list[Holding]] | None = None,
) -> dict[str, Capacity]:
    """`free_capacity` from each node's whole capacity, already known. `holdings`, when given,
    receives per node everything held there and by whom (the resources view)."""
    free = dict(totals)
    if not free:
        return free
    jobs = select(Job.node_id, Job.resources, Job.assigned_gpus, Job.id, Job.model).where(
        Job.state == "running"
    )
    # A service's replica holds its service's resources and its own GPUs on its node.
    services = (
        select(
            ServiceReplica.node_id,
            Service.name,
            Service.resources,
            ServiceReplica.assigned_gpus,
            Service.id,
        )
        .join(Service, Service.id == ServiceReplica.service_id)
        .where(ServiceReplica.state.not_in(("pending", "stopped")))
    )
    if len(free) <= _IN_LIST_MAX:
        jobs = jobs.where(Job.node_id.in_(list(free)))
        services = services.where(ServiceReplica.node_id.in_(list(free)))
    # Else every running job and placed replica, filtered here: a thousand-element IN list
    # costs PostgreSQL more to plan than the rows it saves.
    for node_id, resources, held_gpus, job_id, model in session.execute(jobs):
        if node_id in free:
            request = Request.of(resources)
            free[node_id] = free[node_id].minus(request, held_gpus)
            if holdings is not None:
                holding = Holding("job", job_id, model or job_id, request, _uuids(held_gpus))
                holdings.setdefault(node_id, []).append(holding)
    for node_id, name, resources, held_gpus, service_id in session.execute(services):
        if node_id in free:
            request = Request.of(resources)
            free[node_id] = free[node_id].minus(request, held_gpus or [])
            if holders is not None:
                holders.setdefault(node_id, []).append(name)
            if holdings is not None:
                holding = Holding("service", service_id, name, request, _uuids(held_gpus or []))
                holdings.setdefault(node_id, []).append(holding)
    return free


def _uuids(held_gpus: list[Any] | None) -> tuple[str, ...] | None:
    if held_gpus is None:
        return None
    return tuple(str(gpu.get("uuid")) for gpu in held_gpus if isinstance(gpu, dict))


#: Up to this many nodes, `held_back` asks for their holdings by id.
_IN_LIST_MAX = 64


def place_batch(
    *,
    session: Session,
    clock: Clock,
    liveness: Liveness,
    waiting: dict[str, int],
    queue: JobQueue,
    room_elsewhere: Callable[[Shape], bool],
    vault: Vault | None = None,
) -> BatchResult:
    """Match `waiting` (node id -> claims waiting) to `queue` and commit the placements in
    `session`'s transaction. The caller drops `gone` from its queue."""
    now = clock.now()
    result = BatchResult()
    # Locks the waiting nodes' rows (in id order: replicas never deadlock): a node's claims
    # held by another replica wait here, so no two batches over-commit one node.
    rows = session.execute(
        select(Node.id, Node.labels, Node.inventory, Node.compat_code, Node.last_heartbeat_at)
        .where(Node.id.in_(sorted(waiting)))
        .order_by(Node.id)
        .with_for_update()
    ).all()
    eligible = {
        row.id: row
        for row in rows
        if row.inventory is not None
        and row.compat_code is None
        and liveness.state_of(row.id, row.last_heartbeat_at, now) == "online"
    }
    if not eligible:
        return result
    free = free_capacity(session, {node_id: row.inventory for node_id, row in eligible.items()})
    nodes = [
        WaitingNode(node_id, dict(eligible[node_id].labels or {}), free[node_id], waiting[node_id])
        for node_id in eligible
    ]
    placements: list[Placement] = []
    locked: dict[str, Any] = {}
    skip: set[str] = set()
    for _ in range(_ROUNDS):
        # Each round matches the slots still open, without the jobs earlier rounds lost.
        open_nodes = [node for node in _after(nodes, placements) if node.slots]
        chosen = match(queue, open_nodes, room_elsewhere, frozenset(skip))
        if not chosen:
            break
        won = _lock_queued(session, [placement.job.id for placement in chosen])
        locked.update(won)
        placements += [placement for placement in chosen if placement.job.id in won]
        lost = [placement.job.id for placement in chosen if placement.job.id not in won]
        if not lost:
            break
        skip.update(won, lost)
        still_queued = set(
            session.scalars(select(Job.id).where(Job.id.in_(lost), Job.state == "queued"))
        )
        result.gone += [job_id for job_id in lost if job_id not in still_queued]
        result.contended = result.contended or bool(still_queued)
    if not placements:
        return result
    jobs = JOBS
    session.execute(
        update(jobs)
        .where(jobs.c.id == bindparam("b_id"))
        .values(
            state="running",
            node_id=bindparam("b_node"),
            started_at=now,
            last_contact_at=now,
            assigned_gpus=bindparam("b_gpus", type_=jobs.c.assigned_gpus.type),
            next_event_seq=bindparam("b_next_seq"),
        ),
        [
            {
                "b_id": placement.job.id,
                "b_node": placement.node_id,
                "b_gpus": placement.gpus,
                "b_next_seq": locked[placement.job.id].next_event_seq + 1,
            }
            for placement in placements
        ],
    )
    session.execute(
        insert(JOB_EVENTS),
        [
            {
                "job_id": placement.job.id,
                "seq": locked[placement.job.id].next_event_seq,
                "at": now,
                "kind": "state",
                "data": {
                    "state": "running",
                    "node_id": placement.node_id,
                    "assigned_gpus": placement.gpus,
                },
            }
            for placement in placements
        ],
    )
    jobs_changed(session, [job_key(placement.job.id) for placement in placements])
    for placement in placements:
        row = locked[placement.job.id]
        names = tuple(row.secrets or ())
        values: dict[str, str] | None = {}
        if names:
            carried = dict(eligible[placement.node_id].labels or {})
            values = None if vault is None else values_for(session, vault, list(names), carried)
        result.placed.append(
            PlacedJob(
                id=row.id,
                node_id=placement.node_id,
                created_at=placement.job.created_at,
                entrypoint=row.entrypoint,
                params=row.params,
                inputs=row.inputs,
                resources=row.resources,
                assigned_gpus=placement.gpus,
                timeout_seconds=row.timeout_seconds,
                silence_timeout_seconds=row.silence_timeout_seconds,
                stop_after_disconnect_seconds=row.stop_after_disconnect_seconds,
                secret_names=names,
                secrets=values,
                secret_labels=dict(row.required_labels or {}),
            )
        )
    return result


def _after(nodes: list[WaitingNode], placements: list[Placement]) -> list[WaitingNode]:
    """`nodes` as they were before matching, minus what `placements` took."""
    taken: dict[str, list[Placement]] = {}
    for placement in placements:
        taken.setdefault(placement.node_id, []).append(placement)
    after = []
    for node in nodes:
        capacity, slots = node.capacity, node.slots
        for placement in taken.get(node.node_id, []):
            capacity = capacity.minus(placement.job.shape.request, placement.gpus)
            slots -= 1
        after.append(WaitingNode(node.node_id, node.labels, capacity, slots))
    return after


def _lock_queued(session: Session, job_ids: list[str]) -> dict[str, Any]:
    """Lock those of `job_ids` still queued and not locked by another batch (SKIP LOCKED: a
    batch never waits for another replica's), with what the claim's answer needs."""
    return {
        row.id: row
        for row in session.execute(
            select(
                Job.id,
                Job.next_event_seq,
                Job.entrypoint,
                Job.params,
                Job.inputs,
                Job.resources,
                Job.timeout_seconds,
                Job.silence_timeout_seconds,
                Job.stop_after_disconnect_seconds,
                Job.secrets,
                Job.required_labels,
            )
            .where(Job.id.in_(job_ids), Job.state == "queued")
            .order_by(Job.id)
            .with_for_update(skip_locked=True)
        )
    }


def return_unanswered(
    *, session: Session, clock: Clock, placed: list[PlacedJob], reason: str
) -> int:
    """Put jobs back in the queue whose claim was gone before it could be answered: the node
    never received them. Only while they are still `running` on that node, untouched since."""
    now = clock.now()
    returned = 0
    for job in placed:
        seq = session.execute(
            update(Job)
            .where(
                Job.id == job.id,
                Job.state == "running",
                Job.node_id == job.node_id,
                Job.last_contact_at == Job.started_at,
                Job.cancel_requested.is_(False),
            )
            .values(
                state="queued",
                node_id=None,
                started_at=None,
                last_contact_at=None,
                assigned_gpus=None,
                next_event_seq=Job.next_event_seq + 1,
            )
            .returning(Job.next_event_seq)
        ).scalar_one_or_none()
        if seq is None:
            # Cancelled meanwhile: it ends cancelled rather than going back to the queue.
            untouched = session.execute(
                select(Job.id).where(
                    Job.id == job.id,
                    Job.node_id == job.node_id,
                    Job.cancel_requested.is_(True),
                    Job.last_contact_at == Job.started_at,
                )
            ).first()
            if untouched is not None:
                cancel_unstarted(session=session, clock=clock, job_id=job.id, node_id=job.node_id)
            continue
        session.add(
            JobEvent(
                job_id=job.id,
                seq=seq - 1,
                at=now,
                kind="state",
                data={"state": "queued", "reason": reason},
            )
        )
        returned += 1
    if returned:
        jobs_changed(
            session,
            [CAPACITY, *(key for job in placed for key in (job_key(job.id), queued_key(job.id)))],
        )
    return returned
