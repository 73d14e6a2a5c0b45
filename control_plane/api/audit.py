"""The audit log (AU-1) for users (admin token or console session): admin actions, newest
first."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from control_plane import audit as audit_log
from control_plane.access.roles import Area
from control_plane.api.deps import SessionDep, needs
from control_plane.api.routing import LaneRoute
from control_plane.schemas import DB_INT_MAX, AuditEntryPublic

router = APIRouter(
    prefix="/api/v1/admin", tags=["admin"], dependencies=[needs(Area.AUDIT)], route_class=LaneRoute
)


@router.get("/audit", response_model=list[AuditEntryPublic])
def list_audit(
    session: SessionDep,
    action: Annotated[str | None, Query(max_length=40)] = None,
    actor: Annotated[str | None, Query(max_length=64)] = None,
    target: Annotated[str | None, Query(max_length=300)] = None,
    since: datetime | None = None,
    before: Annotated[int | None, Query(ge=1, le=DB_INT_MAX)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[AuditEntryPublic]:
    """Admin actions, newest first; `before` (an entry's id) pages back."""
    rows = audit_log.list_entries(
        session=session,
        action=action,
        actor=actor,
        target=target,
        since=since,
        before_id=before,
        limit=limit,
    )
    return [
        AuditEntryPublic(
            id=row.id,
            at=row.at,
            actor=row.actor,
            action=row.action,
            target=row.target,
            outcome=row.outcome,
            detail=row.detail,
        )
        for row in rows
    ]
