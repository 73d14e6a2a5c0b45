"""The agent's end of the tunnel (issue 27): the control plane's gateway reaches the replicas
this node runs only through a WebSocket the agent opens to it (`TUNNEL_PATH`, the node
credential as every call sends it). The control plane never dials the node.

`TunnelClient` keeps one tunnel open for as long as the agent runs (always, not only while a
replica runs: simpler, and a replica is reachable the moment it is ready), on an asyncio loop on
a thread of its own. It reconnects with backoff (1 s doubling to 16 s, with jitter) after any
loss: a control plane restarting, the network, a refusal (401 is logged; the heartbeats'
terminal refusal is what stops the agent). For each OPEN it forwards the request to that
replica's local port (`127.0.0.1:<port>` the runtime worker reported) over HTTP/1.1 keep-alive
(`local_http.py`) and streams both bodies under the protocol's windows
(`modelforge_contracts.tunnel`), so a stream holds at most its window of either body. A request
whose END came with its OPEN (one BATCH) goes to the replica whole, in one write; an answer
whose declared length fits one DATA frame goes back whole, RESPONSE, DATA and END in one BATCH.
More than `MAX_STREAMS` streams at once: the newest is reset with `TOO_MANY_STREAMS`.

It never logs the credential, a header or a body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus, WebSocketException

from modelforge_contracts.tunnel import (
    CLOSE_GOING_AWAY,
    CLOSE_PROTOCOL,
    IDLE_TIMEOUT,
    KEEPALIVE_SECONDS,
    MAX_PAYLOAD,
    MAX_STREAMS,
    TUNNEL_PATH,
    FrameType,
    FrameWriter,
    OpenRequest,
    ReceiveWindow,
    ResetCode,
    ResponseHead,
    SendWindow,
    TunnelProtocolError,
    decode_message,
    encode,
    keepalive,
    parse_window,
    reset_frame,
    send_data,
    window,
)
from node_agent.local_http import LocalHTTP, LocalHTTPError, LocalResponse

log = logging.getLogger("modelforge.node_agent.tunnel")
_BACKOFF_FIRST = 1.0
_BACKOFF_MAX = 16.0
#: How long a cached view of the replicas' ports is trusted before it is asked again.
_PORTS_FRESH = 1.0


def tls_context(url: str, *, verify: bool, ca_cert_path: Path | None) -> ssl.SSLContext | None:
    """The TLS context of a `wss://` tunnel, trusting what the agent's HTTP client trusts (the
    system's roots, plus `ca_cert_path`); None for plain `http://`."""
    if not url.startswith("https://"):
        return None
    context = ssl.create_default_context()
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif ca_cert_path is not None:
        context.load_verify_locations(cafile=str(ca_cert_path))
    return context


class LocalPorts:
    """Replica id -> the local port its server listens on, from the runtime worker's view
    (`GET /v1/services`), asked at most once a second (and at once for an unknown id)."""

    def __init__(self, view: Callable[[], dict[str, Any]]) -> None:
        self._view = view
        self._ports: dict[str, int] = {}
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def port(self, replica_id: str) -> int | None:
        with self._lock:
            known = self._ports.get(replica_id)
            fresh = time.monotonic() - self._read_at < _PORTS_FRESH
            if known is not None and fresh:
                return known
            try:
                self._read()
            except Exception:  # the worker away: no port; the stream is reset
                return known
            return self._ports.get(replica_id)

    def all(self) -> dict[str, int]:
        """Every replica's port, asked of the worker now (the native relay is told them all);
        the worker's failure is raised."""
        with self._lock:
            self._read()
            return dict(self._ports)

    def _read(self) -> None:
        services = self._view().get("services", [])
        self._ports = {
            str(entry["service_id"]): int(entry["port"])
            for entry in services
            if isinstance(entry, dict) and isinstance(entry.get("port"), int)
        }
        self._read_at = time.monotonic()


