"""A service's replicas (issue 27): the running copies of it, each a `service_replicas` row placed
on a node of its own where one fits (`placement`), with its own state, URL and restarts.

The service's state summarises them (`summarise`): `healthy` when all its desired replicas
are, `degraded` when some are, else the state of the one furthest along (`starting`,
`restarting`, `unhealthy`, `failed`, `pending`). Its view keeps the `node_id`, `url` and
`grpc_url` of its first healthy replica (else its first placed one), as before replicas.

A replica changes only under its service's row lock (`_changes`).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.fleet.schemas import AssignedGpu
from control_plane.models import Service, ServiceReplica, ServiceRevision
from control_plane.security import new_id
from control_plane.services._changes import DEPLOYED, record_event
from control_plane.services.schemas import EngineLoad, ServiceReplicaPublic

#: The fields a replica is started from: a revision's `spec` (as migration 0013 writes them).
REVISION_FIELDS = (
    "command",
    "runner",
    "weights",
    "model",
    "params",
    "env",
    "secrets",
    "labels",
    "worker_policy",
    "resources",
    "health",
    "restart",
)
#: States of a replica that is no longer one of the service's desired copies.
_GONE = ("stopped", "draining")
#: With none healthy, the service shows the state of the replica furthest along, in this order.
_FURTHEST = ("starting", "restarting", "unhealthy", "failed", "pending")


def start(session: Session, service: Service, now: datetime) -> list[ServiceReplica]:
    """Revision 1 of a service just deployed, and its `replicas` pending replicas."""
    session.add(
        ServiceRevision(
            service_id=service.id,
            revision=service.revision,
            spec={field: getattr(service, field) for field in REVISION_FIELDS},
            created_at=now,
        )
    )
    added = [
        ServiceReplica(
            id=new_id("rep"),
            service_id=service.id,
            ordinal=ordinal,
            revision=service.revision,
            state="pending",
            restarts=0,
            created_at=now,
            updated_at=now,
        )
        for ordinal in range(service.replicas)
    ]
    session.add_all(added)
    return added


def of_service(session: Session, service_id: str) -> list[ServiceReplica]:
    """Its replicas, by ordinal (stopped ones included)."""
    return by_service(session, [service_id]).get(service_id, [])


def by_service(session: Session, service_ids: Iterable[str]) -> dict[str, list[ServiceReplica]]:
    """The replicas of each of `service_ids` (one query), each list by ordinal."""
    ids = list(service_ids)
    found: dict[str, list[ServiceReplica]] = {service_id: [] for service_id in ids}
    if not ids:
        return found
    for replica in session.scalars(
        select(ServiceReplica)
        .where(ServiceReplica.service_id.in_(ids))
        .order_by(ServiceReplica.service_id, ServiceReplica.ordinal, ServiceReplica.created_at)
    ):
        found[replica.service_id].append(replica)
    return found


def set_state(
    session: Session,
    service: Service,
    replica: ServiceReplica,
    now: datetime,
    state: str,
    **data: Any,
) -> None:
    """Move `replica` to `state` with a state event (`data` beside it) naming it; `ready_at`
    is set when it turns healthy (warm), cleared when it leaves healthy."""
    replica.state, replica.updated_at = state, now
    if state == "healthy":
        replica.ready_at = now
    else:
        replica.ready_at = None
    record_event(session, service, now, "state", {"state": state, **data}, replica_id=replica.id)


def unplace(
    session: Session, service: Service, replica: ServiceReplica, now: datetime, **data: Any
) -> None:
    """Put `replica` back to `pending` (its node gone, its GPU failed): it holds nothing until
    placed again; its old node's agent no longer finds it in its sync and stops it."""
    node_id = replica.node_id
    replica.node_id = replica.assigned_gpus = replica.url = replica.grpc_url = None
    set_state(session, service, replica, now, "pending", node_id=node_id, **data)


