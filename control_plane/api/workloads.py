"""Services (WL-5a), models (WL-5c), secrets (WL-6a) and the audit log (AU-1) for users (admin
token or console session), and the agents' service sync (node credential)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, status
from sqlalchemy.orm import Session

from control_plane import audit as audit_log
from control_plane.api.deps import (
    AdminDep,
    AuditDep,
    ContextDep,
    NodeDep,
    SessionDep,
    client_address,
)
from control_plane.api.routing import LaneRoute
from control_plane.catalog import catalog as models_catalog
from control_plane.context import AppContext
from control_plane.models import Service
from control_plane.scheduling.waiting import explain
from control_plane.schemas import DB_INT_MAX, ResourceId
from control_plane.services import deployments
from control_plane.vault import vault as secrets_vault
from control_plane.workload_schemas import (
    AgentServicesDesired,
    AgentServicesSync,
    AuditEntryPublic,
    ModelCreate,
    ModelPublic,
    SecretPublic,
    SecretPut,
    ServiceCreate,
    ServiceEventPublic,
    ServicePublic,
)

router = APIRouter(prefix="/api/v1", dependencies=[AdminDep], route_class=LaneRoute)
agent_router = APIRouter(prefix="/api/v1/agent", tags=["agent"], route_class=LaneRoute)

SecretNamePath = Annotated[str, Path(pattern=r"^[A-Z_][A-Z0-9_]{0,99}$")]
#: How often an agent syncs its services.
SYNC_INTERVAL_SECONDS = 2.0


# -- models -------------------------------------------------------------------------------------


@router.post(
    "/models", status_code=status.HTTP_201_CREATED, response_model=ModelPublic, tags=["models"]
)
def create_model(
    body: ModelCreate, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> ModelPublic:
    audit("model.create", f"{body.name}@{body.version}", weights=body.weights)
    model = models_catalog.create_model(session=session, clock=ctx.clock, request=body)
    return models_catalog.model_public(model)


@router.get("/models", response_model=list[ModelPublic], tags=["models"])
def list_models(
    session: SessionDep,
    name: Annotated[str | None, Query(max_length=100)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[ModelPublic]:
    rows = models_catalog.list_models(session=session, name=name, limit=limit)
    return [models_catalog.model_public(row) for row in rows]


@router.get("/models/{model_id}", response_model=ModelPublic, tags=["models"])
def get_model(model_id: ResourceId, session: SessionDep) -> ModelPublic:
    return models_catalog.model_public(models_catalog.get_model(session=session, model_id=model_id))


# -- secrets ------------------------------------------------------------------------------------


@router.put("/admin/secrets/{name}", response_model=SecretPublic, tags=["secrets"])
def put_secret(
    name: SecretNamePath, body: SecretPut, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> SecretPublic:
    """Set a secret's value (write-only: no API returns it) and the labels a node's signed
    credential must carry to receive it."""
    audit("secret.set", name, labels=body.labels)
    row = secrets_vault.put_secret(
        session=session, clock=ctx.clock, vault=ctx.vault, name=name, request=body
    )
    return secrets_vault.secret_public(row)


@router.get("/admin/secrets", response_model=list[SecretPublic], tags=["secrets"])
def list_secrets(session: SessionDep) -> list[SecretPublic]:
    return [secrets_vault.secret_public(row) for row in secrets_vault.list_secrets(session=session)]


@router.delete("/admin/secrets/{name}", status_code=status.HTTP_204_NO_CONTENT, tags=["secrets"])
def delete_secret(name: SecretNamePath, session: SessionDep, audit: AuditDep) -> None:
    audit("secret.delete", name)
    secrets_vault.delete_secret(session=session, name=name)


@router.post("/admin/secrets/rotate-key", tags=["secrets"])
def rotate_secret_key(ctx: ContextDep, session: SessionDep, audit: AuditDep) -> dict[str, object]:
    """A new encryption key; every secret re-encrypted with it in one transaction. The old key
    file stays in `<data dir>/secret-keys/` until you delete it."""
    audit("secret.rotate_key", "secret key")
    key_id, count = ctx.vault.rotate(session)
    audit.detail = {"key_id": key_id, "secrets": count}
    return {"key_id": key_id, "reencrypted": count}


# -- services -----------------------------------------------------------------------------------


def _service_view(ctx: AppContext, session: Session, service: Service) -> ServicePublic:
    reason = None
    if service.state == "pending":
        fleet = ctx.scheduler.fleet(session)
        reason = deployments.waiting_reason(session, service, lambda shape: explain(fleet, shape))
    return deployments.service_public(service, reason)


@router.post(
    "/services",
    status_code=status.HTTP_201_CREATED,
    response_model=ServicePublic,
    tags=["services"],
)
def deploy_service(
    body: ServiceCreate, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> ServicePublic:
    audit("service.deploy", body.name, model=body.model, secrets=body.secrets)
    service = deployments.deploy(session=session, clock=ctx.clock, request=body)
    audit.target = f"{service.id} ({service.name})"
    return _service_view(ctx, session, service)


@router.get("/services", response_model=list[ServicePublic], tags=["services"])
def list_services(
    ctx: ContextDep,
    session: SessionDep,
    state: Annotated[
        str | None,
        Query(pattern="^(pending|starting|healthy|unhealthy|restarting|stopped|failed)$"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[ServicePublic]:
    rows = deployments.list_services(session=session, state=state, limit=limit)
    return [_service_view(ctx, session, row) for row in rows]


@router.get("/services/{service_id}", response_model=ServicePublic, tags=["services"])
def get_service(service_id: ResourceId, ctx: ContextDep, session: SessionDep) -> ServicePublic:
    service = deployments.get_service(session=session, service_id=service_id)
    return _service_view(ctx, session, service)


@router.get(
    "/services/{service_id}/events", response_model=list[ServiceEventPublic], tags=["services"]
)
def service_events(
    service_id: ResourceId,
    session: SessionDep,
    after: Annotated[int, Query(ge=0, le=DB_INT_MAX)] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 1000,
) -> list[ServiceEventPublic]:
    rows = deployments.list_events(session=session, service_id=service_id, after=after, limit=limit)
    return [deployments.event_public(row) for row in rows]


@router.post("/services/{service_id}/restart", response_model=ServicePublic, tags=["services"])
def restart_service(
    service_id: ResourceId, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> ServicePublic:
    audit("service.restart", service_id)
    service = deployments.restart(session=session, clock=ctx.clock, service_id=service_id)
    return _service_view(ctx, session, service)


@router.delete("/services/{service_id}", response_model=ServicePublic, tags=["services"])
def undeploy_service(
    service_id: ResourceId, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> ServicePublic:
    """Undeploy: its node's agent stops its whole process group at its next sync (seconds),
    and its resources are free for other work at once."""
    audit("service.undeploy", service_id)
    service = deployments.undeploy(session=session, clock=ctx.clock, service_id=service_id)
    return _service_view(ctx, session, service)


# -- audit --------------------------------------------------------------------------------------


@router.get("/admin/audit", response_model=list[AuditEntryPublic], tags=["admin"])
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


# -- the agents' service sync -------------------------------------------------------------------


@agent_router.post("/services/sync", response_model=AgentServicesDesired)
async def sync_services(
    body: AgentServicesSync, node: NodeDep, ctx: ContextDep, request: Request
) -> AgentServicesDesired:
    """The agent reports its services and gets those it must run, with their secrets."""

    def work() -> AgentServicesDesired:
        with ctx.session_factory.begin() as session:
            desired = deployments.sync(
                session=session,
                clock=ctx.clock,
                vault=ctx.vault,
                node_id=node.node_id,
                carried=node.labels,
                seen_host=client_address(request),
                body=body,
            )
        return AgentServicesDesired(services=desired, poll_interval_seconds=SYNC_INTERVAL_SECONDS)

    # On the agent lane: agents' traffic never takes the pool every request's dependencies
    # (health's included) share.
    return await ctx.lanes.agent.run(work)
