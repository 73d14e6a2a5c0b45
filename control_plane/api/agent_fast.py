"""The agents' fast path (HB-4, SC-3): a thin seam in front of everything that answers the three
requests every node sends all the time — a heartbeat, a work claim, a job's completion —
without FastAPI's routing and dependency injection, when the credential already verified and is
known active and the body is small and one the route's own model accepts. The served control
plane puts it straight on Granian's RSGI interface (`api/rsgi.py`); in-process it is the
outermost ASGI app. Either way a request is read and answered through `agent_frame.py`, and
`answer` decides one `agent_frame.Outcome`: a `Reply`, a `HandOn` to the routes, or
`CLIENT_GONE`.

It is not a second implementation: it validates with the routes' models, calls the same
services (`judge_heartbeat` and `record_heartbeat`, which the route calls through
`accept_heartbeat`; `Scheduler.claim`, `Completions.record`) and answers with the routes'
response models (a heartbeat body already judged is answered from memory); a completion's
body passes the same JSON check as every other body (`edge.check_json`: depth, finite
numbers). Anything else (an unknown or revoked credential, another protocol, a body the model
refuses, a body larger than it reads) goes on towards the FastAPI app — through the edge and the
JSON guard — with the original, complete body, so every other answer still comes from the
routes and the one error hierarchy. Refusals that can only come up here (a completion the job
does not take, a claim whose credential was revoked while it waited) are rendered from the same
errors the routes raise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from control_plane.api.agent_frame import (
    CLIENT_GONE,
    HandOn,
    Outcome,
    Reply,
    read_bounded,
)
from control_plane.api.agent_work import assignment, outcome
from control_plane.api.asgi import ASGIApp, Receive, Scope, Send, replay
from control_plane.api.edge import check_json
from control_plane.context import AppContext
from control_plane.errors import ModelForgeError, ProtocolIncompatible
from control_plane.fleet.credentials import NodePrincipal, revoked
from control_plane.fleet.heartbeats import JudgedHeartbeat, judge_heartbeat, record_heartbeat
from control_plane.fleet.schemas import HeartbeatRequest
from control_plane.jobs.schemas import AgentJobComplete, AgentJobControl
from control_plane.scheduling.claims import CLOSED, claim_until_closed
from control_plane.scheduling.placement import PlacedJob
from control_plane.scheduling.schemas import WorkClaim

HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
CLAIM_PATH = "/api/v1/agent/work/claim"
_COMPLETE = re.compile(r"^/api/v1/agent/jobs/([A-Za-z0-9_-]{1,64})/complete$")
#: A completion's answer (the job goes on: not cancelled), and a claim's without work.
_NOT_CANCELLED = Reply(200, AgentJobControl(cancel=False).model_dump_json().encode())
_NO_WORK = Reply(204, b"")
#: Heartbeat bodies judged once and answered from memory after: a node sends the same bytes
#: every time until its health changes, so a fleet has a handful of distinct bodies. Bounded;
#: only small bodies are kept.
_JUDGED_BODY_LIMIT = 1024
_JUDGED_MAX = 256

#: An agent's request this seam may answer: a heartbeat, a claim, or a job's completion (its id).
AgentRequest = tuple[str, str | None]
#: What waits until the client has closed the connection (ASGI `receive` after the body).
WaitClosed = Callable[[], Awaitable[object]]


def agent_request(method: str, path: str) -> AgentRequest | None:
    """Which of the agents' requests `method path` is, if one this seam answers."""
    if method != "POST":
        return None
    if path == HEARTBEAT_PATH or path == CLAIM_PATH:
        return path, None
    completing = _COMPLETE.match(path)
    return None if completing is None else (path, completing.group(1))