def send_back(
    session: Session,
    *,
    service_id: str,
    replica_id: str,
    node_id: str,
    now: datetime,
    reason: str,
    gpu: str | None = None,
) -> bool:
    """`unplace` the replica, its service's row locked first, if it still stands deployed on
    `node_id` (holding GPU `gpu`, when given) once locked, and sum the service up again; False
    when it moved or ended meanwhile (nothing changed)."""
    service = session.get(Service, service_id, with_for_update=True)
    replica = session.get(ServiceReplica, replica_id)
    if (
        service is None
        or replica is None
        or replica.node_id != node_id
        or replica.state not in DEPLOYED
        or (gpu is not None and not holds_gpu(replica.assigned_gpus, gpu))
    ):
        return False
    event: dict[str, Any] = {"reason": reason} if gpu is None else {"reason": reason, "gpu": gpu}
    unplace(session, service, replica, now, **event)
    summarise(session, service, now, of_service(session, service_id))
    return True


def holds_gpu(gpus: list[object] | None, uuid: str) -> bool:
    """Whether a replica's `assigned_gpus` name GPU `uuid`."""
    return any(isinstance(gpu, dict) and gpu.get("uuid") == uuid for gpu in gpus or [])


def stop_all(session: Session, service: Service, now: datetime) -> None:
    """Stop every replica of `service` (undeployed): none holds anything from now on."""
    for replica in of_service(session, service.id):
        if replica.state == "stopped":
            continue
        replica.state = "stopped"
        replica.stopped_at = replica.updated_at = now
        replica.url = replica.grpc_url = replica.ready_at = None


def summary_state(desired: int, states: Iterable[str]) -> str:
    live = [state for state in states if state not in _GONE]
    healthy = live.count("healthy")
    if desired == 0 and not healthy:
        return "idle"  # scaled to zero (autoscale): its next request asks for a replica
    if healthy and healthy >= desired:
        return "healthy"
    if healthy:
        return "degraded"
    return next((state for state in _FURTHEST if state in live), "pending")


def summarise(
    session: Session, service: Service, now: datetime, replicas: list[ServiceReplica]
) -> None:
    """Set `service.state` (unless undeployed) and `restarts` from its `replicas`; a service of
    more than one replica gets a state event of its own when its summary changes (one
    replica's events already say it)."""
    service.restarts = sum(replica.restarts for replica in replicas)
    if service.state == "stopped":
        return
    state = summary_state(service.replicas, (replica.state for replica in replicas))
    if state == service.state:
        return
    service.state, service.updated_at = state, now
    if service.replicas > 1:
        healthy = sum(replica.state == "healthy" for replica in replicas)
        data = {"state": state, "healthy": healthy, "replicas": service.replicas}
        record_event(session, service, now, "state", data)


def representative(replicas: list[ServiceReplica]) -> ServiceReplica | None:
    """The replica whose node and URLs the service's view shows: its first healthy one, else
    its first placed one."""
    placed = [replica for replica in replicas if replica.node_id and replica.state not in _GONE]
    healthy = [replica for replica in placed if replica.state == "healthy"]
    first = healthy or placed
    return first[0] if first else None


def engine_load(session: Session, service_id: str) -> dict[str, int] | None:
    """The requests the service's engines process and hold waiting, summed over its replicas
    as their nodes last reported them (None: none reported one)."""
    loads = [
        load
        for load in session.scalars(
            select(ServiceReplica.engine).where(
                ServiceReplica.service_id == service_id, ServiceReplica.state != "stopped"
            )
        )
        if isinstance(load, dict)
    ]
    if not loads:
        return None
    return {key: sum(int(load.get(key, 0)) for load in loads) for key in ("processing", "waiting")}


def replica_public(replica: ServiceReplica) -> ServiceReplicaPublic:
    return ServiceReplicaPublic(
        id=replica.id,
        ordinal=replica.ordinal,
        revision=replica.revision,
        state=replica.state,
        node_id=replica.node_id,
        url=replica.url,
        grpc_url=replica.grpc_url,
        restarts=replica.restarts,
        last_exit=replica.last_exit,
        ready_at=replica.ready_at,
        assigned_gpus=[AssignedGpu.model_validate(gpu) for gpu in replica.assigned_gpus or []],
        engine=EngineLoad.model_validate(replica.engine) if replica.engine else None,
    )
