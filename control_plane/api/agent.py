"""Agent API under /api/v1/agent: enroll (enrollment token), then heartbeat, inventory,
telemetry and GPU health authenticated by the node credential.

The protocol verdict on enroll and heartbeat comes first, judged from the raw JSON before the
body is validated: an agent of another protocol, whose body has another shape, still learns
TOO_OLD / TOO_NEW (426) instead of a validation error."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool

from control_plane.api.deps import ContextDep, NodeDep, SessionDep
from control_plane.api.routing import LaneRoute
from control_plane.context import AppContext
from control_plane.errors import ProtocolIncompatible
from control_plane.fleet import enrollments, reports
from control_plane.fleet.compatibility import judge_protocol
from control_plane.fleet.heartbeats import accept_heartbeat
from control_plane.fleet.schemas import (
    EnrollRequest,
    EnrollResponse,
    GpuHealthRequest,
    HeartbeatRequest,
    HeartbeatResponse,
    InventoryRequest,
    TelemetryRequest,
)
from control_plane.scheduling import gpu_health
from control_plane.schemas import Accepted

router = APIRouter(prefix="/api/v1/agent", tags=["agent"], route_class=LaneRoute)


def _intervals(ctx: AppContext) -> dict[str, float]:
    return {
        "heartbeat_interval_seconds": ctx.settings.heartbeat_interval_seconds,
        "telemetry_interval_seconds": ctx.settings.telemetry_interval_seconds,
        "inventory_interval_seconds": ctx.settings.inventory_max_age_seconds / 4,
    }


async def _raw_protocol(request: Request) -> tuple[bool, Any]:
    """(found, value) of `protocol_version` in the raw JSON object; (False, None) for a body
    that is not a JSON object, which body validation then refuses."""
    try:
        raw = json.loads(await request.body())
    except (ValueError, RecursionError):
        return False, None
    if not isinstance(raw, dict):
        return False, None
    return True, raw.get("protocol_version")


async def enroll_protocol(request: Request) -> int | None:
    """Judged before the body is validated and before the token is touched: an incompatible
    agent consumes nothing."""
    found, value = await _raw_protocol(request)
    return judge_protocol(value, component="agent") if found else None


async def heartbeat_protocol(request: Request, node: NodeDep, ctx: ContextDep) -> int | None:
    """Judged after the credential, before the body is validated; a refusal is recorded."""
    found, value = await _raw_protocol(request)
    if not found:
        return None
    try:
        return judge_protocol(value, component="agent")
    except ProtocolIncompatible as refusal:
        await run_in_threadpool(_refuse, ctx, node.node_id, refusal)
        raise


def _refuse(ctx: AppContext, node_id: str, refusal: ProtocolIncompatible) -> None:
    with ctx.session_factory.begin() as session:
        reports.record_incompatibility(
            session=session, clock=ctx.clock, node_id=node_id, refusal=refusal
        )


@router.post("/enroll", response_model=EnrollResponse)
def enroll(
    _protocol: Annotated[int | None, Depends(enroll_protocol)],
    body: EnrollRequest,
    response: Response,
    ctx: ContextDep,
) -> EnrollResponse:
    protocol = judge_protocol(body.protocol_version, component="agent")
    result = enrollments.claim_enrollment(
        session_factory=ctx.session_factory,
        clock=ctx.clock,
        authority=ctx.authority,
        token=body.token,
        claim_nonce=body.claim_nonce,
        hostname=body.hostname,
        agent_version=body.agent_version,
        protocol_version=protocol,
        fingerprint=body.fingerprint.model_dump() if body.fingerprint else None,
    )
    # It carries the node credential: no cache may keep a copy.
    response.headers["Cache-Control"] = "no-store"
    return EnrollResponse(
        node_id=result.node_id,
        credential=result.credential,
        labels=result.labels,
        **_intervals(ctx),
    )


@router.post("/heartbeat", response_model=HeartbeatResponse)
async def heartbeat(
    _protocol: Annotated[int | None, Depends(heartbeat_protocol)],
    body: HeartbeatRequest,
    node: NodeDep,
    ctx: ContextDep,
) -> HeartbeatResponse:
    # No database round trip (see fleet/heartbeats.py). The protocol was judged, and a
    # refusal recorded, by `heartbeat_protocol` from the same JSON before `body` was validated.
    return accept_heartbeat(
        body,
        node_id=node.node_id,
        buffer=ctx.heartbeats,
        clock=ctx.clock,
        settings=ctx.settings,
        metrics=ctx.metrics,
    )


@router.put("/inventory", response_model=Accepted)
def inventory(body: InventoryRequest, node: NodeDep, ctx: ContextDep) -> Accepted:
    if body.runtime_worker is not None:
        try:
            judge_protocol(body.runtime_worker.protocol_version, component="runtime-worker")
        except ProtocolIncompatible as refusal:
            _refuse(ctx, node.node_id, refusal)
            raise
    with ctx.session_factory.begin() as session:
        at = reports.store_inventory(
            session=session,
            clock=ctx.clock,
            node_id=node.node_id,
            inventory=body.model_dump(exclude_none=True),
        )
    return Accepted(received_at=at)


@router.post("/telemetry", response_model=Accepted)
def telemetry(
    body: TelemetryRequest, node: NodeDep, session: SessionDep, ctx: ContextDep
) -> Accepted:
    at = reports.store_telemetry(
        session=session,
        clock=ctx.clock,
        node_id=node.node_id,
        telemetry=body.model_dump(exclude_none=True),
    )
    return Accepted(received_at=at)


@router.post("/gpu-health", response_model=Accepted)
def gpu_health_report(
    body: GpuHealthRequest, node: NodeDep, session: SessionDep, ctx: ContextDep
) -> Accepted:
    """The agent's judgement of every GPU (issue 28): a GPU it finds unhealthy leaves the
    schedule, and the jobs and services on it are stopped and placed again."""
    gpu_health.apply_report(session=session, clock=ctx.clock, node_id=node.node_id, report=body)
    return Accepted(received_at=ctx.clock.now())
