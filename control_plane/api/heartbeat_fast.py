"""The heartbeat fast path (HB-4): a thin ASGI layer that answers the common heartbeat —
a credential already verified and known active, protocol accepted, a well-formed body — without
going through FastAPI's routing, dependency injection and model validation.

It is an optimisation, not a second implementation: it accepts exactly what the
`POST /api/v1/agent/heartbeat` route accepts and answers exactly what it answers. Anything else
(an unknown or revoked credential, another protocol, any doubt about the body) is handed to the
FastAPI route unchanged, so every refusal still comes from the one error hierarchy.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from control_plane import PROTOCOL_MAX, PROTOCOL_MIN
from control_plane.context import AppContext
from control_plane.services.heartbeats import PendingHeartbeat

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PATH = "/api/v1/agent/heartbeat"
_MAX_BODY = 4096
_STATUSES = frozenset({"healthy", "degraded", "unhealthy"})
_PREFLIGHTS = frozenset({"passed", "failed", "not_run"})


def _text(value: Any, limit: int, *, minimum: int = 0) -> bool:
    return isinstance(value, str) and minimum <= len(value) <= limit and "\x00" not in value


def accepted_heartbeat(body: bytes) -> tuple[str, int, dict[str, Any]] | None:
    """(agent_version, protocol, health) when the body is certainly valid and compatible."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.keys() != {"protocol_version", "agent_version", "health"}:
        return None
    protocol, version, health = data["protocol_version"], data["agent_version"], data["health"]
    if type(protocol) is not int or not PROTOCOL_MIN <= protocol <= PROTOCOL_MAX:
        return None
    if not _text(version, 64, minimum=1) or not isinstance(health, dict):
        return None
    if not health.keys() <= {"status", "preflight", "message"} or not health.keys() >= {
        "status",
        "preflight",
    }:
        return None
    if health["status"] not in _STATUSES or health["preflight"] not in _PREFLIGHTS:
        return None
    message = health.get("message")
    if message is None:
        health.pop("message", None)
    elif not _text(message, 500):
        return None
    return version, protocol, health


class HeartbeatFastPath:
    def __init__(self, app: ASGIApp, ctx: AppContext) -> None:
        self.app = app
        self.ctx = ctx
        self.answered = 0  # heartbeats answered here (observability and tests)
        self._reply: bytes | None = None

    def _response(self) -> bytes:
        if self._reply is None:
            settings = self.ctx.settings
            self._reply = json.dumps(
                {
                    "heartbeat_interval_seconds": settings.heartbeat_interval_seconds,
                    "telemetry_interval_seconds": settings.telemetry_interval_seconds,
                    "compatibility": {
                        "status": "compatible",
                        "protocol_version": PROTOCOL_MAX,
                        "accepted": list(range(PROTOCOL_MIN, PROTOCOL_MAX + 1)),
                    },
                },
                separators=(",", ":"),
            ).encode()
        return self._reply

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body") or size > _MAX_BODY:
                break
        body = b"".join(chunks)
        if size <= _MAX_BODY and self._answer(scope, body):
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(self._response())).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": self._response()})
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _answer(self, scope: Scope, body: bytes) -> bool:
        authorization = next(
            (value for name, value in scope["headers"] if name == b"authorization"), None
        )
        if authorization is None or not authorization[:7].lower() == b"bearer ":
            return False
        principal = self.ctx.authority.cached_active(authorization[7:].decode("latin-1").strip())
        accepted = accepted_heartbeat(body) if principal is not None else None
        if principal is None or accepted is None:
            return False
        version, protocol, health = accepted
        self.ctx.heartbeats.record(
            principal.node_id,
            PendingHeartbeat(
                at=self.ctx.clock.now(),
                agent_version=version,
                protocol_version=protocol,
                health=health,
            ),
        )
        self.answered += 1
        return True
