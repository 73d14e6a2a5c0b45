"""Services on a GPU that failed (issue 28): each deployed replica holding it goes back to
`pending`, to be placed again (the GPU is out of the schedule, so elsewhere), as one whose node
went offline does (`placement`); its siblings keep running. Its node's agent no longer finds
it in its sync's answer and stops it. The caller, `scheduling.gpu_health`, calls this in the
transaction that records the failure."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.models import Service, ServiceReplica
from control_plane.services import replicas
from control_plane.services._changes import DEPLOYED


def replace_from_gpu(
    session: Session, *, node_id: str, uuid: str, reason: str, now: datetime
) -> list[str]:
    """Put back to `pending` every replica deployed on `node_id` that holds the GPU `uuid`,
    each with a state event saying `reason`; returns their services' ids."""
    moved: list[str] = []
    candidates = session.execute(
        select(ServiceReplica.id, ServiceReplica.service_id, ServiceReplica.assigned_gpus).where(
            ServiceReplica.node_id == node_id, ServiceReplica.state.in_(DEPLOYED)
        )
    ).all()
    for replica_id, service_id, gpus in candidates:
        if not _holds(gpus, uuid):
            continue
        service = session.get(Service, service_id, with_for_update=True)
        replica = session.get(ServiceReplica, replica_id)
        if (
            service is None
            or replica is None
            or replica.node_id != node_id
            or replica.state not in DEPLOYED
            or not _holds(replica.assigned_gpus, uuid)
        ):
            continue
        replicas.unplace(session, service, replica, now, reason=reason, gpu=uuid)
        replicas.summarise(session, service, now, replicas.of_service(session, service_id))
        moved.append(service_id)
    return moved


def _holds(gpus: list[object] | None, uuid: str) -> bool:
    return any(isinstance(gpu, dict) and gpu.get("uuid") == uuid for gpu in gpus or [])
