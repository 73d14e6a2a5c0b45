"""Services on a GPU that failed (issue 28): each deployed replica holding it goes back to
`pending`, to be placed again (the GPU is out of the schedule, so elsewhere), as one whose node
went offline does (`placement`); its siblings keep running. Its node's agent no longer finds
it in its sync's answer and stops it. The caller, `scheduling.gpu_health`, calls this in the
transaction that records the failure."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.models import ServiceReplica
from control_plane.services import replicas
from control_plane.services._changes import DEPLOYED


def replace_from_gpu(
    session: Session, *, node_id: str, uuid: str, reason: str, now: datetime
) -> list[str]:
    """Put back to `pending` every replica deployed on `node_id` that holds the GPU `uuid`,
    each with a state event saying `reason`; returns their services' ids."""
    moved: list[str] = []
    # Their services are locked in id order, as the agents' sync locks a node's services.
    candidates = session.execute(
        select(ServiceReplica.id, ServiceReplica.service_id, ServiceReplica.assigned_gpus)
        .where(ServiceReplica.node_id == node_id, ServiceReplica.state.in_(DEPLOYED))
        .order_by(ServiceReplica.service_id, ServiceReplica.ordinal)
    ).all()
    for replica_id, service_id, gpus in candidates:
        if replicas.holds_gpu(gpus, uuid) and replicas.send_back(
            session,
            service_id=service_id,
            replica_id=replica_id,
            node_id=node_id,
            now=now,
            reason=reason,
            gpu=uuid,
        ):
            moved.append(service_id)
    return moved
