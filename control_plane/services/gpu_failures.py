"""Services on a GPU that failed (issue 28): each deployed service holding it goes back to
`pending`, to be placed again (the GPU is out of the schedule, so elsewhere), as one whose node
went offline does (`placement`). Its node's agent no longer finds it in its sync's answer and
stops it. The caller, `scheduling.gpu_health`, calls this in the transaction that records the
failure."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.models import Service
from control_plane.services._changes import DEPLOYED, record_event


def replace_from_gpu(
    session: Session, *, node_id: str, uuid: str, reason: str, now: datetime
) -> list[str]:
    """Put back to `pending` every service deployed on `node_id` that holds the GPU `uuid`,
    each with a state event saying `reason`; returns their ids."""
    moved: list[str] = []
    candidates = session.execute(
        select(Service.id, Service.assigned_gpus).where(
            Service.node_id == node_id, Service.state.in_(DEPLOYED)
        )
    ).all()
    for service_id, gpus in candidates:
        if not _holds(gpus, uuid):
            continue
        service = session.get(Service, service_id, with_for_update=True)
        if (
            service is None
            or service.node_id != node_id
            or service.state not in DEPLOYED
            or not _holds(service.assigned_gpus, uuid)
        ):
            continue
        service.state, service.node_id, service.assigned_gpus = "pending", None, None
        service.url = service.grpc_url = None
        service.updated_at = now
        data = {"state": "pending", "reason": reason, "node_id": node_id, "gpu": uuid}
        record_event(session, service, now, "state", data)
        moved.append(service_id)
    return moved


def _holds(gpus: list[object] | None, uuid: str) -> bool:
    return any(isinstance(gpu, dict) and gpu.get("uuid") == uuid for gpu in gpus or [])