class AgentFastPath:
    """Heartbeats, claims and completions answered here; everything else passed to `app`.

    `answer` is the seam itself, in terms of the request's parts; `__call__` puts it in front of
    `app`, the ASGI app behind it (the edge), and `control_plane.api.rsgi.ServedApp` in front of
    Granian's RSGI interface (the served control plane); both frame the request and its
    outcome with `agent_frame`, so both answer alike.
    """

    def __init__(self, app: ASGIApp, ctx: AppContext) -> None:
        self.app = app
        self.ctx = ctx
        self._judged: dict[bytes, tuple[JudgedHeartbeat, Reply]] = {}
        # Requests answered here, by kind (observability and tests): heartbeats accepted; claims
        # and completions taken (some of them end refused).
        self.heartbeats = 0
        self.claims = 0
        self.completions = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = None
        if scope["type"] == "http":
            request = agent_request(scope["method"], scope["path"])
        if request is None:
            await self.app(scope, receive, send)
            return
        read = await read_bounded(receive)
        outcome: Outcome
        if isinstance(read, bytes):  # complete, within the limit
            authorization = content_type = None
            for name, value in scope["headers"]:  # the first of each, as the routes read them
                if name == b"authorization" and authorization is None:
                    authorization = value.decode("latin-1")
                elif name == b"content-type" and content_type is None:
                    content_type = value.decode("latin-1")
            outcome = await self.answer(request, authorization, content_type, read, receive)
        else:
            outcome = read  # handed on, or the client gone
        if isinstance(outcome, Reply):
            await outcome.send_asgi(send)
        elif isinstance(outcome, HandOn):
            await self.app(scope, replay(outcome.body, receive, more=outcome.more), send)

    async def answer(
        self,
        request: AgentRequest,
        authorization: str | None,
        content_type: str | None,
        body: bytes,
        closed: WaitClosed,
    ) -> Outcome:
        """The `Reply` to answer with; `CLIENT_GONE` when the agent closed the connection
        first; the `HandOn` of `body` when the routes must answer. `body` is complete; `closed`
        is awaited only after it was read."""
        principal = self._principal(authorization, content_type)
        if principal is None:
            return HandOn(body)
        path, job_id = request
        if path == HEARTBEAT_PATH:
            return self._heartbeat(principal.node_id, body)
        if job_id is None:
            return await self._claim(principal, body, closed)
        return await self._complete(principal.node_id, job_id, body)

    def _principal(
        self, authorization: str | None, content_type: str | None
    ) -> NodePrincipal | None:
        """The node, when the credential verified before and is known active, and the body is
        declared JSON (as the routes require); else None (the routes answer)."""
        if authorization is None or authorization[:7].lower() != "bearer ":
            return None
        if content_type is None or content_type.split(";")[0].strip().lower() != "application/json":
            return None
        return self.ctx.authority.cached_active(authorization[7:].strip())

    def _heartbeat(self, node_id: str, body: bytes) -> Reply | HandOn:
        """The encoded response when this heartbeat is certainly accepted, else the routes'."""
        known = self._judged.get(body)
        if known is None:
            try:
                request = HeartbeatRequest.model_validate_json(body)
                judged = judge_heartbeat(request, settings=self.ctx.settings)
            except (ValidationError, ProtocolIncompatible):
                return HandOn(body)  # the route refuses it, and records a protocol refusal
            known = judged, Reply(200, judged.response.model_dump_json().encode())
            if len(body) <= _JUDGED_BODY_LIMIT:
                if len(self._judged) >= _JUDGED_MAX:
                    self._judged.clear()
                self._judged[body] = known
        judged, reply = known
        ctx = self.ctx
        record_heartbeat(
            judged, node_id=node_id, buffer=ctx.heartbeats, clock=ctx.clock, metrics=ctx.metrics
        )
        self.heartbeats += 1
        return reply

    async def _claim(self, principal: NodePrincipal, body: bytes, closed: WaitClosed) -> Outcome:
        """The claim route's answer: a job, 204, or the refusal of a credential revoked while
        it waited; `CLIENT_GONE` when the agent (or a balancer's timeout) closed the connection
        first — the claim is withdrawn, and a job placed for it meanwhile goes back to the
        queue."""
        try:
            claim = WorkClaim.model_validate_json(body)
        except ValidationError:
            return HandOn(body)
        authority = self.ctx.authority
        self.claims += 1
        placed = await claim_until_closed(
            scheduler=self.ctx.scheduler,
            authority=authority,
            completions=self.ctx.completions,
            node=principal,
            hold=claim.hold_seconds,
            closed=closed,
        )
        if placed is CLOSED:
            return CLIENT_GONE
        if not isinstance(placed, PlacedJob):
            if not authority.still_active(principal):
                return _refusal(revoked())
            return _NO_WORK
        return Reply(200, assignment(self.ctx, placed).model_dump_json().encode())

    async def _complete(self, node_id: str, job_id: str, body: bytes) -> Reply | HandOn:
        """The completion route's answer, once the outcome is committed."""
        if check_json(body) is not None:
            return HandOn(body)  # the JSON guard refuses it
        try:
            complete = AgentJobComplete.model_validate_json(body)
        except ValidationError:
            return HandOn(body)
        self.completions += 1
        try:
            await self.ctx.completions.record(outcome(job_id, node_id, complete))
        except ModelForgeError as refusal:
            return _refusal(refusal)
        except Exception:  # noqa: BLE001 - its group was not committed: the route tries again
            return HandOn(body)  # and answers (503 while the database is unavailable) as routes do
        return _NOT_CANCELLED


def _refusal(error: ModelForgeError) -> Reply:
    """The refusal as the routes render it (Starlette's JSONResponse: compact, UTF-8)."""
    body = json.dumps(error.to_body(), ensure_ascii=False, separators=(",", ":"))
    return Reply(error.http_status, body.encode())
