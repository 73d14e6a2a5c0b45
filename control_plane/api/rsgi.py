"""What Granian serves: the control plane on Granian's RSGI interface (HB-4).

Heartbeats are most of what a fleet sends, and Granian's ASGI bridge (a scope dict, message
dicts and two awaitables per request) cost each one more than the answer itself. So the served
app speaks RSGI: the agents' requests the fast path answers (`AgentFastPath.answer`) are read
and answered straight through RSGI's protocol object (framed by `agent_frame`, as the fast
path's ASGI seam frames them), and everything else — including an agent
request the fast path hands on — is served by the ASGI app (the edge, the JSON guard, FastAPI)
through `serve_asgi`, a bridge with ASGI's semantics: the request body streamed as it arrives,
the response sent whole or streamed, `http.disconnect` once the client has gone. The ASGI
lifespan (migrations, background loops) runs in `__rsgi_init__` and `__rsgi_del__`. A WebSocket
(the agents' tunnels) is served by the ASGI app through `rsgi_websocket.serve_websocket`.

It never buffers a body beyond the fast path's 16 KiB, never answers anything itself but a 500
for an app that failed before its response started, and never puts an exception's text in an
answer.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import sys
from typing import Any

from control_plane.api.agent_fast import AgentFastPath, agent_request
from control_plane.api.agent_frame import FAST_BODY_LIMIT, RSGI_JSON_HEADERS, HandOn, Reply
from control_plane.api.asgi import ASGIApp, Message, Scope
from control_plane.api.rsgi_websocket import serve_websocket
from control_plane.errors import InternalError

log = logging.getLogger(__name__)

_ASGI = {"version": "3.0", "spec_version": "2.3"}
# What hyper can send: a header name is a token, a value visible ASCII, spaces and tabs.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")
# Its own 500 carries the headers of the fast path's JSON replies.
_JSON = RSGI_JSON_HEADERS
#: Seconds a thread holds the GIL while another waits for it, in the served process (Python's
#: default is 5 ms): see `ASGIOverRSGI.__rsgi_init__`.
SWITCH_INTERVAL = 0.0005
#: Where the served process finds the native front's key of this start (`native_front.py`).
FRONT_KEY_ENV = "MODELFORGE_GATEWAY_FRONT_KEY"
#: What the native front adds to each request it passes on: the client's address, the scheme
#: the client used (`https` where the front terminates TLS: Granian behind it sees plain HTTP),
#: and the key that says both are the front's (anyone else's are ignored; all are removed).
CLIENT_HEADER = "x-modelforge-client"
SCHEME_HEADER = "x-modelforge-scheme"
FRONT_KEY_HEADER = "x-modelforge-front-key"
_FRONT_HEADERS = (CLIENT_HEADER, SCHEME_HEADER, FRONT_KEY_HEADER)


class FrontTrust:
    """Whether a request came through the native front, whose word on the client's address it
    then takes: with the front, every request reaches Granian from the front's own socket."""

    key: str | None = None

    @classmethod
    def load(cls) -> None:
        cls.key = os.environ.get(FRONT_KEY_ENV) or None

    @classmethod
    def _from_front(cls, headers: Any) -> bool:
        key = cls.key
        presented = headers.get(FRONT_KEY_HEADER)
        return key is not None and presented is not None and hmac.compare_digest(presented, key)

    @classmethod
    def client(cls, headers: Any, address: str) -> str:
        """The client's `host:port`: the front's `x-modelforge-client` when its key came."""
        if not cls._from_front(headers):
            return address
        return str(headers.get(CLIENT_HEADER) or address)

    @classmethod
    def scheme(cls, headers: Any, scheme: str) -> str:
        """The client's scheme: the front's `x-modelforge-scheme` (http or https) when its key
        came, else the one Granian saw."""
        if not cls._from_front(headers):
            return scheme
        told = headers.get(SCHEME_HEADER)
        return told if told in ("http", "https") else scheme


