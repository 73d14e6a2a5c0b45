"""The served stack, composed in one place: what a request meets, outermost first.

- `ServedApp` (`rsgi.py`): what Granian serves on its RSGI interface. It answers the agents'
  requests through the fast path straight from RSGI's protocol object and serves everything
  else with the ASGI app below through its bridge; it runs the ASGI lifespan.
- `AgentFastPath` (`agent_fast.py`): the outermost ASGI app (what the tests' in-process client
  calls). It answers heartbeats, claims and completions it is sure of, and hands anything else
  on, body intact, to the edge.
- `Edge` (`edge.py`): body limits, the query check, the security headers.
- `JsonGuard` (`edge.py`): too deep, non-finite or malformed JSON refused.
- the FastAPI app (`app.py`): the routes and the one mapping of errors to HTTP.

Each layer is a named attribute of `Front`, so nothing reaches one through another's `.app`
(each seam's `.app` is only the next app it calls, as ASGI middleware has it). It builds
nothing but the layers: the routes and the context come from `app.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from control_plane.api.agent_fast import AgentFastPath
from control_plane.api.edge import Edge, JsonGuard
from control_plane.api.rsgi import ServedApp
from control_plane.context import AppContext


@dataclass(frozen=True)
class Front:
    """The control plane's served layers, outermost first (see the module's docstring)."""

    agent_fast: AgentFastPath
    edge: Edge
    json_guard: JsonGuard
    routes: FastAPI

    @property
    def asgi(self) -> AgentFastPath:
        """The outermost ASGI app: what an in-process ASGI client serves."""
        return self.agent_fast

    def served(self) -> ServedApp:
        """The RSGI app Granian serves: the fast path on RSGI, in front of the ASGI app."""
        return ServedApp(self.agent_fast, self.edge)


def compose_front(routes: FastAPI, ctx: AppContext) -> Front:
    """Put the seams in front of the FastAPI app `routes`; `ctx` is the running context."""
    json_guard = JsonGuard(routes)
    edge = Edge(json_guard, ctx)
    return Front(
        agent_fast=AgentFastPath(edge, ctx), edge=edge, json_guard=json_guard, routes=routes
    )
