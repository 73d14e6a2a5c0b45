"""How the gateway carries one request to a replica and its response back (`gateway.py` decides
which service and whether; this module, how).

- The request body is read from the client a chunk at a time, each within `body_timeout`
  seconds (else `ClientTimeout`: 408), counted against `body_limit` (else `BodyTooLarge`: 413),
  and sent on as it arrives, at the pace the tunnel's window allows (`Stream.send` waits).
- What was read is kept for a second attempt only up to `retry_bytes`; past it the request can
  no longer be retried (`RequestBody.replayable`).
- A node whose tunnel another control-plane process holds is reached through that process
  (`opener.peers`, `gateway/peers.py`): its stream has the same shape, so all that follows holds
  for it too.
- A transport failure before the response started (no tunnel to the node, the stream reset, the
  node refused the connection, the holding process gone) is `TransportFailed`: the caller
  may try another replica once. After the response started nothing is retried: a failure
  then ends the response short (`ResponseBroken`, which makes the HTTP server drop the
  connection, so the client cannot take a cut body for a whole one).
- The response body goes to the client as it comes, each chunk sent before the next is taken
  from the tunnel, so a slow client slows the replica, never fills memory.
- A replica's path is the one the client sent, still percent-encoded (`received_path`), so
  `%3F`, `%23` and `%25` mean at the replica what they meant to the client. No header named
  `x-modelforge-...` crosses in either direction (`INTERNAL_HEADER`): those are the control
  plane's own (the admin token, the replicas' signatures, a holder's transport failure), so a
  replica can neither read one nor make the gateway retry by sending one. Neither side's
  framing crosses (`Content-Length`, `Transfer-Encoding`), nor a replica's cookies or
  `Clear-Site-Data` (`DROPPED_RESPONSE_HEADERS`; the request's rules: `gateway_headers.py`),
  but for an answer with no body for it to frame (to HEAD, or a 304): the replica's one
  `Content-Length`, digits only, crosses then (`_passed_length`).

It never logs a request's data, its headers or a token.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

from control_plane.api.asgi import Message, Receive, Scope, Send
from control_plane.gateway.tunnels import StreamOpener, TunnelUnavailable
from modelforge_contracts.tunnel import (
    HOP_BY_HOP,
    MAX_OPEN,
    MAX_PAYLOAD,
    Headers,
    OpenRequest,
    TunnelProtocolError,
)

#: Request headers never sent on to a replica: the token (the replica must never see one),
#: those of one HTTP hop, and the client's framing (the gateway passes the length it checked,
#: `Outbound`; the agent's relay frames the replica's request by the bytes that come).
DROPPED_REQUEST_HEADERS = HOP_BY_HOP | {"authorization", "cookie", "content-length"}
#: Response headers never sent on to the client: those of one hop, the replica's framing (the
#: HTTP server frames the answer by its real body), and what would act on the control plane's
#: origin (cookies, `Clear-Site-Data`).
DROPPED_RESPONSE_HEADERS = HOP_BY_HOP | {
    "content-length",
    "set-cookie",
    "set-cookie2",
    "clear-site-data",
}
#: The control plane's own headers start so: none crosses between a client and a replica.
INTERNAL_HEADER = "x-modelforge-"
#: What a path may hold unencoded (RFC 3986's `pchar`, and `/`); everything else is encoded.
_PATH_SAFE = "/:@!$&'()*+,;=~"
#: The most a character grows to in the OPEN frame's JSON (`\u00e9` for one byte).
_JSON_GROWTH = 6
#: The OPEN frame's JSON without its values, per header pair, and a replica's id, at most.
_OPEN_FRAME = 128
_OPEN_PAIR = 8


def received_path(scope: Scope) -> str:
    """The request's path as the client sent it, percent-encoded.

    ASGI's `raw_path` where the server gives one. Granian's RSGI interface, which serves the
    control plane (`api/rsgi.py`), gives only the path decoded (and no raw form at all), so
    there it is encoded again: `?`, `#`, `%`, spaces and the rest come back as the client
    encoded them, but an encoded slash (`%2F`) cannot be told from `/` any more."""
    raw = scope.get("raw_path")
    if raw:
        return bytes(raw).decode("latin-1").partition("?")[0]
    return quote(scope["path"], safe=_PATH_SAFE)


def encode_segment(text: str) -> str:
    """`text` as one path segment (a `/` in it encoded)."""
    return quote(text, safe=_PATH_SAFE.replace("/", ""))


def crossing(name: str) -> bool:
    """Whether a header named `name` (lower case) may pass between a client and a replica."""
    return name not in DROPPED_REQUEST_HEADERS and not name.startswith(INTERNAL_HEADER)


class Stream(Protocol):
    """One request's stream through a node's tunnel (`gateway.tunnels`)."""

    async def send(self, data: bytes) -> None: ...

    def end(self) -> Any: ...

    async def response(self) -> tuple[int, Sequence[Sequence[str]]]: ...

    def body(self) -> AsyncIterator[bytes]: ...

    def reset(self, code: str, message: str) -> Any: ...


class Opener(Protocol):
    """What opens a stream to a replica: the tunnel hub (`gateway.tunnels.TunnelHub`), with
    `peers` for a node whose tunnel another process holds (None: this process alone)."""

    async def open_stream(
        self, node_id: str, request: OpenRequest, *, body: bytes | None = None
    ) -> Stream: ...

    @property
    def peers(self) -> StreamOpener | None: ...


@dataclass(frozen=True)
class Outbound:
    """What the gateway sends on to whichever replica it picks: the method, the path there,
    the query and the headers (those that `crossing` lets through)."""

    method: str
    path: str
    query: str
    headers: Headers
    #: The request body's declared length (0 for a request that declares none and is not
    #: chunked), None when unknown: `RequestBody.expected`.
    expected: int | None = None

    def to(self, replica_id: str) -> OpenRequest:
        return OpenRequest(replica_id, self.method, self.path, self.query, self.headers)

    def oversized(self, replica_id_length: int) -> str | None:
        """What makes this request's OPEN frame pass `MAX_OPEN` bytes once JSON-encoded
        (`"headers"`, else `"target"`: the path and query), or None when it fits, for a replica
        id of up to `replica_id_length` characters. Encoded only when it might not fit."""
        raw = len(self.method) + len(self.path) + len(self.query) + replica_id_length
        raw += sum(len(name) + len(value) for name, value in self.headers)
        if _JSON_GROWTH * raw + _OPEN_PAIR * len(self.headers) + _OPEN_FRAME <= MAX_OPEN:
            return None  # the common case: no encoding to know it fits
        stand_in = "r" * replica_id_length
        if _fits(self.to(stand_in)):
            return None
        bare = OpenRequest(stand_in, self.method, self.path, self.query, [])
        return "headers" if _fits(bare) else "target"


def _fits(request: OpenRequest) -> bool:
    try:
        request.to_payload()  # refuses one past `MAX_OPEN`
    except TunnelProtocolError:
        return False
    return True


class ClientTimeout(Exception):
    """The client sent no part of its body for `body_timeout` seconds."""


class BodyTooLarge(Exception):
    """The body passed the gateway's limit while it arrived."""


