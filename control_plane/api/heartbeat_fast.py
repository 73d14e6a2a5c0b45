"""The heartbeat fast path (HB-4): a thin pure-ASGI seam in front of the FastAPI app, just inside
the edge (which bounds the body), that answers the common heartbeat — a credential already
verified and known active, a body the route's own `HeartbeatRequest` model accepts, a protocol
in range — without FastAPI's routing and dependency injection.

It is not a second implementation: it validates with the route's model, calls the same service
function (`accept_heartbeat`) and answers with the route's response model. Anything else (an
unknown or revoked credential, another protocol, a body the model refuses, a body larger than
it reads) goes on towards the FastAPI app — through the JSON guard, which reads the body this
seam parsed only when the seam could not answer — with the original, complete body, so every
refusal still comes from the one error hierarchy.
"""

from __future__ import annotations

from pydantic import ValidationError

from control_plane.api.asgi import ASGIApp, Receive, Scope, Send, replay
from control_plane.api.edge import SECURITY_HEADERS
from control_plane.context import AppContext
from control_plane.errors import ProtocolIncompatible
from control_plane.schemas import HeartbeatRequest
from control_plane.services.heartbeats import accept_heartbeat

PATH = "/api/v1/agent/heartbeat"
#: The most this seam reads before it hands the request on; a real heartbeat is ~150 bytes.
FAST_BODY_LIMIT = 16 * 1024
_JSON_TYPES = (b"application/json", b"")


class HeartbeatFastPath:
    """Heartbeats answered here, everything else passed to `app` (the JSON guard)."""

    def __init__(self, app: ASGIApp, ctx: AppContext) -> None:
        self.app = app
        self.ctx = ctx
        self.answered = 0  # heartbeats answered here (observability and tests)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != PATH:
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
        complete = not more and size <= FAST_BODY_LIMIT
        reply = self._answer(scope, b"".join(chunks)) if complete else None
        if reply is None:
            await self.app(scope, replay(b"".join(chunks), receive, more=more), send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(reply)).encode()),
                    *SECURITY_HEADERS,
                ],
            }
        )
        await send({"type": "http.response.body", "body": reply})

    def _answer(self, scope: Scope, body: bytes) -> bytes | None:
        """The encoded response when this heartbeat is certainly accepted, else None."""
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
        principal = self.ctx.authority.cached_active(authorization[7:].decode("latin-1").strip())
        if principal is None:
            return None
        try:
            request = HeartbeatRequest.model_validate_json(body)
            response = accept_heartbeat(
                request,
                node_id=principal.node_id,
                buffer=self.ctx.heartbeats,
                clock=self.ctx.clock,
                settings=self.ctx.settings,
            )
        except (ValidationError, ProtocolIncompatible):
            return None  # the route refuses it, and records a protocol refusal
        self.answered += 1
        return response.model_dump_json().encode()
