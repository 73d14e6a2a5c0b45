"""How a service changes: its event log (`record_event`), and the states in which a replica of
it holds its node's resources (`DEPLOYED`). A replica changes only under its service's row
lock, as the service's events are numbered under it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from control_plane.models import Service, ServiceEvent

#: States in which a replica holds its node's resources.
DEPLOYED = ("starting", "healthy", "unhealthy", "restarting", "failed")


def record_event(
    session: Session,
    service: Service,
    now: datetime,
    kind: str,
    data: Any,
    *,
    replica_id: str | None = None,
) -> None:
    """Append an event to `service`'s log, numbered from its `next_event_seq`, naming the
    replica it happened to (None: the service as a whole): the caller holds the service's row
    lock, or has just created it."""
    session.add(
        ServiceEvent(
            service_id=service.id,
            seq=service.next_event_seq,
            at=now,
            kind=kind,
            data=data,
            replica_id=replica_id,
        )
    )
    service.next_event_seq += 1
