"""A WebSocket on Granian's RSGI interface, served by an ASGI app with ASGI's semantics (issue
27: the agents' tunnels). `rsgi.ServedApp` hands every `ws` scope here.

ASGI's messages map onto RSGI's protocol object: `websocket.connect` first; `websocket.accept`
accepts (RSGI's `accept()`, its transport from then on); `websocket.receive` and
`websocket.send` carry bytes or text; `websocket.close` closes with its code, and before the
accept refuses the upgrade (RSGI's `close` then takes an HTTP status: 403). The denial
response extension (`websocket.http.response`) is offered so an app can refuse with its own
status (a 401); RSGI sends the status only, never the body.
"""

from __future__ import annotations

import logging
from typing import Any

from control_plane.api.asgi import ASGIApp, Message

log = logging.getLogger(__name__)

_ASGI = {"version": "3.0", "spec_version": "2.3"}
_REFUSED = 403
_NORMAL = 1000
_SERVER_ERROR = 1011


class WebsocketClosed(OSError):
    """A send on a WebSocket that has closed (what an ASGI server raises then)."""


async def serve_websocket(
    app: ASGIApp, scope: Any, protocol: Any, state: dict[str, Any], address: Any
) -> None:
    """Serve one RSGI WebSocket with the ASGI `app`; `address` parses RSGI's client/server."""
    exchange = _WebsocketExchange(protocol)
    try:
        await app(_scope(scope, state, address), exchange.receive, exchange.send)
    except Exception as exc:
        if not isinstance(exc, WebsocketClosed):
            log.error("unexpected %s while serving a WebSocket", type(exc).__name__, exc_info=exc)
        exchange.finish(failed=True)
        return
    exchange.finish(failed=False)


def _scope(scope: Any, state: dict[str, Any], address: Any) -> dict[str, Any]:
    return {
        "type": "websocket",
        "asgi": _ASGI,
        "http_version": scope.http_version,
        "scheme": "wss" if scope.scheme in ("https", "wss") else "ws",
        "path": scope.path,
        "raw_path": scope.path.encode(),
        "query_string": scope.query_string.encode(),
        "root_path": "",
        "headers": [(name.encode(), value.encode()) for name, value in scope.headers.items()],
        "client": address(scope.client),
        "server": address(scope.server),
        "subprotocols": [],
        "state": state.copy(),
        "extensions": {"websocket.http.response": {}},
    }


class _WebsocketExchange:
    """ASGI's `receive` and `send` for one RSGI WebSocket."""

    def __init__(self, protocol: Any) -> None:
        self._protocol = protocol
        self._connected = False
        self._transport: Any = None
        self._closed = False
        self._denial_status: int | None = None

    async def receive(self) -> Message:
        if not self._connected:
            self._connected = True
            return {"type": "websocket.connect"}
        if self._transport is None or self._closed:
            self._closed = True
            return {"type": "websocket.disconnect", "code": 1006}
        try:
            message = await self._transport.receive()
        except RuntimeError:  # RSGIProtocolClosed
            self._closed = True
            return {"type": "websocket.disconnect", "code": 1006}
        kind = int(message.kind)
        if kind == 1:
            return {"type": "websocket.receive", "bytes": bytes(message.data)}
        if kind == 2:
            return {"type": "websocket.receive", "text": str(message.data)}
        self._closed = True
        return {"type": "websocket.disconnect", "code": getattr(message, "code", _NORMAL)}

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "websocket.accept":
            self._transport = await self._protocol.accept()
            return
        if kind == "websocket.http.response.start":
            self._denial_status = int(message["status"])
            return
        if kind == "websocket.http.response.body":
            if not message.get("more_body") and not self._closed:
                self._closed = True
                self._protocol.close(self._denial_status or _REFUSED)
            return
        if kind == "websocket.close":
            if not self._closed:
                self._closed = True
                code = message.get("code", _NORMAL)
                self._protocol.close(code if self._transport is not None else _REFUSED)
            return
        if kind != "websocket.send":
            return
        if self._closed or self._transport is None:
            raise WebsocketClosed("the WebSocket has closed")
        try:
            data = message.get("bytes")
            if data is not None:
                await self._transport.send_bytes(bytes(data))
            else:
                await self._transport.send_str(str(message.get("text", "")))
        except RuntimeError:  # RSGIProtocolClosed: the peer has gone
            self._closed = True
            raise WebsocketClosed("the WebSocket has closed") from None

    def finish(self, *, failed: bool) -> None:
        """After the app returned: a WebSocket it left open is closed."""
        if self._closed:
            return
        self._closed = True
        if self._transport is None:
            self._protocol.close(_REFUSED)
        else:
            self._protocol.close(_SERVER_ERROR if failed else _NORMAL)