#: The app's own 500 (`errors.InternalError`), rendered as its routes render it.
_FAILED = json.dumps(InternalError().to_body(), separators=(",", ":")).encode()


class LifespanFailed(RuntimeError):
    """The ASGI app's lifespan reported a failed startup or shutdown, or ended early."""


class ASGIOverRSGI:
    """An ASGI app served on Granian's RSGI interface: its lifespan at start and stop, every
    request through `serve_asgi`."""

    def __init__(self, app: ASGIApp) -> None:
        FrontTrust.load()
        self.app = app
        self.lifespan = Lifespan(app)

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Granian's own threads hand every request, body piece and WebSocket message to the
        # event loop's thread, and each hand-over needs the GIL: with Python's default switch
        # interval (5 ms) a busy loop kept each waiting up to 5 ms, which capped the gateway's
        # tunnel at about 130 requests/s however little each cost (issue 27, 8 connections).
        sys.setswitchinterval(SWITCH_INTERVAL)
        try:
            loop.run_until_complete(self.lifespan.startup())
        except LifespanFailed as exc:
            log.error("the application did not start: %s", exc)
            raise SystemExit(1) from None

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.run_until_complete(self.lifespan.shutdown())
        except LifespanFailed as exc:
            log.error("the application did not stop cleanly: %s", exc)

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        if scope.proto == "ws":
            await serve_websocket(self.app, scope, protocol, self.lifespan.state, _address)
            return
        await serve_asgi(self.app, scope, protocol, self.lifespan.state)


class ServedApp(ASGIOverRSGI):
    """The RSGI app Granian runs: the agents' fast path `fast` answers its requests itself, in
    front of the ASGI app (`fast` again, the outermost seam); a request it hands on goes, with
    the body it read, to `edge`, the ASGI app behind it. `api/front.py` composes it."""

    def __init__(self, fast: AgentFastPath, edge: ASGIApp) -> None:
        super().__init__(fast)
        self.fast = fast
        self.edge = edge

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        if scope.proto == "ws":  # the agents' tunnels (api/rsgi_websocket.py)
            await serve_websocket(self.fast, scope, protocol, self.lifespan.state, _address)
            return
        request = agent_request(scope.method, scope.path)
        if request is None:
            await serve_asgi(self.fast, scope, protocol, self.lifespan.state)
            return
        headers = scope.headers
        declared = _declared_length(headers)
        # hyper reads exactly Content-Length bytes, and drops the header when the body comes
        # chunked (even beside one), so `await protocol()` below reads at most the limit.
        if declared is None or declared > FAST_BODY_LIMIT:
            # Chunked, or larger than the fast path reads: the ASGI seam reads it bounded.
            await serve_asgi(self.fast, scope, protocol, self.lifespan.state)
            return
        try:
            body = await protocol()
        except RuntimeError:  # RSGIProtocolClosed: the agent went away in the middle of its body
            return
        try:
            outcome = await self.fast.answer(
                request,
                headers.get("authorization"),
                headers.get("content-type"),
                body,
                protocol.client_disconnect,
            )
        except Exception as exc:
            log.error("unexpected %s while serving an agent", type(exc).__name__, exc_info=exc)
            protocol.response_bytes(500, _JSON, _FAILED)
            return
        if isinstance(outcome, Reply):
            outcome.send_rsgi(protocol)
        elif isinstance(outcome, HandOn):
            await serve_asgi(self.edge, scope, protocol, self.lifespan.state, body=outcome.body)
        # else CLIENT_GONE: the agent closed the connection, nobody to answer


async def serve_asgi(
    app: ASGIApp,
    scope: Any,
    protocol: Any,
    state: dict[str, Any],
    *,
    body: bytes | None = None,
) -> None:
    """Serve one RSGI request with the ASGI `app`; `body` when it was read already."""
    exchange = _Exchange(protocol, body, _declared_length(scope.headers))
    try:
        await app(_asgi_scope(scope, state), exchange.receive, exchange.send)
    except Exception as exc:
        log.error("unexpected %s while serving a request", type(exc).__name__, exc_info=exc)
        exchange.failed()
        return
    finally:
        exchange.close()
    exchange.finish()