class TunnelClient:
    """See the module's docstring."""

    def __init__(
        self,
        *,
        control_plane_url: str,
        credential: str,
        ports: Callable[[str], int | None],
        stop: threading.Event,
        tls: ssl.SSLContext | None = None,
        max_streams: int = MAX_STREAMS,
        local_host: str = "127.0.0.1",
    ) -> None:
        scheme, _, rest = control_plane_url.rstrip("/").partition("://")
        self._url = ("wss" if scheme == "https" else "ws") + "://" + rest + TUNNEL_PATH
        self._credential = credential
        self._ports = ports
        self._stop = stop
        self._tls = tls
        self.max_streams = max_streams
        self._local_host = local_host
        #: Set while a tunnel is open (tests and the logs read it).
        self.connected = threading.Event()
        #: How many tunnels were opened since the start.
        self.connections = 0
        #: The most of one request body a stream held at once.
        self.peak_buffered = 0
        #: Replica id -> its requests in flight through the tunnel (`in_flight`).
        self._in_flight: dict[str, int] = {}
        self._in_flight_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<TunnelClient {self._url}>"

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, daemon=True, name="tunnel")
        thread.start()
        return thread

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        backoff = _BACKOFF_FIRST
        failing_since: float | None = None
        http = LocalHTTP(self._local_host)
        try:
            while not self._stop.is_set():
                try:
                    async with connect(
                        self._url,
                        additional_headers={"Authorization": f"Bearer {self._credential}"},
                        ssl=self._tls,
                        ping_interval=KEEPALIVE_SECONDS,
                        ping_timeout=IDLE_TIMEOUT,
                        open_timeout=10,
                        max_size=2 * MAX_PAYLOAD,
                    ) as websocket:
                        self.connections += 1
                        if failing_since is not None:
                            log.info(
                                "tunnel open again after %.0f s", time.monotonic() - failing_since
                            )
                        else:
                            log.info("tunnel open")
                        failing_since, backoff = None, _BACKOFF_FIRST
                        self.connected.set()
                        try:
                            await _Session(websocket, http, self).serve()
                        finally:
                            self.connected.clear()
                    if not self._stop.is_set():
                        log.info("the tunnel closed; opening it again")
                except InvalidStatus as exc:
                    status = exc.response.status_code
                    if failing_since is None:
                        log.warning("the control plane refused the tunnel (HTTP %d)", status)
                        failing_since = time.monotonic()
                except (OSError, WebSocketException, TimeoutError) as exc:
                    if failing_since is None:
                        log.warning("the tunnel is down (%s); retrying", type(exc).__name__)
                        failing_since = time.monotonic()
                if failing_since is None:
                    failing_since = time.monotonic()
                    backoff = _BACKOFF_FIRST  # a tunnel that was open comes back at once-ish
                await self._pause(backoff * random.uniform(0.5, 1.0))  # noqa: S311 - jitter
                backoff = min(backoff * 2, _BACKOFF_MAX)
        finally:
            await http.aclose()

    async def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(min(0.1, seconds))

    def port(self, replica_id: str) -> int | None:
        return self._ports(replica_id)

    def in_flight(self, replica_id: str) -> int:
        """The requests to `replica_id` in flight through the tunnel now (any thread): a
        draining replica's agent reports it, and its drain ends once it is 0."""
        with self._in_flight_lock:
            return self._in_flight.get(replica_id, 0)

    def _count(self, replica_id: str, change: int) -> None:
        with self._in_flight_lock:
            left = self._in_flight.get(replica_id, 0) + change
            if left > 0:
                self._in_flight[replica_id] = left
            else:
                self._in_flight.pop(replica_id, None)

    @staticmethod
    def local_target(path: str, query: str) -> str:
        return path + (f"?{query}" if query else "")


