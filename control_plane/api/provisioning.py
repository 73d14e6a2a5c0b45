"""`GET /api/v1/admin/provisioners` (PV-1a): each provisioner's profiles, its requests —
outstanding ones first, with their Slurm job id, state and age — the nodes they brought, and the
latest events of each (every SSH call's outcome)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel
from sqlalchemy import select

from control_plane.api.deps import AdminDep, ContextDep, SessionDep
from control_plane.api.routing import LaneRoute
from control_plane.models import ProvisionEvent, ProvisionRequest
from control_plane.provisioning.provisioner import OUTSTANDING

router = APIRouter(
    prefix="/api/v1/admin", tags=["provisioning"], dependencies=[AdminDep], route_class=LaneRoute
)
_RECENT = 50
_EVENTS = 20


class ProfilePublic(BaseModel):
    name: str
    cpus: int
    gpus: int
    ram_mb: int
    labels: dict[str, str]
    sbatch: list[str]
    outstanding: int


class ProvisionEventPublic(BaseModel):
    at: datetime
    kind: str
    data: Any


class ProvisionRequestPublic(BaseModel):
    request_id: str
    profile: str
    state: str
    slurm_job_id: str | None
    node_id: str | None
    age_seconds: float
    created_at: datetime
    attached_at: datetime | None
    ended_at: datetime | None
    reason: str | None
    events: list[ProvisionEventPublic]


class ProvisionerPublic(BaseModel):
    name: str
    type: str
    login: str
    engine_url: str
    max_idle_s: float
    provision_timeout_s: float
    profiles: list[ProfilePublic]
    requests: list[ProvisionRequestPublic]


@router.get("/provisioners", response_model=list[ProvisionerPublic])
def list_provisioners(ctx: ContextDep, session: SessionDep) -> list[ProvisionerPublic]:
    now = ctx.clock.now()
    outstanding = ctx.provisioner.outstanding(session)
    views = []
    for provisioner in ctx.provisioner.provisioners.values():
        rows = list(
            session.scalars(
                select(ProvisionRequest)
                .where(ProvisionRequest.provisioner == provisioner.name)
                .order_by(
                    ProvisionRequest.state.in_(OUTSTANDING).desc(),
                    ProvisionRequest.created_at.desc(),
                )
                .limit(_RECENT)
            )
        )
        events: dict[str, list[ProvisionEventPublic]] = {row.id: [] for row in rows}
        if rows:
            for event in session.scalars(
                select(ProvisionEvent)
                .where(ProvisionEvent.request_id.in_(list(events)))
                .order_by(ProvisionEvent.id.desc())
            ):
                if len(events[event.request_id]) < _EVENTS:
                    events[event.request_id].append(
                        ProvisionEventPublic(at=event.at, kind=event.kind, data=event.data)
                    )
        views.append(
            ProvisionerPublic(
                name=provisioner.name,
                type=provisioner.type,
                login=provisioner.login,
                engine_url=provisioner.engine_url,
                max_idle_s=provisioner.max_idle_s,
                provision_timeout_s=provisioner.provision_timeout_s,
                profiles=[
                    ProfilePublic(
                        name=profile.name,
                        cpus=profile.cpus,
                        gpus=profile.gpus,
                        ram_mb=profile.ram_mb,
                        labels=profile.labels,
                        sbatch=profile.sbatch,
                        outstanding=outstanding.get((provisioner.name, profile.name), 0),
                    )
                    for profile in provisioner.profiles
                ],
                requests=[
                    ProvisionRequestPublic(
                        request_id=row.id,
                        profile=row.profile,
                        state=row.state,
                        slurm_job_id=row.slurm_job_id,
                        node_id=row.node_id,
                        age_seconds=(now - row.created_at).total_seconds(),
                        created_at=row.created_at,
                        attached_at=row.attached_at,
                        ended_at=row.ended_at,
                        reason=row.reason,
                        events=list(reversed(events[row.id])),
                    )
                    for row in rows
                ],
            )
        )
    return views
