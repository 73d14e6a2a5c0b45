"""The agents' tunnel (issue 27): `GET /api/v1/agent/tunnel`, a WebSocket an agent opens with
its node credential (`Authorization: Bearer`, as its other calls). Without a valid credential
the upgrade is refused 401 with the usual error body (where the server can send one; else the
WebSocket is closed with 1008); with one, the socket is handed to the process's `TunnelHub`
(`gateway/tunnels.py`), which holds it until it closes or the credential is revoked or
expires. The frames are `modelforge_contracts.tunnel`'s; this module only adapts the socket.
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketDisconnect

from control_plane.api.deps import require_node
from control_plane.api.routing import LaneRoute
from control_plane.context import AppContext
from control_plane.errors import ModelForgeError
from modelforge_contracts.tunnel import TUNNEL_PATH

router = APIRouter(tags=["agent"], route_class=LaneRoute)
_POLICY_VIOLATION = 1008


class _StarletteSocket:
    """A Starlette `WebSocket` as the hub's `TunnelSocket`."""

    def __init__(self, websocket: WebSocket) -> None:
        self._websocket = websocket

    async def send(self, message: bytes) -> None:
        await self._websocket.send_bytes(message)

    async def receive(self) -> bytes | None:
        while True:
            try:
                message = await self._websocket.receive()
            except (WebSocketDisconnect, RuntimeError):
                return None
            if message["type"] == "websocket.disconnect":
                return None
            data = message.get("bytes")
            if data is not None:
                return bytes(data)
            # A text message is not a frame: an empty message fails the frame check.
            return b""

    async def close(self, code: int, reason: str) -> None:
        await self._websocket.close(code=code, reason=reason)


@router.websocket(TUNNEL_PATH)
async def agent_tunnel(websocket: WebSocket) -> None:
    """Hold one agent's tunnel until it ends."""
    ctx: AppContext = websocket.app.state.ctx
    try:
        principal = await require_node(ctx, websocket.headers.get("authorization"))
    except ModelForgeError as refusal:  # no credential, a bad one, the database away
        if "websocket.http.response" in websocket.scope.get("extensions", {}):
            await websocket.send_denial_response(
                JSONResponse(
                    status_code=refusal.http_status,
                    content=refusal.to_body(),
                    headers=refusal.response_headers(),
                )
            )
        else:
            await websocket.close(code=_POLICY_VIOLATION, reason=refusal.code)
        return
    await websocket.accept()
    await ctx.hub.serve(
        principal.node_id,
        _StarletteSocket(websocket),
        still_active=lambda: ctx.authority.still_active(principal),
        expired=lambda: ctx.authority.has_expired(principal),
    )
