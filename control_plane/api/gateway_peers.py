"""The holder's side of forwarding between control-plane replicas (issue 27): the internal route
`/api/v1/internal/gateway/{node_id}/{replica_id}{path}`, where another replica's gateway sends
a request for a node whose tunnel this process holds (`gateway/peers.py` has the other side).

A seam just behind the gateway, in front of the edge (the edge's limits are the API's; this
route is bounded as the gateway is: `body_limit`, `body_timeout`). It answers only a request
signed with the replicas' shared key for this process, within its window, with a nonce it has
not seen (`peer_signature.verify_request`), and passes on only the headers signed; anything
else is refused with its code (`PEER_SIGNATURE_INVALID`, `PEER_SIGNATURE_EXPIRED`,
`PEER_NONCE_REPLAYED`: 401; 404 while this process has no key) before any replica is asked.
The body is checked frame by frame as it comes, its first frame before the stream to the
replica opens (`PEER_BODY_INVALID`, 401; a frame failing later resets the replica's stream, so
it never gets a whole request). It never forwards again: a stream it cannot open here (the
tunnel gone since the caller read who holds it), or a request signed for another process
(`PEER_WRONG_HOLDER`, 421), is answered with `FAILURE_HEADER`, which the caller takes for a
transport failure and may retry elsewhere.
The client's token was checked by the forwarding replica; none reaches here or the replica.
No `x-modelforge-...` header passes between here and the replica either way
(`gateway_forward.crossing`): a replica answering with `FAILURE_HEADER` cannot pass for this
process failing (the forwarding replica would retry the request elsewhere).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from control_plane.api.asgi import ASGIApp, Message, Receive, Scope, Send
from control_plane.api.gateway_forward import (
    BodyTooLarge,
    ClientGone,
    ClientTimeout,
    Exchange,
    Outbound,
    RequestBody,
    TransportFailed,
    crossing,
    finish,
    open_exchange,
    received_path,
    relay_response,
)
from control_plane.clock import Clock
from control_plane.gateway.peer_signature import (
    FAILURE_HEADER,
    BodyCheck,
    NonceStore,
    PeerRefused,
    verify_request,
)
from control_plane.gateway.peers import PEER_PREFIX
from control_plane.gateway.tunnels import StreamOpener, TunnelHub

_JSON = (b"content-type", b"application/json")


class _HeldHere:
    """The hub as an opener that never forwards to a peer (no request goes round in circles)."""

    peers: StreamOpener | None = None

    def __init__(self, hub: TunnelHub) -> None:
        self.open_stream = hub.open_stream


class PeerRoute:
    """The internal route in front of `app` (see the module's docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        hub: TunnelHub,
        key: Callable[[], bytes | None],
        clock: Clock,
        body_limit: int,
        body_timeout: float,
    ) -> None:
        self.app = app
        self.hub = hub
        #: Returns the replicas' shared key (None until this process has read it).
        self.key = key
        self.clock = clock
        self.body_limit = body_limit
        self.body_timeout = body_timeout
        #: The nonces this process accepted (a request is signed for one process).
        self.nonces = NonceStore()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PEER_PREFIX):
            await self.app(scope, receive, send)
            return
        await self._serve(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.key()
        path: str = scope["path"]  # signed decoded: what every server can give
        # The replica's path as the forwarding replica sent it (percent-encoded).
        received = received_path(scope)
        node_id, _, rest = received.removeprefix(PEER_PREFIX).partition("/")
        replica_id, slash, tail = rest.partition("/")
        well_formed = received.startswith(PEER_PREFIX) and node_id and replica_id and slash
        if key is None or not well_formed:
            await _answer(send, 404, "not found")
            return
        method: str = scope["method"]
        query = scope.get("query_string", b"").decode("latin-1")
        headers = [
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]
        ]
        record = self.hub.record
        try:
            verified = verify_request(
                key,
                method=method,
                path=path,
                query=query,
                headers=headers,
                holder=record.holder if record is not None else "",
                now=self.clock.now().timestamp(),
                nonces=self.nonces,
            )
        except PeerRefused as refused:
            await _refuse(send, refused)
            return
        forwarded = [(name, value) for name, value in verified.headers if crossing(name)]
        declared = verified.body.declared  # the body is held to it (`BodyCheck`)
        if declared is not None:
            forwarded.append(("content-length", str(declared)))
        outbound = Outbound(method, "/" + tail, query, forwarded, declared)
        if outbound.oversized(len(replica_id)) is not None:  # the caller's own answer: no retry
            await _answer(send, 431, "the request's head is too large for the node's tunnel")
            return
        checked = _CheckedBody(receive, verified.body)
        try:  # the first frame checked before the replica is asked for anything
            await asyncio.wait_for(checked.first(), self.body_timeout)
        except PeerRefused as refused:
            await _refuse(send, refused)
            return
        except TimeoutError:
            await _answer(send, 408, "the request body stopped arriving")
            return
        receive = checked.receive
        body = RequestBody(
            receive,
            limit=self.body_limit,
            timeout=self.body_timeout,
            retry_bytes=0,
            expected=declared,
        )
        exchange: Exchange | None = None
        try:
            exchange = await open_exchange(
                _HeldHere(self.hub), node_id=node_id, request=outbound.to(replica_id), body=body
            )
        except TransportFailed as failed:
            if checked.refused is not None:  # a frame failed: the replica's stream was reset
                await _refuse(send, checked.refused)
                return
            extra = [(FAILURE_HEADER.encode(), failed.cause.encode("latin-1", "replace"))]
            await _answer(send, 502, "the node's tunnel is not held here", extra)
            return
        except ClientTimeout:
            await _answer(send, 408, "the request body stopped arriving")
            return
        except BodyTooLarge:
            await _answer(send, 413, "the request body is too large")
            return
        except ClientGone:
            return
        finally:
            if exchange is None:
                body.close()
        try:
            # The forwarding replica adds the security headers to what its client gets.
            await relay_response(exchange, send, (), body=body)
        finally:
            body.close()  # only now: the body may still be on its way to a replica that answered
            if exchange.pump.done():
                await finish(exchange.pump)


