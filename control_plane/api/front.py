"""The served stack, composed in one place: what a request meets, outermost first.

- `ServedApp` (`rsgi.py`): what Granian serves on its RSGI interface. It answers the agents'
  requests through the fast path straight from RSGI's protocol object and serves everything
  else with the ASGI app below through its bridge; it runs the ASGI lifespan.
- `AgentFastPath` (`agent_fast.py`): the outermost ASGI app (what the tests' in-process client
  calls). It answers heartbeats, claims and completions it is sure of, and hands anything else
  on, body intact, to the gateway.
- `Gateway` (`gateway.py`): every deployed service at this address (the Open Inference
  Protocol at `/v2/...`, any service at `/services/{name}/...`), carried to a replica through
  its node's tunnel; anything else goes on to the edge. It bounds its own bodies (the edge's
  general limit is for the API's JSON, not for tensors).
- `PeerRoute` (`gateway_peers.py`): the internal route where another control-plane replica's
  gateway forwards a request for a node whose tunnel this process holds (signed with the
  replicas' shared key); anything else goes on to the edge.
- `Edge` (`edge.py`): body limits, the query check, the security headers.
- `JsonGuard` (`edge.py`): too deep, non-finite or malformed JSON refused.
- the FastAPI app (`app.py`): the routes and the one mapping of errors to HTTP.

Each layer is a named attribute of `Front`, so nothing reaches one through another's `.app`
(each seam's `.app` is only the next app it calls, as ASGI middleware has it). It builds
nothing but the layers: the routes and the context come from `app.py`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import FastAPI

from control_plane.api.agent_fast import AgentFastPath
from control_plane.api.asgi import ASGIApp
from control_plane.api.edge import Edge, JsonGuard
from control_plane.api.gateway import Gateway, GatewayLimits
from control_plane.api.gateway_peers import PeerRoute
from control_plane.api.rsgi import ServedApp
from control_plane.context import AppContext
from control_plane.gateway.auth import GatewayAuth
from control_plane.gateway.metrics import GatewayMetrics
from control_plane.gateway.routing import RoutingSnapshot, RoutingTable, read_snapshot
from control_plane.gateway.usage import UsageBook
from control_plane.scheduling.placement import free_capacity
from control_plane.services import autoscale, placement


@dataclass(frozen=True)
class Front:
    """The control plane's served layers, outermost first (see the module's docstring)."""

    agent_fast: AgentFastPath
    gateway: Gateway
    peers: PeerRoute
    edge: Edge
    json_guard: JsonGuard
    routes: FastAPI

    @property
    def asgi(self) -> AgentFastPath:
        """The outermost ASGI app: what an in-process ASGI client serves."""
        return self.agent_fast

    def served(self) -> ServedApp:
        """The RSGI app Granian serves: the fast path on RSGI, in front of the ASGI app."""
        return ServedApp(self.agent_fast, self.gateway)


def compose_front(routes: FastAPI, ctx: AppContext) -> Front:
    """Put the seams in front of the FastAPI app `routes`; `ctx` is the running context."""
    json_guard = JsonGuard(routes)
    edge = Edge(json_guard, ctx)
    peers = PeerRoute(
        edge,
        hub=ctx.hub,
        key=lambda: ctx.hub.peer_key,
        clock=ctx.clock,
        body_limit=ctx.settings.gateway_max_body_bytes,
        body_timeout=ctx.settings.gateway_body_timeout_seconds,
    )
    gateway = compose_gateway(peers, ctx)
    return Front(
        agent_fast=AgentFastPath(gateway, ctx),
        gateway=gateway,
        peers=peers,
        edge=edge,
        json_guard=json_guard,
        routes=routes,
    )


def compose_gateway(app: ASGIApp, ctx: AppContext) -> Gateway:
    """The gateway in front of `app`: its routing table, token checks and metrics."""
    settings = ctx.settings

    def read() -> RoutingSnapshot:
        with ctx.read_session_factory() as session:
            return read_snapshot(session)

    liveness = ctx.liveness
    return Gateway(
        app,
        table=RoutingTable(read=read, node_state=liveness.state_of, clock=ctx.clock),
        opener=lambda: ctx.hub,
        auth=GatewayAuth(
            read_sessions=ctx.read_session_factory,
            write_sessions=ctx.session_factory,
            clock=ctx.clock,
        ),
        metrics=GatewayMetrics(ctx.metrics.registry),
        clock=ctx.clock,
        limits=GatewayLimits(
            body_bytes=settings.gateway_max_body_bytes,
            retry_bytes=settings.gateway_retry_body_bytes,
            body_timeout=settings.gateway_body_timeout_seconds,
            concurrent=settings.gateway_max_concurrent_per_service,
            queue=settings.gateway_queue_per_service,
            queue_wait=settings.gateway_queue_seconds,
            cold_start_wait=settings.gateway_cold_start_seconds,
        ),
        scale_up=lambda target: asyncio.to_thread(wake_service, ctx, target.id),
        traffic=ctx.traffic,
        usage=UsageBook(write_sessions=ctx.session_factory, clock=ctx.clock),
    )


def wake_service(ctx: AppContext, service_id: str) -> None:
    """A request waits for a service with no warm replica: ask for one (`autoscale.wake`) and
    place it now rather than at the placement loop's next round."""
    with ctx.session_factory.begin() as session:
        asked = autoscale.wake(session=session, clock=ctx.clock, service_id=service_id)
    if asked:
        placement.place_pending(
            session_factory=ctx.session_factory,
            clock=ctx.clock,
            liveness=ctx.liveness,
            free_capacity=free_capacity,
        )
