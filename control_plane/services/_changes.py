"""How a service changes: its event log (`record_event`), and the states in which it holds
its node's resources (`DEPLOYED`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from control_plane.models import Service, ServiceEvent

#: States in which a service holds its node's resources.
DEPLOYED = ("starting", "healthy", "unhealthy", "restarting", "failed")


def record_event(session: Session, service: Service, now: datetime, kind: str, data: Any) -> None:
    """Append an event to `service`'s log, numbered from its `next_event_seq`: the caller
    holds the service's row lock, or has just created it."""
    session.add(
        ServiceEvent(
            service_id=service.id, seq=service.next_event_seq, at=now, kind=kind, data=data
        )
    )
    service.next_event_seq += 1
