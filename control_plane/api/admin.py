"""Admin API (`X-ModelForge-Admin-Token`, or a console session with its CSRF token): enrollments,
the wizard's node setup, nodes, events, telemetry history, credentials, signing key."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response, status

from control_plane.access.roles import Area
from control_plane.api.deps import AuditDep, ContextDep, SessionDep, needs
from control_plane.api.routing import LaneRoute
from control_plane.context import AppContext
from control_plane.fleet import enrollments, gpu_admin, node_admin, node_setup, nodes, readiness
from control_plane.fleet.reports import telemetry_points
from control_plane.fleet.schemas import (
    CredentialPublic,
    CredentialRevocation,
    EnrollmentCreate,
    EnrollmentMinted,
    EnrollmentPublic,
    GpuHealthEventPublic,
    GpuHealthPublic,
    KeyRotation,
    NodeEventPublic,
    NodeImage,
    NodeImageRequest,
    NodePublic,
    NodeSetup,
    NodeSetupRequest,
    QuarantineRequest,
    Readiness,
    TelemetryPoint,
)
from control_plane.models import Node, NodeCredential, NodeEnrollment
from control_plane.scheduling import gpu_admin as gpu_readmission
from control_plane.scheduling.schemas import QueuedWork
from control_plane.scheduling.waiting import could_run_on
from control_plane.schemas import ResourceId

router = APIRouter(
    prefix="/api/v1/admin", tags=["admin"], dependencies=[needs(Area.FLEET)], route_class=LaneRoute
)


def _enrollment_public(ctx: AppContext, row: NodeEnrollment) -> EnrollmentPublic:
    return EnrollmentPublic(
        enrollment_id=row.id,
        node_id=row.node_id,
        display_name=row.display_name,
        labels=row.labels,
        state=enrollments.enrollment_state(row, ctx.clock.now()),
        created_at=row.created_at,
        expires_at=row.expires_at,
        claimed_at=row.claimed_at,
        revoked_at=row.revoked_at,
        production_eligible=row.production_eligible,
    )


def _node_views(ctx: AppContext, session: SessionDep, rows: list[Node]) -> list[NodePublic]:
    return nodes.node_views(session=session, nodes=rows, now=ctx.clock.now(), liveness=ctx.liveness)


@router.post(
    "/node-enrollments", status_code=status.HTTP_201_CREATED, response_model=EnrollmentMinted
)
def mint_enrollment(
    body: EnrollmentCreate,
    request: Request,
    response: Response,
    ctx: ContextDep,
    session: SessionDep,
    audit: AuditDep,
) -> EnrollmentMinted:
    audit("enrollment.mint", body.display_name, labels=body.labels)
    minted = enrollments.mint_enrollment(
        session=session,
        clock=ctx.clock,
        display_name=body.display_name,
        expires_in_seconds=body.expires_in_seconds,
        labels=body.labels,
        production_eligible=body.production_eligible,
    )
    origin = ctx.settings.public_url or str(request.base_url).rstrip("/")
    public = _enrollment_public(ctx, minted.enrollment)
    audit.target = minted.enrollment.id
    # The one-time token: no cache (browser, proxy) may keep a copy.
    response.headers["Cache-Control"] = "no-store"
    return EnrollmentMinted(**public.model_dump(), token=minted.token, api_origin=origin)


@router.get("/node-enrollments", response_model=list[EnrollmentPublic])
def list_enrollments(ctx: ContextDep, session: SessionDep) -> list[EnrollmentPublic]:
    return [_enrollment_public(ctx, r) for r in enrollments.list_enrollments(session=session)]


@router.get("/node-enrollments/{enrollment_id}", response_model=EnrollmentPublic)
def get_enrollment(
    enrollment_id: ResourceId, ctx: ContextDep, session: SessionDep
) -> EnrollmentPublic:
    row = enrollments.get_enrollment(session=session, enrollment_id=enrollment_id)
    return _enrollment_public(ctx, row)


@router.post("/node-enrollments/{enrollment_id}/revoke", response_model=EnrollmentPublic)
def revoke_enrollment(
    enrollment_id: ResourceId, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> EnrollmentPublic:
    audit("enrollment.revoke", enrollment_id)
    row = enrollments.revoke_enrollment(
        session=session, clock=ctx.clock, enrollment_id=enrollment_id
    )
    return _enrollment_public(ctx, row)


@router.post("/node-images/check", response_model=NodeImage)
def check_node_image(body: NodeImageRequest, ctx: ContextDep) -> NodeImage:
    """The wizard checks the image before any token is minted; changes nothing."""
    return node_setup.check_image(request=body, release_manifest=ctx.settings.release_manifest)


@router.post("/node-enrollments/{enrollment_id}/node-setup", response_model=NodeSetup)
def generate_node_setup(
    enrollment_id: ResourceId,
    body: NodeSetupRequest,
    request: Request,
    ctx: ContextDep,
    session: SessionDep,
) -> NodeSetup:
    """The wizard's `.env` and commands for this enrollment; changes nothing."""
    return node_setup.setup_for_enrollment(
        session=session,
        enrollment_id=enrollment_id,
        request=body,
        request_origin=request.headers.get("origin"),
        release_manifest=ctx.settings.release_manifest,
    )


