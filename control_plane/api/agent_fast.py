"""The agents' fast path (HB-4, SC-3): a thin pure-ASGI seam in front of everything that answers
the three requests every node sends all the time — a heartbeat, a work claim, a job's
completion — without FastAPI's routing and dependency injection, when the credential already
verified and is known active and the body is small and one the route's own model accepts.

It is not a second implementation: it validates with the routes' models, calls the same
services (`accept_heartbeat`, `Scheduler.claim`, `Completions.record`) and answers with the
routes' response models; a completion's body passes the same JSON check as every other body
(`edge.check_json`: depth, finite numbers). Anything else (an unknown or revoked credential,
another protocol, a body the model refuses, a body larger than it reads) goes on towards the
FastAPI app — through the edge and the JSON guard — with the original, complete body, so every
other answer still comes from the routes and the one error hierarchy. Refusals that can only
come up here (a completion the job does not take, a claim whose credential was revoked while it
waited) are rendered from the same errors the routes raise.
"""

from __future__ import annotations

import json
import re

from pydantic import ValidationError

from control_plane.api.agent_work import CLOSED, assignment, claim_until_closed, outcome
from control_plane.api.asgi import ASGIApp, Receive, Scope, Send, replay
from control_plane.api.edge import SECURITY_HEADERS, check_json
from control_plane.context import AppContext
from control_plane.errors import ModelForgeError, ProtocolIncompatible
from control_plane.schemas import AgentJobComplete, AgentJobControl, HeartbeatRequest, WorkClaim
from control_plane.services.credentials import NodePrincipal, revoked
from control_plane.services.heartbeats import accept_heartbeat
from control_plane.services.scheduling import PlacedJob

PATH = "/api/v1/agent/heartbeat"
CLAIM_PATH = "/api/v1/agent/work/claim"
_FIXED = frozenset({PATH, CLAIM_PATH})
_COMPLETE = re.compile(r"^/api/v1/agent/jobs/([A-Za-z0-9_-]{1,64})/complete$")
_GONE = (0, b"")
_NOT_CANCELLED = AgentJobControl(cancel=False).model_dump_json().encode()
#: The most this seam reads before it hands the request on; a real heartbeat is ~150 bytes.
FAST_BODY_LIMIT = 16 * 1024
_JSON_TYPES = (b"application/json", b"")


class AgentFastPath:
    """Heartbeats, claims and completions answered here; everything else passed to `app`."""

    def __init__(self, app: ASGIApp, ctx: AppContext) -> None:
        self.app = app
        self.ctx = ctx
        # Requests answered here, by kind (observability and tests).
        self.answered = 0  # heartbeats
        self.claims = 0
        self.completions = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        completing = None if path in _FIXED else _COMPLETE.match(path)
        if path not in _FIXED and completing is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more and size <= FAST_BODY_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away: nobody to answer
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            more = bool(message.get("more_body"))
        body = b"".join(chunks)
        principal = None if more or size > FAST_BODY_LIMIT else self._principal(scope)
        answer: tuple[int, bytes] | None = None
        if principal is not None:
            if path == PATH:
                answer = self._heartbeat(principal.node_id, body)
            elif path == CLAIM_PATH:
                answer = await self._claim(principal, body, receive)
                if answer is _GONE:
                    return  # the agent closed the connection: nobody to answer
            elif completing is not None:
                answer = await self._complete(principal.node_id, completing.group(1), body)
        if answer is None:
            await self.app(scope, replay(body, receive, more=more), send)
            return
        status, reply = answer
        headers = [(b"content-length", str(len(reply)).encode()), *SECURITY_HEADERS]
        if reply:
            headers.insert(0, (b"content-type", b"application/json"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": reply})

    def _principal(self, scope: Scope) -> NodePrincipal | None:
        """The node, when the credential verified before and is known active, and the body is
        declared JSON (or not declared); else None (the routes answer)."""
        authorization = content_type = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"content-type":
                content_type = value
        if authorization is None or authorization[:7].lower() != b"bearer ":
            return None
        if content_type is not None and content_type.split(b";")[0].strip() not in _JSON_TYPES:
            return None
        return self.ctx.authority.cached_active(authorization[7:].decode("latin-1").strip())

    def _heartbeat(self, node_id: str, body: bytes) -> tuple[int, bytes] | None:
        """The encoded response when this heartbeat is certainly accepted, else None."""
        try:
            request = HeartbeatRequest.model_validate_json(body)
            response = accept_heartbeat(
                request,
                node_id=node_id,
                buffer=self.ctx.heartbeats,
                clock=self.ctx.clock,
                settings=self.ctx.settings,
                metrics=self.ctx.metrics,
            )
        except (ValidationError, ProtocolIncompatible):
            return None  # the route refuses it, and records a protocol refusal
        self.answered += 1
        return 200, response.model_dump_json().encode()

    async def _claim(
        self, principal: NodePrincipal, body: bytes, receive: Receive
    ) -> tuple[int, bytes] | None:
        """The claim route's answer: a job, 204, or the refusal of a credential revoked while
        it waited; `_GONE` when the agent (or a balancer's timeout) closed the connection
        first — the claim is withdrawn, and a job placed for it meanwhile goes back to the
        queue."""
        try:
            claim = WorkClaim.model_validate_json(body)
        except ValidationError:
            return None
        authority = self.ctx.authority
        self.claims += 1
        placed = await claim_until_closed(self.ctx, principal, claim.hold_seconds, receive)
        if placed is CLOSED:
            return _GONE
        if not isinstance(placed, PlacedJob):
            if not authority.still_active(principal):
                return _refusal(revoked())
            return 204, b""
        return 200, assignment(self.ctx, placed).model_dump_json().encode()

    async def _complete(self, node_id: str, job_id: str, body: bytes) -> tuple[int, bytes] | None:
        """The completion route's answer, once the outcome is committed."""
        if check_json(body) is not None:
            return None  # the JSON guard refuses it
        try:
            complete = AgentJobComplete.model_validate_json(body)
        except ValidationError:
            return None
        self.completions += 1
        try:
            await self.ctx.completions.record(outcome(job_id, node_id, complete))
        except ModelForgeError as refusal:
            return _refusal(refusal)
        except Exception:  # noqa: BLE001 - its group was not committed: the route tries again
            return None  # and answers (503 while the database is unavailable) as routes do
        return 200, _NOT_CANCELLED


def _refusal(error: ModelForgeError) -> tuple[int, bytes]:
    """The refusal as the routes render it (Starlette's JSONResponse: compact, UTF-8)."""
    body = json.dumps(error.to_body(), ensure_ascii=False, separators=(",", ":"))
    return error.http_status, body.encode()
