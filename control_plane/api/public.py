"""Public endpoints: health and version. No authentication, no secrets."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from control_plane import RELEASE_VERSION
from control_plane.api.deps import SessionDep
from control_plane.schemas import Health, VersionInfo
from modelforge_contracts import protocol

router = APIRouter(prefix="/api/v1", tags=["public"])


@router.get("/health", response_model=Health)
def health(session: SessionDep) -> Health:
    """200 when the database answers; 503 `DATABASE_UNAVAILABLE` during an outage (the app's
    database handler), so a load balancer or orchestrator sees it."""
    session.execute(text("SELECT 1"))
    return Health(status="ok", database="ok")


@router.get("/version", response_model=VersionInfo)
def version() -> VersionInfo:
    return VersionInfo(
        version=RELEASE_VERSION,
        protocol_version=protocol.PROTOCOL_VERSION,
        accepted_protocols=protocol.accepted(),
    )