@router.get("/nodes", response_model=list[NodePublic])
def list_nodes(ctx: ContextDep, session: SessionDep) -> list[NodePublic]:
    return _node_views(ctx, session, nodes.list_nodes(session=session))


@router.get("/nodes/{node_id}", response_model=NodePublic)
def get_node(node_id: ResourceId, ctx: ContextDep, session: SessionDep) -> NodePublic:
    return _node_views(ctx, session, [nodes.get_node(session=session, node_id=node_id)])[0]


@router.delete("/nodes/{node_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_node(node_id: ResourceId, ctx: ContextDep, session: SessionDep, audit: AuditDep) -> None:
    audit("node.delete", node_id)
    node_admin.remove_node(
        session=session, authority=ctx.authority, heartbeats=ctx.heartbeats, node_id=node_id
    )


@router.get("/nodes/{node_id}/events", response_model=list[NodeEventPublic])
def list_node_events(
    node_id: ResourceId,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[NodeEventPublic]:
    rows = nodes.list_events(session=session, node_id=node_id, limit=limit)
    return [
        NodeEventPublic(
            id=r.id,
            at=r.at,
            kind=r.kind,
            from_state=r.from_state,
            to_state=r.to_state,
            reason=r.reason,
        )
        for r in rows
    ]


@router.get("/nodes/{node_id}/telemetry", response_model=list[TelemetryPoint])
def node_telemetry(
    node_id: ResourceId,
    ctx: ContextDep,
    session: SessionDep,
    minutes: Annotated[float, Query(gt=0, le=1440)] = 10,
) -> list[TelemetryPoint]:
    """Utilisation, memory, temperature and power per GPU over the last `minutes` (the
    console's charts)."""
    since = ctx.clock.now() - timedelta(minutes=minutes)
    return telemetry_points(session=session, node_id=node_id, since=since)


@router.get("/nodes/{node_id}/readiness", response_model=Readiness)
def node_readiness(node_id: ResourceId, ctx: ContextDep, session: SessionDep) -> Readiness:
    return readiness.node_readiness(
        session=session,
        node_id=node_id,
        now=ctx.clock.now(),
        liveness=ctx.liveness,
        telemetry_max_age=ctx.telemetry_max_age,
        inventory_max_age=timedelta(seconds=ctx.settings.inventory_max_age_seconds),
    )


@router.post("/nodes/{node_id}/credential/revoke", response_model=CredentialRevocation)
def revoke_node_credential(
    node_id: ResourceId, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> CredentialRevocation:
    audit("node.credential.revoke", node_id)
    revoked = node_admin.revoke_node_credentials(
        session=session, clock=ctx.clock, authority=ctx.authority, node_id=node_id
    )
    return CredentialRevocation(node_id=node_id, revoked=revoked)


GpuUuid = Annotated[str, Path(min_length=1, max_length=96, pattern=r"^[A-Za-z0-9_.:-]+$")]


@router.get("/nodes/{node_id}/gpus", response_model=list[GpuHealthPublic])
def list_node_gpus(node_id: ResourceId, session: SessionDep) -> list[GpuHealthPublic]:
    """Every GPU of the node: its health state, why, its quarantine and its active check."""
    return gpu_admin.gpus_of_node(session=session, node_id=node_id)


@router.get("/nodes/{node_id}/gpus/{uuid}/events", response_model=list[GpuHealthEventPublic])
def list_gpu_events(
    node_id: ResourceId,
    uuid: GpuUuid,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[GpuHealthEventPublic]:
    """The GPU's timeline, newest first: state changes, quarantines, re-admissions, checks."""
    return gpu_admin.gpu_events(session=session, node_id=node_id, uuid=uuid, limit=limit)


@router.post("/nodes/{node_id}/gpus/{uuid}/quarantine", response_model=GpuHealthPublic)
def quarantine_gpu(
    node_id: ResourceId,
    uuid: GpuUuid,
    body: QuarantineRequest,
    ctx: ContextDep,
    session: SessionDep,
    audit: AuditDep,
) -> GpuHealthPublic:
    """Out of the schedule by an operator's hand; what runs on it drains, nothing is stopped."""
    audit("gpu.quarantine", f"{node_id}/{uuid}", reason=body.reason)
    return gpu_admin.quarantine(
        session=session,
        clock=ctx.clock,
        node_id=node_id,
        uuid=uuid,
        reason=body.reason,
        actor=audit.actor,
    )


@router.post(
    "/nodes/{node_id}/gpus/{uuid}/readmit",
    response_model=GpuHealthPublic,
    responses={202: {"model": GpuHealthPublic, "description": "its active check started"}},
)
def readmit_gpu(
    node_id: ResourceId,
    uuid: GpuUuid,
    response: Response,
    ctx: ContextDep,
    session: SessionDep,
    audit: AuditDep,
) -> GpuHealthPublic:
    """200: back in the schedule; 202: its active check was queued, the GPU stays out."""
    audit("gpu.readmit", f"{node_id}/{uuid}")
    readmission = gpu_readmission.readmit(
        session=session,
        clock=ctx.clock,
        node_id=node_id,
        uuid=uuid,
        provider=ctx.settings.gpu_check_provider,
        actor=audit.actor,
    )
    if readmission.check_started:
        response.status_code = status.HTTP_202_ACCEPTED
    return readmission.gpu


@router.get("/credentials", response_model=list[CredentialPublic])
def list_credentials(
    session: SessionDep,
    node_id: Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] = None,
    active: bool | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[CredentialPublic]:
    """Node credentials, newest first: jti, node, labels, issued, expires, revoked (CR-3)."""
    rows = nodes.list_credentials(session=session, node_id=node_id, active=active, limit=limit)
    return [_credential_public(row) for row in rows]


def _credential_public(row: NodeCredential) -> CredentialPublic:
    return CredentialPublic(
        jti=row.jti,
        node_id=row.node_id,
        labels=row.labels or {},
        issuer=row.issuer,
        issued_at=row.issued_at,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
        revoked_reason=row.revoked_reason,
    )


@router.post("/credentials/{jti}/revoke", response_model=CredentialPublic)
def revoke_credential(
    jti: ResourceId, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> CredentialPublic:
    """Revoke one credential by its jti: it, and no other, is refused from now on."""
    audit("credential.revoke", jti)
    row = ctx.authority.revoke_jti(session, jti=jti, reason="revoked by an administrator")
    return _credential_public(row)


@router.post("/signing-key/rotate", response_model=KeyRotation, dependencies=[needs(Area.PEOPLE)])
def rotate_signing_key(ctx: ContextDep, session: SessionDep, audit: AuditDep) -> KeyRotation:
    audit("signing_key.rotate", "signing key")
    kid, revoked = ctx.authority.rotate(session)
    return KeyRotation(kid=kid, revoked_credentials=revoked)


@router.get("/nodes/{node_id}/queued-work", response_model=list[QueuedWork])
def node_queued_work(
    node_id: ResourceId,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> list[QueuedWork]:
    """The queued jobs and pending services this node could run, oldest first (its labels and
    size fit theirs; whether it has room now is the scheduler's call)."""
    return could_run_on(session, nodes.get_node(session=session, node_id=node_id), limit=limit)
