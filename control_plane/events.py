"""The event logs of jobs and services (`job_events`, `service_events`): the one page query
both read. On the floor: it reads the tables only and imports no domain."""

from __future__ import annotations

from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.orm import InstrumentedAttribute, Session

from control_plane.models import JobEvent, ServiceEvent

Event = TypeVar("Event", JobEvent, ServiceEvent)


def events_after(
    session: Session,
    table: type[Event],
    owner: InstrumentedAttribute[str],
    owner_id: str,
    *,
    after: int,
    limit: int,
) -> list[Event]:
    """At most `limit` of `owner_id`'s events whose sequence number is past `after`, in order."""
    return list(
        session.scalars(
            select(table)
            .where(owner == owner_id, table.seq > after)
            .order_by(table.seq)
            .limit(limit)
        )
    )
