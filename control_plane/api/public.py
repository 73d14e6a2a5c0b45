"""Public endpoints: health and version. No authentication, no secrets."""

from __future__ import annotations

from fastapi import APIRouter

from control_plane import RELEASE_VERSION
from control_plane.api.deps import ContextDep, SessionDep
from control_plane.api.routing import LaneRoute
from control_plane.db import ping
from control_plane.schemas import Health, StorageHealth, VersionInfo
from control_plane.storage import measure_room
from modelforge_contracts import protocol

router = APIRouter(prefix="/api/v1", tags=["public"], route_class=LaneRoute)


@router.get("/health", response_model=Health)
def health(ctx: ContextDep, session: SessionDep) -> Health:
    """200 when the database answers; 503 `DATABASE_UNAVAILABLE` during an outage (the app's
    database handler), so a load balancer or orchestrator sees it. The data dir's free room
    rides along: below `MODELFORGE_STORAGE_LOW_FREE_BYTES` the storage is `low` and the status
    `degraded` — still 200, since reads and most requests still work."""
    ping(session=session)
    room = measure_room(
        [ctx.settings.data_dir, ctx.artifacts.root],
        low_below_bytes=ctx.settings.storage_low_free_bytes,
    )
    storage = StorageHealth(
        status=room.status,
        free_bytes=room.free_bytes,
        total_bytes=room.total_bytes,
        low_below_bytes=room.low_below_bytes,
    )
    status = "ok" if room.status == "ok" else "degraded"
    return Health(status=status, database="ok", storage=storage)


@router.get("/version", response_model=VersionInfo)
def version() -> VersionInfo:
    return VersionInfo(
        version=RELEASE_VERSION,
        protocol_version=protocol.PROTOCOL_VERSION,
        accepted_protocols=protocol.accepted(),
    )