class ClientGone(Exception):
    """The client went away before its body was complete, or before it was answered."""


class TransportFailed(Exception):
    """The replica could not be reached, or its stream broke before the response started."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class ResponseBroken(Exception):
    """The stream broke after the response started (with `status`): the client's connection is
    dropped. `service` is the service's name, once the gateway knows it (for its metrics)."""

    def __init__(self, cause: str, *, status: int, service: str = "") -> None:
        super().__init__(cause)
        self.cause, self.status, self.service = cause, status, service


async def _settle(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


class RequestBody:
    """The client's body, read once, kept up to `retry_bytes` so a second attempt replays it."""

    def __init__(
        self,
        receive: Receive,
        *,
        limit: int,
        timeout: float,
        retry_bytes: int,
        expected: int | None = None,
    ) -> None:
        self._receive = receive
        self.limit, self.timeout, self.retry_bytes = limit, timeout, retry_bytes
        #: The body's length as the request declared it (0: it has none), when it did.
        self.expected = expected
        self.kept: list[bytes] = []
        self.size = 0
        self.done = False
        self.replayable = True
        self._pending: asyncio.Task[Message] | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body from its start (what was kept), then on from the client."""
        if not self.replayable:
            raise RuntimeError("the body was not kept: it cannot be sent again")
        for chunk in list(self.kept):
            yield chunk
        while not self.done:
            chunk = await self._next()
            if chunk:
                yield chunk

    async def whole(self) -> bytes | None:
        """The whole body, read before the stream opens, when its declared length fits one
        DATA frame (and is kept for a retry): it then goes with the OPEN in one message. None
        when it is to be streamed."""
        expected = self.expected
        if expected is None or expected > min(MAX_PAYLOAD, self.retry_bytes):
            return None
        while not self.done and self.size <= expected:
            await self._next()
        if not self.replayable:
            raise BodyTooLarge  # more than declared, past what is kept
        if not self.done:
            return None  # more than declared: streamed, from what was kept
        return b"".join(self.kept)

    async def _next(self) -> bytes:
        # A read cancelled by a failed attempt is not lost: the next attempt takes it up.
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._receive())
        try:
            message = await asyncio.wait_for(asyncio.shield(self._pending), self.timeout)
        except TimeoutError:
            raise ClientTimeout from None
        self._pending = None
        if message["type"] != "http.request":
            raise ClientGone
        chunk = bytes(message.get("body", b""))
        self.size += len(chunk)
        if self.size > self.limit:
            raise BodyTooLarge
        self.done = not message.get("more_body")
        if self.replayable:
            if self.size <= self.retry_bytes:
                self.kept.append(chunk)
            else:
                self.replayable, self.kept = False, []
        return chunk

    async def receive(self) -> Message:
        """The client's next message once the body was read (`http.disconnect` when it goes)."""
        return await self._receive()

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()


@dataclass
class Exchange:
    """One attempt's result: the response started (`status`, `headers`) on `stream`."""

    stream: Stream
    status: int
    headers: list[tuple[bytes, bytes]]
    #: The task sending the request body (still running when the replica answered early; done
    #: from the start when the body went with the OPEN).
    pump: asyncio.Future[None]


async def open_exchange(
    opener: Opener, *, node_id: str, request: OpenRequest, body: RequestBody
) -> Exchange:
    """Open a stream to the replica, send the body, and wait for the response to start.

    Raises `TransportFailed` (another replica may be tried), or the client's own failures
    (`ClientTimeout`, `BodyTooLarge`, `ClientGone`) with the stream reset.

    A body small enough to be read first (`RequestBody.whole`) goes with the OPEN in one
    message through this process's tunnel; any other is sent as it comes, beside the wait."""
    whole = await body.whole()
    try:
        try:
            if whole is None:
                stream = await opener.open_stream(node_id, request)
            else:
                stream = await opener.open_stream(node_id, request, body=whole)
        except TunnelUnavailable:
            # Not held here: through the process that holds it, if another does.
            if opener.peers is None:
                raise
            stream = await opener.peers.open_stream(node_id, request)
            whole = None  # the body goes through the holder as it would come
    except Exception as exc:  # TunnelUnavailable, or the tunnel refused the stream
        raise TransportFailed(type(exc).__name__) from None
    if whole is not None:
        return await _answered(stream, request.method)
    pump = asyncio.ensure_future(_pump(stream, body))
    pump.add_done_callback(_retrieve)
    answered = asyncio.ensure_future(stream.response())
    try:
        await asyncio.wait({pump, answered}, return_when=asyncio.FIRST_COMPLETED)
        if pump.done() and pump.exception() is not None and not answered.done():
            failure = pump.exception()
            assert failure is not None  # noqa: S101 - checked above
            answered.cancel()
            await _settle(stream.reset("CANCELLED", _reset_reason(failure)))
            if isinstance(failure, ClientTimeout | BodyTooLarge | ClientGone):
                raise failure
            raise TransportFailed(type(failure).__name__)
        try:
            status, raw_headers = await answered
        except Exception as exc:  # reset before the response, or the tunnel went away
            pump.cancel()
            raise TransportFailed(type(exc).__name__) from None
    except BaseException:
        answered.cancel()
        pump.cancel()
        raise
    headers = _headers_out(raw_headers, method=request.method, status=int(status))
    return Exchange(stream=stream, status=int(status), headers=headers, pump=pump)


async def _answered(stream: Stream, method: str) -> Exchange:
    """The exchange of a stream whose whole request went with its OPEN."""
    try:
        status, raw_headers = await stream.response()
    except Exception as exc:  # reset before the response, or the tunnel went away
        raise TransportFailed(type(exc).__name__) from None
    sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    sent.set_result(None)
    headers = _headers_out(raw_headers, method=method, status=int(status))
    return Exchange(stream=stream, status=int(status), headers=headers, pump=sent)


def _headers_out(
    raw_headers: Sequence[Sequence[str]], *, method: str, status: int
) -> list[tuple[bytes, bytes]]:
    headers = [
        (name.encode("latin-1"), str(value).encode("latin-1"))
        for name, value in ((str(name).lower(), value) for name, value in raw_headers)
        if name not in DROPPED_RESPONSE_HEADERS and not name.startswith(INTERNAL_HEADER)
    ]
    length = _passed_length(raw_headers, method=method, status=status)
    if length is not None:
        headers.append((b"content-length", length))
    return headers


def _passed_length(
    raw_headers: Sequence[Sequence[str]], *, method: str, status: int
) -> bytes | None:
    """The replica's `Content-Length` where it frames no body (an answer to HEAD, a 304): its
    one value, ASCII digits only; else None (dropped, as every other answer's is)."""
    if method.upper() != "HEAD" and status != 304:
        return None
    lengths = [str(value) for name, value in raw_headers if str(name).lower() == "content-length"]
    if len(lengths) != 1 or not lengths[0] or not all("0" <= c <= "9" for c in lengths[0]):
        return None
    return lengths[0].encode("ascii")


async def _pump(stream: Stream, body: RequestBody) -> None:
    async for chunk in body.chunks():
        await stream.send(chunk)
    await _settle(stream.end())


def _retrieve(task: asyncio.Task[None]) -> None:
    # A body still being sent when the response ended: its failure is nobody's to answer.
    if not task.cancelled():
        task.exception()


def _reset_reason(failure: BaseException) -> str:
    if isinstance(failure, ClientTimeout):
        return "the client stopped sending its body"
    if isinstance(failure, BodyTooLarge):
        return "the body is larger than the gateway accepts"
    return "the client went away"


async def relay_response(
    exchange: Exchange,
    send: Send,
    extra: Sequence[tuple[bytes, bytes]],
    *,
    body: RequestBody | None = None,
) -> int:
    """Send the response to the client as it comes; returns the body bytes sent. Raises
    `ResponseBroken` when the stream breaks on the way, and `ClientGone` when the client goes
    (watched through `body`'s `receive`: an HTTP server may take sends to a client that has
    gone without a word). Unless the response ended, the stream is reset, so the replica stops
    and the tunnel's stream (one of its `MAX_STREAMS`) is freed at once. An answer that has
    all arrived already (a small one comes in one message) is sent whole, in one piece."""
    await send(
        {
            "type": "http.response.start",
            "status": exchange.status,
            "headers": [*exchange.headers, *extra],
        }
    )
    whole_body = getattr(exchange.stream, "whole_body", None)  # a peer's stream has none
    whole = None if whole_body is None else whole_body()
    if whole is not None:
        if not exchange.pump.done():
            exchange.pump.cancel()  # answered early: the rest of the request is not wanted
        await send({"type": "http.response.body", "body": whole, "more_body": False})
        return len(whole)
    sent = 0
    ended = False
    watch = None if body is None else _ClientWatch(body, exchange)
    try:
        async for chunk in exchange.stream.body():
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                sent += len(chunk)
        ended = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except (asyncio.CancelledError, ClientGone):
        raise
    except Exception as exc:
        if watch is not None and watch.fired:
            raise ClientGone from None
        raise ResponseBroken(type(exc).__name__, status=exchange.status) from None
    finally:
        if watch is not None:
            await watch.stop()
        if not exchange.pump.done():
            exchange.pump.cancel()
        if not ended:
            await _settle(exchange.stream.reset("CANCELLED", "the client went away"))
    return sent


class _ClientWatch:
    """Resets a stream whose response is being relayed once its client has gone: the request
    body cut short (the pump failed with `ClientGone`) or, the body read, `http.disconnect`."""

    def __init__(self, body: RequestBody, exchange: Exchange) -> None:
        self.fired = False
        self._task = asyncio.ensure_future(self._watch(body, exchange))

    async def _watch(self, body: RequestBody, exchange: Exchange) -> None:
        try:
            await asyncio.shield(exchange.pump)
        except ClientGone:
            pass
        except Exception:  # noqa: BLE001 - the stream failed: the relay ends by itself
            return
        else:
            while (await body.receive())["type"] != "http.disconnect":
                pass
        self.fired = True
        await _settle(exchange.stream.reset("CANCELLED", "the client went away"))

    async def stop(self) -> None:
        if self.fired:
            await finish(self._task)  # its reset on its way out: not cut off
        else:
            self._task.cancel()


async def finish(awaitable: Awaitable[Any]) -> None:
    """Await `awaitable`, ignoring what it raised (a task being let go)."""
    try:
        await awaitable
    except BaseException:  # noqa: BLE001, S110 - only let go
        pass
