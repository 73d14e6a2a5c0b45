"""`GET /api/v1/admin/provisioners` (PV-1a): each provisioner's profiles, its requests —
outstanding ones first, with their Slurm job id, state and age — the nodes they brought, and the
latest events of each (every SSH call's outcome)."""

from __future__ import annotations

from fastapi import APIRouter

from control_plane.access.roles import Area
from control_plane.api.deps import ContextDep, SessionDep, needs
from control_plane.api.routing import LaneRoute
from control_plane.provisioning import views
from control_plane.provisioning.schemas import ProvisionerPublic

router = APIRouter(
    prefix="/api/v1/admin",
    tags=["provisioning"],
    dependencies=[needs(Area.FLEET)],
    route_class=LaneRoute,
)


@router.get("/provisioners", response_model=list[ProvisionerPublic])
def list_provisioners(ctx: ContextDep, session: SessionDep) -> list[ProvisionerPublic]:
    return views.list_provisioners(
        session=session, provisioner=ctx.provisioner, now=ctx.clock.now()
    )
