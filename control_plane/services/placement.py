"""Where a service runs: the placement loop's work and why a pending service waits.

Each replica of a service is placed like a job — labels (`require`/`prefer`), free resources,
specific GPUs (SC-5: never one out of the schedule, degraded ones last), and the labels of its
secrets — but it holds no claim slot: `place_pending` assigns pending replicas to nodes (one
transaction each; each node tried has its row locked as a job batch locks it, so the two never
over-commit a node, and then the service's row: node before service, as a GPU report takes
them), on a node none of its siblings is on where one
fits, else beside them on other GPUs; from then on it holds its service's resources and its
GPUs there (the scheduler's `free_capacity` counts them) until it is undeployed.

A replica whose node goes offline is placed again on another matching node, its siblings left
where they are; when the old node comes back its agent no longer finds it in its sync's answer
and stops it, so it is not run twice.

The scheduler sits above this package: what it knows (a node's free capacity, why a shape
waits) is passed in, never imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.errors import InvalidRequest, NotFound
from control_plane.fleet.liveness import Liveness
from control_plane.models import Node, Service, ServiceReplica
from control_plane.scheduling.shapes import Capacity, Request, Shape, labels_match
from control_plane.services import replicas
from control_plane.services._changes import DEPLOYED
from control_plane.vault import vault

#: The scheduler's `free_capacity`: each listed node's inventory (by id) less what its running
#: jobs and deployed services hold, its GPUs out of the schedule (unhealthy, quarantined) kept
#: apart from those it hands out.
FreeCapacity = Callable[[Session, dict[str, dict[str, Any]]], dict[str, Capacity]]


def shape_of(session: Session, service: Service) -> Shape:
    required = vault.required_labels(
        session, list(service.secrets or []), named_by=f"Service {service.name}"
    )
    return Shape.of(service.labels, service.worker_policy, service.resources, required)


def place_pending(
    *, session_factory: Any, clock: Clock, liveness: Liveness, free_capacity: FreeCapacity
) -> int:
    """Give each pending replica a node (its service's oldest first), and put back in `pending`
    the replicas whose node went offline. One transaction per replica; returns how many were
    placed."""
    with session_factory.begin() as session:
        _replace_lost(session, clock, liveness)
    placed = 0
    with session_factory() as session:
        pending = session.execute(
            select(ServiceReplica.id, ServiceReplica.service_id)
            .join(Service, Service.id == ServiceReplica.service_id)
            .where(ServiceReplica.state == "pending", Service.state != "stopped")
            .order_by(Service.created_at, ServiceReplica.ordinal)
            .limit(100)
        ).all()
    for replica_id, service_id in pending:
        with session_factory.begin() as session:
            placed += _place_one(session, clock, liveness, free_capacity, service_id, replica_id)
    return placed


def _replace_lost(session: Session, clock: Clock, liveness: Liveness) -> None:
    now = clock.now()
    rows = session.execute(
        select(ServiceReplica.id, ServiceReplica.service_id, ServiceReplica.node_id)
        .add_columns(Node.last_heartbeat_at)
        .outerjoin(Node, Node.id == ServiceReplica.node_id)
        .where(ServiceReplica.node_id.is_not(None), ServiceReplica.state.in_(DEPLOYED))
        # Services locked in id order, as a GPU report and the agents' sync lock several.
        .order_by(ServiceReplica.service_id, ServiceReplica.ordinal)
    ).all()
    for replica_id, service_id, node_id, last in rows:
        if node_id is None:
            continue
        gone = last is None and session.get(Node, node_id) is None
        if not gone and liveness.state_of(node_id, last, now) != "offline":
            continue
        why = "its node was deleted" if gone else "its node went offline"
        replicas.send_back(
            session,
            service_id=service_id,
            replica_id=replica_id,
            node_id=node_id,
            now=now,
            reason=why,
        )


def _place_one(
    session: Session,
    clock: Clock,
    liveness: Liveness,
    free_capacity: FreeCapacity,
    service_id: str,
    replica_id: str,
) -> int:
    # Read unlocked: the candidates are chosen here, each tried under its locks (`_try_node`).
    service = session.get(Service, service_id)
    replica = session.get(ServiceReplica, replica_id)
    if service is None or service.state == "stopped" or replica is None:
        return 0
    if replica.state != "pending":
        return 0
    try:
        shape = shape_of(session, service)
    except (NotFound, InvalidRequest):
        return 0  # a secret is missing: the waiting reason says so; it waits
    now = clock.now()
    nodes = session.execute(
        select(Node.id, Node.labels, Node.inventory, Node.compat_code, Node.last_heartbeat_at)
        .where(Node.inventory.is_not(None), Node.compat_code.is_(None))
        .order_by(Node.id)
    ).all()
    online = [
        row
        for row in nodes
        if liveness.state_of(row.id, row.last_heartbeat_at, now) == "online"
        and shape.admits(dict(row.labels or {}))
    ]
    carrying = [row for row in online if labels_match(shape.labels, dict(row.labels or {}))]
    others = [row for row in online if row not in carrying] if shape.prefer else []
    # Its siblings' nodes last: a node of its own where one fits, else another GPU of theirs.
    # Siblings of its own revision count first: during a rollout the old revision's replicas
    # hold every node, and counting them alike would put the new ones together.
    copies = replicas.of_service(session, service_id)
    placed = [copy for copy in copies if copy.node_id and copy.state in DEPLOYED]
    same = {copy.node_id for copy in placed if copy.revision == replica.revision}
    taken = {copy.node_id for copy in placed}
    candidates = sorted(carrying + others, key=lambda row: (row.id in same, row.id in taken))
    for row in candidates:
        tried = _try_node(session, now, free_capacity, row, shape, service_id, replica_id)
        if tried != _NO_ROOM:
            return 1 if tried == _PLACED else 0
    return 0


#: What trying one node came to (`_try_node`).
_PLACED, _NO_ROOM, _CHANGED = "placed", "no room", "changed"


def _try_node(
    session: Session,
    now: Any,
    free_capacity: FreeCapacity,
    row: Any,
    shape: Shape,
    service_id: str,
    replica_id: str,
) -> str:
    """Place the replica on node `row` if it fits. The node's row is locked first, then the
    service's: the order of a GPU report (`scheduling.gpu_health`: the node, then the services
    on a GPU it fails), which the other order let wait on a placement for good. In a savepoint,
    so a node it does not fit releases both locks before the next is tried: this transaction
    never holds a service while it waits for a node."""
    savepoint = session.begin_nested()
    try:
        # The node's row lock: a job batch holding it finishes first, then its jobs count.
        session.execute(select(Node.id).where(Node.id == row.id).with_for_update())
        service = session.get(Service, service_id, with_for_update=True, populate_existing=True)
        replica = session.get(ServiceReplica, replica_id, populate_existing=True)
        if (
            service is None
            or service.state == "stopped"
            or replica is None
            or replica.state != "pending"
            or shape_of(session, service) != shape
        ):
            savepoint.rollback()
            return _CHANGED  # placed, stopped or changed meanwhile: the next round sees it
        free = free_capacity(session, {row.id: row.inventory})[row.id]
        request = Request.of(service.resources)
        if not free.fits(request):
            savepoint.rollback()
            return _NO_ROOM
        gpus = free.pick_gpus(request)
        replica.node_id, replica.assigned_gpus = row.id, gpus
        replica.placed_at = now
        replicas.set_state(session, service, replica, now, "starting", node_id=row.id, gpus=gpus)
        replicas.summarise(session, service, now, replicas.of_service(session, service_id))
        savepoint.commit()
        return _PLACED
    except BaseException:
        if savepoint.is_active:
            savepoint.rollback()
        raise


def waiting_reason(
    *, session: Session, service: Service, explain: Callable[[Shape], BaseModel]
) -> dict[str, str] | None:
    """Why a pending service waits (None once one of its replicas is placed): its secrets'
    trouble, else what `explain` says of its shape. `explain` is the scheduler's, over its
    fleet; it answers a `WaitingReason`, named here by its base: that schema lives in `jobs`, a
    peer of this package, which it may not import."""
    if service.state != "pending":
        return None
    try:
        shape = shape_of(session, service)
    except (NotFound, InvalidRequest) as exc:
        return {"code": exc.code, "message": exc.message, "next_step": exc.next_step}
    return dict(explain(shape).model_dump())
