"""`GET /api/v1/admin/resources` (admin token or console session): every node's total, held and
free capacity, which GPUs are held and by whom, its running jobs and the queued work it could
take; the fleet's sums; the provisioners' outstanding requests."""

from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter, Query

from control_plane.access.roles import Area
from control_plane.api.deps import ContextDep, SessionDep, needs
from control_plane.api.routing import LaneRoute
from control_plane.provisioning.views import provisioning_status
from control_plane.scheduling import resources
from control_plane.scheduling.schemas import ResourcesView

router = APIRouter(
    prefix="/api/v1/admin", tags=["admin"], dependencies=[needs(Area.FLEET)], route_class=LaneRoute
)


@router.get("/resources", response_model=ResourcesView)
def read_resources(
    ctx: ContextDep,
    session: SessionDep,
    queued_ids: Annotated[int, Query(ge=0, le=resources.LISTED_MAX)] = resources.LISTED_DEFAULT,
) -> ResourcesView:
    """Counted by the scheduler's own rules: free is what it would place work on now."""
    now = ctx.clock.now()
    return resources.read_resources(
        session=session,
        now=now,
        liveness=ctx.liveness,
        provisioning=partial(provisioning_status, provisioner=ctx.provisioner, now=now),
        listed=queued_ids,
    )