def _asgi_scope(scope: Any, state: dict[str, Any]) -> Scope:
    # RSGI gives text (a header whose value is not visible ASCII is left out by Granian); the
    # query string is the raw one, so encoding it again gives the bytes the client sent. The
    # path comes percent-decoded, and RSGI has no raw form of it (Granian's scope decodes
    # `uri.path()` when read), so there is no `raw_path`: ASGI lets a server leave it out, and
    # a reader that needs the path as sent encodes it again (`gateway_forward.received_path`).
    return {
        "type": "http",
        "asgi": _ASGI,
        "http_version": scope.http_version,
        "method": scope.method,
        "scheme": FrontTrust.scheme(scope.headers, scope.scheme),
        "path": scope.path,
        "query_string": scope.query_string.encode(),
        "root_path": "",
        "headers": [
            (name.encode(), value.encode())
            for name, value in scope.headers.items()
            if name not in _FRONT_HEADERS
        ],
        "client": _address(FrontTrust.client(scope.headers, scope.client)),
        "server": _address(scope.server),
        "state": state.copy(),
        # Files (artifact downloads, the console) are sent by Granian from the path, as its ASGI
        # server does: no Python loop reading a file faster than a slow client takes it.
        "extensions": {"http.response.pathsend": {}},
    }


def _declared_length(headers: Any) -> int | None:
    """The request's Content-Length; None for a chunked body (hyper drops the header then)."""
    length = headers.get("content-length")
    return int(length) if length is not None and length.isdigit() else None


def _address(text: str) -> tuple[str, int] | None:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


class _Exchange:
    """ASGI's `receive` and `send` for one RSGI request."""

    def __init__(self, protocol: Any, body: bytes | None, declared: int | None) -> None:
        self._protocol = protocol
        self._body = body
        self._declared = declared
        self._received = 0
        self._chunks: Any = None
        self._request_done = False
        #: Set once the client has gone or the response has ended: `receive` says disconnect.
        self._over = asyncio.Event()
        self._client_left = False
        self._watch: asyncio.Future[Any] | None = None
        self.status: int | None = None
        self._headers: list[tuple[str, str]] = []
        self._stream: Any = None

    async def receive(self) -> Message:
        if not self._request_done:
            if self._body is not None:
                body, self._body = self._body, None
                self._request_done = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await self._next_chunk()
        # The body is read: what comes next is the client going away (or the response ending).
        # One watch a request however often `receive` is called and cancelled (as Starlette's
        # `is_disconnected` does).
        if self._watch is None and not self._over.is_set():
            self._watch = asyncio.ensure_future(self._watch_client())
        await self._over.wait()
        return {"type": "http.disconnect"}

    async def _next_chunk(self) -> Message:
        """The next piece of the body as it arrives; a body cut short is a disconnect.

        Granian's stream ends with one empty chunk; a body that broke off (the connection lost
        in the middle, a malformed chunk) gives one more empty chunk before it ends. Either way,
        fewer bytes than `Content-Length` declared is a body cut short too.
        """
        if self._chunks is None:
            self._chunks = self._protocol.__aiter__()
        empty = 0
        while True:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self._request_done = True
                short = self._declared is not None and self._received < self._declared
                if empty > 1 or short:
                    self._client_left = True
                    self._over.set()
                    return {"type": "http.disconnect"}
                return {"type": "http.request", "body": b"", "more_body": False}
            if not chunk:
                empty += 1
                continue
            self._received += len(chunk)
            if self._declared is not None and self._received >= self._declared:
                # All it declared (hyper reads no more): complete now, not one read later.
                self._request_done = True
                return {"type": "http.request", "body": chunk, "more_body": False}
            return {"type": "http.request", "body": chunk, "more_body": True}

    async def _watch_client(self) -> None:
        await self._protocol.client_disconnect()
        self._client_left = True
        self._over.set()

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = [
                (name.decode("latin-1"), value.decode("latin-1"))
                for name, value in message.get("headers", ())
            ]
            if not all(_sendable(name, value) for name, value in headers):
                raise ValueError("a response header the HTTP server cannot send")
            status = message["status"]
            if not isinstance(status, int) or not 100 <= status <= 599:
                raise ValueError("a response status the HTTP server cannot send")
            self.status, self._headers = status, headers
            return
        if self._over.is_set() or self.status is None:
            return
        if kind == "http.response.pathsend":
            self._protocol.response_file(self.status, self._headers, message["path"])
            self._over.set()
            return
        if kind != "http.response.body":
            return
        body = message.get("body", b"")
        more = bool(message.get("more_body"))
        if self._stream is None and not more:
            self._protocol.response_bytes(self.status, self._headers, bytes(body))
            self._over.set()
            return
        if self._stream is None:
            self._stream = self._protocol.response_stream(self.status, self._headers)
        try:
            if body:
                await self._stream.send_bytes(bytes(body))
        except RuntimeError:  # RSGIProtocolClosed: the client has gone
            self._client_left = True
            self._over.set()
            return
        if not more:
            self._stream = None  # the response ends when its transport is let go
            self._over.set()

    def failed(self) -> None:
        """The app raised: a 500 when nothing was sent yet (and the client is there)."""
        if self._stream is None and not self._over.is_set() and not self._client_left:
            self._protocol.response_bytes(500, _JSON, _FAILED)

    def finish(self) -> None:
        """After the app returned: a response started but not ended is ended (with what was
        sent), and none at all is a 500 — unless the client has gone."""
        if self._client_left:
            return
        if self.status is None:
            log.error("the application returned without answering")
            self._protocol.response_bytes(500, _JSON, _FAILED)
        elif self._stream is None and not self._over.is_set():
            self._protocol.response_bytes(self.status, self._headers, b"")

    def close(self) -> None:
        self._stream = None
        if self._watch is not None:
            self._watch.cancel()