class _Session:
    """One open tunnel: its reader, its keepalive, its streams."""

    def __init__(self, websocket: ClientConnection, http: LocalHTTP, client: TunnelClient):
        self._websocket = websocket
        self._http = http
        self._client = client
        self._streams: dict[int, _Forward] = {}
        # The client library only buffers a write, so nothing would wait to join one: the
        # writer lets the loop run once first, and answers read together leave together.
        self._writer = FrameWriter(websocket.send, linger=True)

    async def send(self, *frames: bytes) -> None:
        """`frames` written in order (`FrameWriter`); `ConnectionError` once it closed."""
        await self._writer.send(*frames)

    async def send_quietly(self, message: bytes) -> None:
        with contextlib.suppress(WebSocketException, OSError):
            await self.send(message)

    async def serve(self) -> None:
        beat = asyncio.ensure_future(self._keepalive())
        stopper = asyncio.ensure_future(self._watch_stop())
        try:
            async for message in self._websocket:
                if isinstance(message, str):
                    raise TunnelProtocolError("a text message on the tunnel")
                await self._dispatch(message)
        except TunnelProtocolError as exc:
            log.warning("the control plane broke the tunnel's protocol (%s); reconnecting", exc)
            await self._websocket.close(CLOSE_PROTOCOL, "protocol error")
        except WebSocketException:
            pass  # closed: the caller reconnects
        finally:
            beat.cancel()
            stopper.cancel()
            for forward in list(self._streams.values()):
                forward.cancel()
            self._streams.clear()

    async def _keepalive(self) -> None:
        with contextlib.suppress(WebSocketException, OSError):
            while True:
                await self.send(keepalive())
                await asyncio.sleep(KEEPALIVE_SECONDS)

    async def _watch_stop(self) -> None:
        while not self._client._stop.is_set():
            await asyncio.sleep(0.2)
        await self._websocket.close(CLOSE_GOING_AWAY, "the agent is stopping")

    async def _dispatch(self, message: bytes) -> None:
        for frame in decode_message(message):
            if frame.kind is FrameType.OPEN:
                await self._open(frame.stream, frame.payload)
                continue
            forward = self._streams.get(frame.stream)
            if forward is None:
                continue  # a stream already over: its frames in flight are dropped
            try:
                forward.on_frame(frame.kind, frame.payload)
            except TunnelProtocolError as exc:
                await forward.reset(exc.code, str(exc))

    async def _open(self, stream_id: int, payload: bytes) -> None:
        if stream_id in self._streams:
            raise TunnelProtocolError("an OPEN for a stream that is open")
        if len(self._streams) >= self._client.max_streams:
            message = f"{self._client.max_streams} streams open"
            await self.send_quietly(reset_frame(stream_id, ResetCode.TOO_MANY_STREAMS, message))
            return
        try:
            request = OpenRequest.from_payload(payload)
        except TunnelProtocolError as exc:
            await self.send_quietly(reset_frame(stream_id, ResetCode.PROTOCOL_ERROR, str(exc)))
            return
        forward = _Forward(self, stream_id, request)
        self._streams[stream_id] = forward
        forward.start()

    def forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    @property
    def http(self) -> LocalHTTP:
        return self._http

    @property
    def client(self) -> TunnelClient:
        return self._client


