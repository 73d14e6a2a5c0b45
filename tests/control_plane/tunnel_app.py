"""The real control plane (`create_front`, served on RSGI by a real Granian process) with one
test door into its `TunnelHub`, standing in for the gateway: `ANY /_tunnel/{node}/{replica}/
{path}` is carried through `hub.open_stream` as a gateway would carry it (the request body
streamed out as it arrives, the answer streamed back), and `GET /_tunnel_stats` says which
nodes' tunnels the hub holds and the most one stream held of an answer's body. A request with
`x-test-read-delay: <seconds>` has its answer read that slowly (per piece), to show the
windows hold the hub's memory. Everything else is the served control plane, unchanged.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from control_plane.api.asgi import Receive, Scope, Send
from control_plane.api.rsgi import serve_asgi
from control_plane.app import create_front
from control_plane.gateway.tunnels import StreamReset, TunnelHub, TunnelUnavailable
from modelforge_contracts.tunnel import OpenRequest

_PREFIX = "/_tunnel/"


class TunnelDoor:
    def __init__(self) -> None:
        front = create_front()
        self.served = front.served()
        self.hub: TunnelHub = front.routes.state.ctx.hub
        self.peak = 0
        self.resets: list[str] = []

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.served.__rsgi_init__(loop)

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.served.__rsgi_del__(loop)

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        if scope.proto == "http" and scope.path == "/_tunnel_stats":
            body = {"nodes": self.hub.nodes(), "peak": self.peak, "resets": self.resets}
            protocol.response_bytes(
                200, [("content-type", "application/json")], json.dumps(body).encode()
            )
            return
        if scope.proto == "http" and scope.path.startswith(_PREFIX):
            await serve_asgi(self._through, scope, protocol, self.served.lifespan.state)
            return
        await self.served.__rsgi__(scope, protocol)

    async def _through(self, scope: Scope, receive: Receive, send: Send) -> None:
        node_id, replica_id, rest = scope["path"][len(_PREFIX) :].split("/", 2)
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]]
        delay = float(dict(headers).get("x-test-read-delay", "0"))
        try:
            request = OpenRequest(
                replica_id, scope["method"], "/" + rest, scope["query_string"].decode(), headers
            )
            stream = await self.hub.open_stream(node_id, request)
        except TunnelUnavailable:
            await _answer(send, 503, b"no tunnel")
            return
        except StreamReset as exc:
            self.resets.append(exc.code)
            await _answer(send, 502, exc.code.encode())
            return

        async def upload() -> None:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    await stream.reset()
                    return
                if message.get("body"):
                    await stream.send(message["body"])
                if not message.get("more_body"):
                    await stream.end()
                    break
            # What comes next is the client going away: the stream is reset then.
            await receive()
            await stream.reset()

        uploading = asyncio.ensure_future(upload())
        try:
            status, answer_headers = await stream.response()
        except StreamReset as exc:
            uploading.cancel()
            self.resets.append(exc.code)
            await _answer(send, 502, exc.code.encode())
            return
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(k.encode(), v.encode()) for k, v in answer_headers],
            }
        )
        try:
            async for chunk in stream.body():
                self.peak = max(self.peak, stream.peak_buffered)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if delay:
                    await asyncio.sleep(delay)
        except StreamReset as exc:
            self.resets.append(exc.code)
        await send({"type": "http.response.body", "body": b""})
        uploading.cancel()


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body})


def create() -> TunnelDoor:
    return TunnelDoor()
