"""What an admin sees of provisioning: each configured provisioner, its profiles with their
outstanding requests, and its most recent requests (outstanding ones first) with their latest
events (every SSH call's outcome); and the resources view's part, its outstanding requests.
Only reads."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.models import ProvisionEvent, ProvisionRequest
from control_plane.provisioning.config import SlurmProvisioner
from control_plane.provisioning.provisioner import OUTSTANDING, Provisioner
from control_plane.provisioning.schemas import (
    ProfilePublic,
    ProvisionerPublic,
    ProvisionEventPublic,
    ProvisionRequestPublic,
)
from control_plane.scheduling.schemas import OutstandingRequest, ProvisionerStatus

#: Requests shown per provisioner, and events per request.
_RECENT = 50
_EVENTS = 20


def list_provisioners(
    *, session: Session, provisioner: Provisioner, now: datetime
) -> list[ProvisionerPublic]:
    """Every configured provisioner, in configuration order."""
    outstanding = provisioner.outstanding(session)
    return [
        _provisioner_public(session, configured, outstanding, now)
        for configured in provisioner.provisioners.values()
    ]


def _provisioner_public(
    session: Session,
    provisioner: SlurmProvisioner,
    outstanding: dict[tuple[str, str], int],
    now: datetime,
) -> ProvisionerPublic:
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
    events = _latest_events(session, [row.id for row in rows])
    return ProvisionerPublic(
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
                events=events[row.id],
            )
            for row in rows
        ],
    )


def _latest_events(
    session: Session, request_ids: list[str]
) -> dict[str, list[ProvisionEventPublic]]:
    """Each request's latest `_EVENTS` events, oldest first."""
    newest_first: dict[str, list[ProvisionEventPublic]] = {id_: [] for id_ in request_ids}
    if request_ids:
        for event in session.scalars(
            select(ProvisionEvent)
            .where(ProvisionEvent.request_id.in_(request_ids))
            .order_by(ProvisionEvent.id.desc())
        ):
            if len(newest_first[event.request_id]) < _EVENTS:
                newest_first[event.request_id].append(
                    ProvisionEventPublic(at=event.at, kind=event.kind, data=event.data)
                )
    return {id_: list(reversed(found)) for id_, found in newest_first.items()}


def provisioning_status(
    session: Session, *, provisioner: Provisioner, now: datetime
) -> list[ProvisionerStatus]:
    """The resources view's part (`scheduling/resources.py`): every configured provisioner, in
    configuration order, with its outstanding requests, oldest first, and its attached nodes."""
    outstanding: dict[str, list[OutstandingRequest]] = {}
    for row in session.scalars(
        select(ProvisionRequest)
        .where(ProvisionRequest.state.in_(OUTSTANDING))
        .order_by(ProvisionRequest.created_at, ProvisionRequest.id)
    ):
        outstanding.setdefault(row.provisioner, []).append(
            OutstandingRequest(
                request_id=row.id,
                profile=row.profile,
                state=row.state,
                slurm_job_id=row.slurm_job_id,
                age_seconds=(now - row.created_at).total_seconds(),
            )
        )
    attached: dict[str, int] = {
        name: count
        for name, count in session.execute(
            select(ProvisionRequest.provisioner, func.count())
            .where(ProvisionRequest.state == "attached")
            .group_by(ProvisionRequest.provisioner)
        )
    }
    return [
        ProvisionerStatus(
            name=configured.name,
            type=configured.type,
            outstanding=len(outstanding.get(configured.name, [])),
            attached=attached.get(configured.name, 0),
            requests=outstanding.get(configured.name, []),
        )
        for configured in provisioner.provisioners.values()
    ]