class _CheckedBody:
    """The peer request's body as the client's: each frame checked before its payload is
    given (`BodyCheck`); `refused` holds the failure once one did."""

    def __init__(self, receive: Receive, check: BodyCheck) -> None:
        self._receive, self._check = receive, check
        self._first: Message | None = None
        self.refused: PeerRefused | None = None

    async def first(self) -> None:
        self._first = await self._next()

    async def receive(self) -> Message:
        if self._first is not None:
            message, self._first = self._first, None
            return message
        return await self._next()

    async def _next(self) -> Message:
        try:
            while True:
                message = await self._receive()
                if message["type"] != "http.request":
                    return message
                payload = self._check.feed(bytes(message.get("body", b"")))
                if not message.get("more_body"):
                    self._check.finish()  # refused unless the last frame came
                if self._check.ended or payload:
                    more = not self._check.ended
                    return {"type": "http.request", "body": payload, "more_body": more}
        except PeerRefused as refused:
            self.refused = refused
            raise


async def _refuse(send: Send, refused: PeerRefused) -> None:
    extra = [(FAILURE_HEADER.encode(), refused.code.encode())] if refused.transport else []
    await _answer(send, refused.status, refused.message, extra, code=refused.code)


async def _answer(
    send: Send,
    status: int,
    message: str,
    extra: list[tuple[bytes, bytes]] | None = None,
    *,
    code: str = "",
) -> None:
    data = json.dumps({"error": {"code": code or _CODES[status], "message": message}}).encode()
    headers = [_JSON, (b"content-length", str(len(data)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


#: The code of each answer that is not a `PeerRefused`.
_CODES = {
    404: "NOT_FOUND",
    408: "BODY_TIMEOUT",
    413: "BODY_TOO_LARGE",
    431: "HEAD_TOO_LARGE",
    502: "PEER_TUNNEL_NOT_HELD",
}
