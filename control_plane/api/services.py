"""The product's model services (WL-5a): deploy, list, read, events, restart, undeploy for users
(admin token or console session), and the agents' service sync (node credential)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status
from sqlalchemy.orm import Session

from control_plane.access.roles import Area
from control_plane.api.deps import (
    AuditDep,
    ContextDep,
    NodeDep,
    SessionDep,
    client_address,
    needs,
)
from control_plane.api.routing import LaneRoute
from control_plane.context import AppContext
from control_plane.errors import InvalidRequest
from control_plane.gateway import usage
from control_plane.gateway.traffic import ServiceTraffic, read_traffic
from control_plane.models import Service, ServiceReplica
from control_plane.scheduling.waiting import explain
from control_plane.schemas import DB_INT_MAX, ResourceId
from control_plane.services import (
    access_tokens,
    aliases,
    lifecycle,
    placement,
    replicas,
    rollout,
    sync,
)
from control_plane.services.key_schemas import (
    AccessTokenCreate,
    AccessTokenMinted,
    AccessTokenPublic,
    ApiKeyCreate,
    ServiceUsage,
    TokenUsage,
)
from control_plane.services.schemas import (
    AgentServicesDesired,
    AgentServicesSync,
    ServiceCreate,
    ServiceEventPublic,
    ServicePublic,
    ServiceUpdate,
)

router = APIRouter(
    prefix="/api/v1", tags=["services"], dependencies=[needs(Area.WORK)], route_class=LaneRoute
)
agent_router = APIRouter(prefix="/api/v1/agent", tags=["agent"], route_class=LaneRoute)

#: How often an agent syncs its services.
SYNC_INTERVAL_SECONDS = 2.0


def _service_view(
    ctx: AppContext,
    session: Session,
    service: Service,
    copies: list[ServiceReplica] | None = None,
    names: list[str] | None = None,
) -> ServicePublic:
    # Why a pending service waits is read from the scheduler's fleet, built only when asked.
    reason = placement.waiting_reason(
        session=session,
        service=service,
        explain=lambda shape: explain(ctx.scheduler.fleet(session), shape),
    )
    if copies is None:
        copies = replicas.of_service(session, service.id)
    if names is None:
        names = aliases.by_service(session, [service.id]).get(service.id, [])
    return lifecycle.service_public(service, copies, reason, names)


@router.post("/services", status_code=status.HTTP_201_CREATED, response_model=ServicePublic)
def deploy_service(
    body: ServiceCreate, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> ServicePublic:
    audit("service.deploy", body.name, model=body.model, secrets=body.secrets)
    service = lifecycle.deploy(session=session, clock=ctx.clock, request=body)
    audit.target = f"{service.id} ({service.name})"
    return _service_view(ctx, session, service)


@router.get("/services", response_model=list[ServicePublic])
def list_services(
    ctx: ContextDep,
    session: SessionDep,
    state: Annotated[
        str | None,
        Query(
            pattern="^(pending|starting|healthy|degraded|unhealthy|restarting|stopped|failed|idle)$"
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[ServicePublic]:
    rows = lifecycle.list_services(session=session, state=state, limit=limit)
    copies = replicas.by_service(session, [row.id for row in rows])
    held = aliases.by_service(session, [row.id for row in rows])
    return [_service_view(ctx, session, row, copies[row.id], held.get(row.id, [])) for row in rows]


@router.get("/services/{service_id}", response_model=ServicePublic)
def get_service(service_id: ResourceId, ctx: ContextDep, session: SessionDep) -> ServicePublic:
    service = lifecycle.get_service(session=session, service_id=service_id)
    return _service_view(ctx, session, service)


@router.get("/services/{service_id}/events", response_model=list[ServiceEventPublic])
def service_events(
    service_id: ResourceId,
    session: SessionDep,
    after: Annotated[int, Query(ge=0, le=DB_INT_MAX)] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 1000,
) -> list[ServiceEventPublic]:
    rows = lifecycle.list_events(session=session, service_id=service_id, after=after, limit=limit)
    return [lifecycle.event_public(row) for row in rows]


@router.patch("/services/{service_id}", response_model=ServicePublic)
def update_service(
    service_id: ResourceId,
    body: ServiceUpdate,
    ctx: ContextDep,
    session: SessionDep,
    audit: AuditDep,
) -> ServicePublic:
    """Change a service: what runs -> a new revision rolled out (new replicas warm before the
    old ones drain); `replicas` or `autoscale` alone -> scaled. 409 ROLLOUT_IN_PROGRESS."""
    audit("service.update", service_id, fields=sorted(body.model_fields_set))
    service = rollout.change(
        session=session,
        clock=ctx.clock,
        service_id=service_id,
        request=body,
        deadline=ctx.settings.service_rollout_timeout_seconds,
    )
    return _service_view(ctx, session, service)


@router.post("/services/{service_id}/restart", response_model=ServicePublic)
def restart_service(
    service_id: ResourceId, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> ServicePublic:
    audit("service.restart", service_id)
    service = lifecycle.restart(session=session, clock=ctx.clock, service_id=service_id)
    return _service_view(ctx, session, service)


@router.delete("/services/{service_id}", response_model=ServicePublic)
def undeploy_service(
    service_id: ResourceId, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> ServicePublic:
    """Undeploy: its node's agent stops its whole process group at its next sync (seconds),
    and its resources are free for other work at once."""
    audit("service.undeploy", service_id)
    service = lifecycle.undeploy(session=session, clock=ctx.clock, service_id=service_id)
    return _service_view(ctx, session, service)


# -- access tokens (the gateway's) -------------------------------------------------------------


@router.post(
    "/services/{service_id}/access-tokens",
    status_code=status.HTTP_201_CREATED,
    response_model=AccessTokenMinted,
)
def mint_access_token(
    service_id: ResourceId,
    body: AccessTokenCreate,
    response: Response,
    ctx: ContextDep,
    session: SessionDep,
    audit: AuditDep,
) -> AccessTokenMinted:
    """The token is in this answer only; lists show its hint."""
    audit(
        "service_token.create",
        service_id,
        name=body.name,
        rate_per_second=body.rate_per_second,
        burst=body.burst,
        tokens_per_minute=body.tokens_per_minute,
    )
    minted = access_tokens.mint(
        session=session, clock=ctx.clock, service_id=service_id, actor=audit.actor, request=body
    )
    audit.target = f"{service_id}/{minted.row.id}"
    # The one-time token: no cache (browser, proxy) may keep a copy.
    response.headers["Cache-Control"] = "no-store"
    public = access_tokens.token_public(minted.row)
    return AccessTokenMinted(**public.model_dump(), token=minted.token)


@router.post(
    "/access-tokens", status_code=status.HTTP_201_CREATED, response_model=AccessTokenMinted
)
def mint_api_key(
    body: ApiKeyCreate, response: Response, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> AccessTokenMinted:
    """An API key of no one service: it opens the services it names, or every LLM service
    (docs/llm.md, Keys). The key is in this answer only; lists show its hint."""
    audit(
        "access_token.create",
        "",
        name=body.name,
        services=list(body.services),
        llm_services=body.llm_services,
        rate_per_second=body.rate_per_second,
        burst=body.burst,
        tokens_per_minute=body.tokens_per_minute,
    )
    minted = access_tokens.mint_key(
        session=session, clock=ctx.clock, actor=audit.actor, request=body
    )
    audit.target = minted.row.id
    response.headers["Cache-Control"] = "no-store"
    public = access_tokens.token_public(minted.row, minted.services)
    return AccessTokenMinted(**public.model_dump(), token=minted.token)


@router.get("/access-tokens", response_model=list[AccessTokenPublic])
def list_api_keys(session: SessionDep) -> list[AccessTokenPublic]:
    """The keys of no one service, newest first (a service's own tokens are listed under it)."""
    return [
        access_tokens.token_public(row, services)
        for row, services in access_tokens.list_keys(session=session)
    ]


@router.delete("/access-tokens/{token_id}", response_model=AccessTokenPublic)
def revoke_api_key(
    token_id: ResourceId, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> AccessTokenPublic:
    """Revoked for good; the gateway refuses it within a second."""
    audit("access_token.revoke", token_id)
    row, services = access_tokens.revoke_key(session=session, clock=ctx.clock, token_id=token_id)
    return access_tokens.token_public(row, services)


@router.get("/services/{service_id}/usage", response_model=ServiceUsage)
def service_usage(
    service_id: ResourceId,
    ctx: ContextDep,
    session: SessionDep,
    since: Annotated[datetime | None, Query()] = None,
    until: Annotated[datetime | None, Query()] = None,
) -> ServiceUsage:
    """The tokens of its OpenAI calls per access token, from `since` (default: a day ago) to
    `until` (default: now), as the engine counted them (docs/llm.md, Usage)."""
    lifecycle.get_service(session=session, service_id=service_id)
    until = _aware(until) if until is not None else ctx.clock.now()
    since = _aware(since) if since is not None else until - timedelta(days=1)
    if since > until:
        raise InvalidRequest(
            "since is after until.",
            "Give since before until (ISO 8601 times, e.g. 2026-12-07T10:00:00Z).",
            code="INVALID_WINDOW",
        )
    rows = [
        TokenUsage.model_validate(row) for row in usage.usage_of(session, service_id, since, until)
    ]
    return ServiceUsage(
        service_id=service_id,
        since=since,
        until=until,
        tokens=rows,
        requests=sum(row.requests for row in rows),
        prompt_tokens=sum(row.prompt_tokens for row in rows),
        completion_tokens=sum(row.completion_tokens for row in rows),
    )


def _aware(moment: datetime) -> datetime:
    """A time without a zone is taken as UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@router.get("/services/{service_id}/access-tokens", response_model=list[AccessTokenPublic])
def list_access_tokens(service_id: ResourceId, session: SessionDep) -> list[AccessTokenPublic]:
    rows = access_tokens.list_tokens(session=session, service_id=service_id)
    return [access_tokens.token_public(row) for row in rows]


@router.delete("/services/{service_id}/access-tokens/{token_id}", response_model=AccessTokenPublic)
def revoke_access_token(
    service_id: ResourceId,
    token_id: ResourceId,
    ctx: ContextDep,
    session: SessionDep,
    audit: AuditDep,
) -> AccessTokenPublic:
    """Revoked for good; the gateway refuses it within a second."""
    audit("service_token.revoke", f"{service_id}/{token_id}")
    row = access_tokens.revoke(
        session=session, clock=ctx.clock, service_id=service_id, token_id=token_id
    )
    return access_tokens.token_public(row)


@router.get("/services/{service_id}/traffic", response_model=ServiceTraffic)
def service_traffic(service_id: ResourceId, ctx: ContextDep, session: SessionDep) -> ServiceTraffic:
    """The gateway's counters for the service in this control-plane process, cumulative since
    it started (what `/metrics` exports, for one service): the console turns reads into rates.
    An LLM service's also has its engines' own load, as the nodes last read it."""
    service = lifecycle.get_service(session=session, service_id=service_id)
    traffic = read_traffic(
        ctx.metrics.registry, service_id=service.id, name=service.name, read_at=ctx.clock.now()
    )
    traffic.engine = replicas.engine_load(session, service.id)
    return traffic


# -- the agents' service sync -------------------------------------------------------------------


@agent_router.post("/services/sync", response_model=AgentServicesDesired)
async def sync_services(
    body: AgentServicesSync, node: NodeDep, ctx: ContextDep, request: Request
) -> AgentServicesDesired:
    """The agent reports its services and gets those it must run, with their secrets."""

    def work() -> AgentServicesDesired:
        with ctx.session_factory.begin() as session:
            desired = sync.sync(
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