class _Forward:
    """One stream: the request to the replica's local port, its answer back."""

    def __init__(self, session: _Session, stream_id: int, request: OpenRequest) -> None:
        self._session = session
        self.id = stream_id
        self._request = request
        self._receive_window = ReceiveWindow()
        self._send_window = SendWindow()
        self._chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._over = False

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def cancel(self) -> None:
        self._over = True
        self._send_window.close()
        if self._task is not None:
            self._task.cancel()

    def on_frame(self, kind: FrameType, payload: bytes) -> None:
        if kind is FrameType.DATA:
            self._receive_window.received(len(payload))
            client = self._session.client
            client.peak_buffered = max(client.peak_buffered, self._receive_window.peak)
            self._chunks.put_nowait(payload)
        elif kind is FrameType.END:
            self._chunks.put_nowait(None)
        elif kind is FrameType.WINDOW:
            self._send_window.grant(parse_window(payload))
        elif kind is FrameType.RESET:
            self._session.forget(self.id)
            self.cancel()
        else:
            raise TunnelProtocolError(f"{kind.name} from the control plane")

    async def reset(self, code: str, message: str) -> None:
        if self._over:
            return
        self._session.forget(self.id)
        self.cancel()
        await self._session.send_quietly(reset_frame(self.id, code, message))

    def _queued(self) -> tuple[list[bytes], bool]:
        """The body pieces already here, and whether its END is among them."""
        pieces: list[bytes] = []
        while not self._chunks.empty():
            chunk = self._chunks.get_nowait()
            if chunk is None:
                return pieces, True
            pieces.append(chunk)
        return pieces, False

    async def _body(self, first: list[bytes]) -> AsyncIterator[bytes]:
        pieces: list[bytes | None] = list(first)
        while True:
            for chunk in pieces:
                if chunk is None:
                    return
                increment = self._receive_window.consumed(len(chunk))
                yield chunk
                if increment:
                    await self._session.send_quietly(window(self.id, increment))
            pieces = [await self._chunks.get()]

    async def _request_body(self) -> bytes | AsyncIterator[bytes] | None:
        """The request body: whole when its END is here already (a small request's BATCH),
        else streamed as it comes, under the window."""
        pieces, ended = self._queued()
        if not ended:
            if not pieces:
                first = await self._chunks.get()
                if first is None:
                    return None
                pieces = [first]
                more, ended = self._queued()
                pieces += more
            if not ended:
                return self._body(pieces)
        for piece in pieces:
            self._receive_window.consumed(len(piece))  # the peer sends no more: no WINDOW
        return b"".join(pieces) if pieces else None

    async def _run(self) -> None:
        client = self._session.client
        client._count(self._request.replica_id, 1)
        try:
            await self._forward()
        finally:
            client._count(self._request.replica_id, -1)

    async def _forward(self) -> None:
        request = self._request
        port = self._session.client.port(request.replica_id)
        if port is None:
            await self.reset(
                ResetCode.NO_SUCH_REPLICA, f"this node runs no replica {request.replica_id}"
            )
            return
        answered = False
        response: LocalResponse | None = None
        try:
            body = await self._request_body()
            target = TunnelClient.local_target(request.path, request.query)
            response = await self._session.http.request(
                port, request.method, target, request.headers, body
            )
            head = encode(
                FrameType.RESPONSE,
                self.id,
                ResponseHead(response.status, response.headers).to_payload(),
            )
            size = response.length
            if size is not None and size <= MAX_PAYLOAD and size <= self._send_window.available:
                # Small and declared: read whole, then RESPONSE, DATA and END as one message.
                data = await response.read()
                frames = [head]
                if data:
                    self._send_window.available -= len(data)
                    frames.append(encode(FrameType.DATA, self.id, data))
                frames.append(encode(FrameType.END, self.id))
                await self._session.send(*frames)
                answered = True
            else:
                await self._session.send(head)
                answered = True
                async for piece in response.chunks():
                    await self._send_data(piece)
                await self._session.send(encode(FrameType.END, self.id))
            self._over = True
            self._session.forget(self.id)
        except asyncio.CancelledError:
            raise
        except (WebSocketException, OSError):
            self.cancel()  # the tunnel went: its reader ends every stream
        except (LocalHTTPError, _Closed) as exc:
            reached = answered or (isinstance(exc, LocalHTTPError) and exc.reached)
            if reached:
                await self.reset(ResetCode.UPSTREAM_FAILED, f"the replica broke off ({exc})"[:200])
            else:
                await self.reset(ResetCode.UPSTREAM_UNREACHABLE, str(exc)[:200])
        finally:
            if response is not None:
                response.release()

    async def _send_data(self, piece: bytes) -> None:
        if not await send_data(self._session.send, self.id, piece, self._send_window):
            raise _Closed("the stream was reset")


class _Closed(Exception):
    """The stream was reset while its answer was being sent."""