def _sendable(name: str, value: str) -> bool:
    return _HEADER_NAME.fullmatch(name) is not None and _HEADER_VALUE.fullmatch(value) is not None


class Lifespan:
    """Runs an ASGI app's lifespan protocol: `startup()` until the app says it started,
    `shutdown()` until it says it stopped. `state` is the lifespan state every request's scope
    gets a copy of."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self._inbox: asyncio.Queue[Message] | None = None
        self._started: asyncio.Future[None] | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        self._inbox = asyncio.Queue()
        self._started = loop.create_future()
        self._task = loop.create_task(self._run())
        await self._inbox.put({"type": "lifespan.startup"})
        await self._started

    async def shutdown(self) -> None:
        if self._inbox is None or self._task is None:
            return  # never started
        if self._task.done():
            log.error("the lifespan had ended before the stop: nothing ran at shutdown")
            return
        self._stopped = asyncio.get_running_loop().create_future()
        await self._inbox.put({"type": "lifespan.shutdown"})
        try:
            await self._stopped
        finally:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": _ASGI, "state": self.state}
        try:
            await self.app(scope, self._receive, self._send)
        except BaseException as exc:
            ended = LifespanFailed(f"the lifespan raised {type(exc).__name__}")
            log.error("the control plane's lifespan failed", exc_info=exc)
            self._settle(ended)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._settle(LifespanFailed("the lifespan ended before it was told to stop"))

    def _settle(self, error: LifespanFailed) -> None:
        for waiter in (self._started, self._stopped):
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)

    async def _receive(self) -> Message:
        assert self._inbox is not None  # noqa: S101 - set by startup() before the app runs
        return await self._inbox.get()

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        waiter = self._started if kind.startswith("lifespan.startup.") else self._stopped
        if waiter is None or waiter.done():
            return
        if kind.endswith(".complete"):
            waiter.set_result(None)
        else:  # the app raises next, and `_run` logs that with its traceback
            waiter.set_exception(LifespanFailed(kind.replace("lifespan.", "the lifespan's ")))
