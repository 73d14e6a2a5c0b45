"""The agents' tunnels this process holds, and the streams the gateway opens through them.

One `TunnelHub` per process (on `AppContext`). The transport (`api/tunnel.py`) authenticates an
agent's WebSocket and hands it to `TunnelHub.serve`, which holds it until it closes, its node's
credential is revoked or expires, or it is silent for `IDLE_TIMEOUT`. A node has one tunnel: a
new one replaces the old. The gateway asks `connected(node_id)` and calls `open_stream`, which
sends OPEN and returns a `Stream`: the request body goes out with `send` and `end`, the answer comes
back through `response()` and `body()`, each direction under the protocol's flow control
(`modelforge_contracts.tunnel`), so a stream holds at most its window in memory whatever the
body's size. A request whose whole body is at hand goes in one message (`open_stream(...,
body=)`: OPEN, DATA and END in a BATCH), and an answer that came whole is taken at once
(`whole_body()`): each WebSocket message is a hand-over between the server's threads, the
largest cost of a small request. Everything runs on the event loop that serves the WebSocket;
nothing here blocks.

Where several control-plane replicas serve, each records the tunnels it holds in
`gateway_tunnels` (`tunnel_holders.HolderRecord`, given to the hub at start: a row when a tunnel
opens, gone when it closes, this process's rows gone when it stops), so that a gateway on another
replica finds the holder and forwards a stream through it (`peers.py`; the gateway reaches it as
`hub.peers`). Those writes run on a thread, off the event loop; one that fails is logged and
changes nothing for the tunnel itself.

A tunnel's bounds (`modelforge_contracts.tunnel`): its reader takes `FrameBudget`'s frames a
second and waits past them (a BATCH of too many frames closes it); each write toward the agent
waits at most `WRITE_TIMEOUT`, past which the agent does not read and the tunnel is cut off.
What waits to be written is bounded by the streams: each sender waits for its own write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol

from control_plane.gateway.tunnel_holders import HolderRecord
from modelforge_contracts.tunnel import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY,
    CLOSE_PROTOCOL,
    IDLE_TIMEOUT,
    MAX_PAYLOAD,
    MAX_STREAMS,
    WRITE_TIMEOUT,
    FrameBudget,
    FrameType,
    FrameWriter,
    Headers,
    OpenRequest,
    ReceiveWindow,
    Reset,
    ResetCode,
    ResponseHead,
    SendWindow,
    TunnelProtocolError,
    decode_message,
    encode,
    parse_window,
    reset_frame,
    send_data,
    window,
)

__all__ = ["HolderRecord", "StreamReset", "TunnelHub", "TunnelUnavailable"]

log = logging.getLogger(__name__)
#: How often a held tunnel's credential and silence are checked.
_WATCH_EVERY = 0.5
#: WebSocket close codes the control plane ends a tunnel with (REVOKED: its credential no
#: longer stands, revoked or expired).
CLOSE_REVOKED = 4401
CLOSE_REPLACED = 4409
CLOSE_IDLE = 4408


class TunnelUnavailable(Exception):
    """No tunnel to that node in this process (or it closed while the stream was opened)."""


class StreamReset(Exception):
    """The stream was reset (by the agent, the tunnel closing, or this side)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class TunnelSocket(Protocol):
    """One accepted WebSocket, as the transport gives it to the hub."""

    async def send(self, message: bytes) -> None: ...

    async def receive(self) -> bytes | None:
        """The next binary message; None once the WebSocket has closed."""
        ...

    async def close(self, code: int, reason: str) -> None: ...


class Stream:
    """One request through a tunnel (see the module's docstring)."""

    def __init__(self, tunnel: Tunnel, stream_id: int) -> None:
        self.id = stream_id
        self._tunnel = tunnel
        self._send_window = SendWindow()
        self._receive_window = ReceiveWindow()
        self._chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._head: asyncio.Future[ResponseHead] = asyncio.get_running_loop().create_future()
        self._sent_end = False
        #: The agent's END has come: the whole body waits in `_chunks`.
        self._all_here = False
        self._reset: StreamReset | None = None

    @property
    def peak_buffered(self) -> int:
        """The most of the response body this stream held at once (at most its window)."""
        return self._receive_window.peak

    async def send(self, data: bytes) -> None:
        """A piece of the request body, sent as the agent's window allows."""
        if not await send_data(self._tunnel.send, self.id, data, self._send_window):
            # Reset, or else the answer is complete: the agent reads no more of the request.
            self._raise_if_reset()

    async def end(self) -> None:
        """The request body is complete."""
        self._raise_if_reset()
        if not self._sent_end:
            self._sent_end = True
            await self._tunnel.send(encode(FrameType.END, self.id))

    async def response(self) -> tuple[int, Headers]:
        """The replica's status and headers; `StreamReset` if the stream ended before them."""
        head = await self._head
        return head.status, head.headers

    def whole_body(self) -> bytes | None:
        """The whole response body when all of it has arrived (END received), taken at once;
        else None, and nothing is taken (read it through `body()`)."""
        if self._reset is not None or not self._all_here:
            return None
        pieces = []
        while (chunk := self._chunks.get_nowait()) is not None:
            self._receive_window.consumed(len(chunk))  # over: no WINDOW to send
            pieces.append(chunk)
        self._all_here = False
        return b"".join(pieces)

    async def body(self) -> AsyncIterator[bytes]:
        """The response body as it arrives; the agent is granted more as it is consumed."""
        while True:
            chunk = await self._chunks.get()
            if chunk is None:
                self._raise_if_reset()
                return
            increment = self._receive_window.consumed(len(chunk))
            if increment:
                await self._tunnel.send_quietly(window(self.id, increment))
            yield chunk

    async def reset(self, code: str = ResetCode.CANCELLED, message: str = "") -> None:
        """End the stream in both directions and tell the agent (the client went away)."""
        if self._reset is not None:
            return
        self._ended(StreamReset(code, message))
        await self._tunnel.send_quietly(reset_frame(self.id, code, message))

    def _raise_if_reset(self) -> None:
        if self._reset is not None:
            raise self._reset

    # -- frames from the agent (the tunnel's reader) ------------------------------------------

    def _on_frame(self, kind: FrameType, payload: bytes) -> None:
        if kind is FrameType.RESPONSE:
            if self._head.done():
                raise TunnelProtocolError("a second RESPONSE")
            self._head.set_result(ResponseHead.from_payload(payload))
        elif kind is FrameType.DATA:
            if not self._head.done():
                raise TunnelProtocolError("DATA before RESPONSE")
            self._receive_window.received(len(payload))
            self._chunks.put_nowait(payload)
        elif kind is FrameType.END:
            if not self._head.done():
                # Else `response()` would wait for ever: the stream is forgotten below.
                raise TunnelProtocolError("END before RESPONSE")
            self._chunks.put_nowait(None)
            self._all_here = True
            self._send_window.close()
            self._tunnel.forget(self.id)
        elif kind is FrameType.WINDOW:
            self._send_window.grant(parse_window(payload))
        elif kind is FrameType.RESET:
            reset = Reset.from_payload(payload)
            self._ended(StreamReset(reset.code, reset.message))
        else:
            raise TunnelProtocolError(f"{kind.name} from an agent")

    def _ended(self, reset: StreamReset) -> None:
        """Over with `reset`: every waiter on either direction is told."""
        if self._reset is not None:
            return
        self._reset = reset
        self._send_window.close()
        if not self._head.done():
            self._head.set_exception(reset)
            self._head.exception()  # retrieved: nobody may be waiting for it
        self._chunks.put_nowait(None)
        self._tunnel.forget(self.id)


class Tunnel:
    """One agent's WebSocket: its streams and its one writer."""

    def __init__(self, node_id: str, socket: TunnelSocket, *, max_streams: int) -> None:
        self.node_id = node_id
        self.max_streams = max_streams
        self._socket = socket
        self._streams: dict[int, Stream] = {}
        self._next_id = 1
        self._writer = FrameWriter(self._write)
        self._budget = FrameBudget()
        self.closed = False
        self.heard_at = time.monotonic()
        #: A write waited `WRITE_TIMEOUT`: the agent does not read (the hub cuts it off).
        self.stalled = False

    @property
    def streams(self) -> int:
        return len(self._streams)

    async def open(self, request: OpenRequest, body: bytes | None = None) -> Stream:
        if self.closed:
            raise TunnelUnavailable(f"the tunnel of node {self.node_id} closed")
        if len(self._streams) >= self.max_streams:
            raise StreamReset(
                ResetCode.TOO_MANY_STREAMS,
                f"the tunnel of node {self.node_id} has {self.max_streams} streams open",
            )
        payload = request.to_payload()
        stream = Stream(self, self._next_id)
        self._next_id += 1
        self._streams[stream.id] = stream
        frames = [encode(FrameType.OPEN, stream.id, payload)]
        if body is not None:  # the whole body: one message (the caller checked its size)
            if body:
                stream._send_window.available -= len(body)
                frames.append(encode(FrameType.DATA, stream.id, body))
            frames.append(encode(FrameType.END, stream.id))
            stream._sent_end = True
        try:
            await self.send(*frames)
        except ConnectionError:
            self.forget(stream.id)
            raise TunnelUnavailable(f"the tunnel of node {self.node_id} closed") from None
        except asyncio.CancelledError:
            # The OPEN still goes (the writer keeps what it was given): nobody will read this
            # stream, so the agent is told to drop it, and its place here is given back.
            self.forget(stream.id)
            reset = reset_frame(stream.id, ResetCode.CANCELLED, "the request went away")
            _detached(self.send_quietly(reset))
            raise
        return stream

    async def send(self, *frames: bytes) -> None:
        """`frames` written in order (with any other streams' sent meanwhile: `FrameWriter`);
        `ConnectionError` once the tunnel has closed or a write failed."""
        if self.closed:
            raise ConnectionError("the tunnel closed")
        await self._writer.send(*frames)

    async def send_quietly(self, message: bytes) -> None:
        """A frame whose loss changes nothing: the tunnel closing ends the stream anyway."""
        with contextlib.suppress(ConnectionError):
            await self.send(message)

    def forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    async def _write(self, message: bytes) -> None:
        try:
            await asyncio.wait_for(self._socket.send(message), WRITE_TIMEOUT)
        except TimeoutError:
            self.stalled = True
            raise ConnectionError(f"a write waited {WRITE_TIMEOUT:g} s") from None

    async def read(self) -> None:
        """Dispatch the agent's frames until the WebSocket closes."""
        while (message := await self._socket.receive()) is not None:
            self.heard_at = time.monotonic()
            frames = decode_message(message)
            if wait := self._budget.spend(len(frames)):
                await asyncio.sleep(wait)  # past its frames a second: the agent's sends wait
            for frame in frames:
                if frame.stream == 0:
                    continue  # the keepalive
                stream = self._streams.get(frame.stream)
                if stream is None:
                    continue  # one this side reset or finished: its frames in flight are dropped
                try:
                    stream._on_frame(frame.kind, frame.payload)
                except TunnelProtocolError as exc:
                    await stream.reset(exc.code, str(exc))

    def close_streams(self, message: str) -> None:
        self.closed = True
        for stream in list(self._streams.values()):
            stream._ended(StreamReset(ResetCode.TUNNEL_CLOSED, message))
        self._streams.clear()

    async def close(self, code: int, reason: str) -> None:
        self.close_streams(reason)
        with contextlib.suppress(Exception):
            await self._socket.close(code, reason)


_DETACHED: set[asyncio.Task[None]] = set()


def _detached(work: Coroutine[Any, Any, None]) -> None:
    """Run `work` beside the caller, which is being cancelled (kept until done)."""
    task = asyncio.ensure_future(work)
    _DETACHED.add(task)
    task.add_done_callback(_DETACHED.discard)


class StreamOpener(Protocol):
    """Another way to a node's replicas: through the process holding its tunnel (`peers.py`)."""

    async def open_stream(self, node_id: str, request: OpenRequest) -> Any:
        """A `peers.PeerStream`: the shape of `Stream`."""
        ...

    async def aclose(self) -> None: ...


class TunnelHub:
    """This process's tunnels by node (see the module's docstring)."""

    def __init__(self, *, max_streams: int = MAX_STREAMS, idle_timeout: float = IDLE_TIMEOUT):
        self._tunnels: dict[str, Tunnel] = {}
        self.max_streams = max_streams
        self.idle_timeout = idle_timeout
        #: Set at start where this process records its tunnels (`gateway_tunnels`).
        self.record: HolderRecord | None = None
        #: Set at start: the streams to nodes whose tunnel another process holds, and the key
        #: the replicas sign their requests to one another with (`peers.py`).
        self.peers: StreamOpener | None = None
        self.peer_key: bytes | None = None

    async def _write(self, change: Callable[[str], None], node_id: str) -> None:
        """A change to `gateway_tunnels`, on a thread; a failure is logged, nothing more (the
        tunnel serves this process's gateway whatever its row says)."""
        try:
            await asyncio.to_thread(change, node_id)
        except Exception as exc:  # noqa: BLE001 - the database away: the next tunnel retries
            log.warning(
                "could not record which process holds node %s's tunnel: %s",
                node_id,
                type(exc).__name__,
            )

    def connected(self, node_id: str) -> bool:
        tunnel = self._tunnels.get(node_id)
        return tunnel is not None and not tunnel.closed

    def nodes(self) -> list[str]:
        """The nodes whose tunnel this process holds."""
        return [node for node, tunnel in self._tunnels.items() if not tunnel.closed]

    async def open_stream(
        self, node_id: str, request: OpenRequest, *, body: bytes | None = None
    ) -> Stream:
        """A new stream to `request.replica_id` on `node_id`: OPEN sent, nothing of the body
        yet; or, given the whole `body` (at most `MAX_PAYLOAD` bytes), OPEN, the body and END in
        one message. `TunnelUnavailable` when this process holds no tunnel to that node."""
        tunnel = self._tunnels.get(node_id)
        if tunnel is None or tunnel.closed:
            raise TunnelUnavailable(f"no tunnel to node {node_id} in this process")
        if body is not None and len(body) > MAX_PAYLOAD:
            raise ValueError("a body sent with its OPEN fits one DATA frame")
        return await tunnel.open(request, body)

    async def serve(
        self,
        node_id: str,
        socket: TunnelSocket,
        *,
        still_active: Callable[[], bool],
        expired: Callable[[], bool] = lambda: False,
        watch_silence: bool = True,
    ) -> None:
        """Hold an accepted tunnel until it ends; `still_active` says whether the node's
        credential is unrevoked, `expired` whether it has expired since (memory only: both are
        asked twice a second). The agent's attempts to open it again with that credential are
        refused like its other calls. `watch_silence` False: another end watches its silence
        (the native front's tunnels, `api/gateway_native.py`, whose frames never come here)."""
        tunnel = Tunnel(node_id, socket, max_streams=self.max_streams)
        previous = self._tunnels.get(node_id)
        self._tunnels[node_id] = tunnel
        if previous is not None:
            await previous.close(CLOSE_REPLACED, "replaced by a newer tunnel of the same node")
        log.info("node %s opened its tunnel", node_id)
        record = self.record
        if record is not None:
            await self._write(record.opened, node_id)
        reader = asyncio.ensure_future(tunnel.read())
        why = "the agent closed it"
        try:
            while not reader.done():
                await asyncio.wait({reader}, timeout=_WATCH_EVERY)
                if reader.done():
                    break
                if not still_active():
                    why = "its credential was revoked"
                    await tunnel.close(CLOSE_REVOKED, "the node credential was revoked")
                    break
                if expired():
                    why = "its credential expired"
                    await tunnel.close(CLOSE_REVOKED, "the node credential expired")
                    break
                if tunnel.stalled:
                    why = f"cut off: it does not read (a write waited {WRITE_TIMEOUT:g} s)"
                    log.warning("node %s's tunnel closed: %s", node_id, why)
                    await tunnel.close(CLOSE_POLICY, "the agent does not read its tunnel")
                    break
                if watch_silence and time.monotonic() - tunnel.heard_at > self.idle_timeout:
                    why = f"silent for {self.idle_timeout:g} s"
                    await tunnel.close(CLOSE_IDLE, "the tunnel was silent")
                    break
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                exc = reader.exception()
                if isinstance(exc, TunnelProtocolError):
                    why = f"a protocol error ({exc})"
                    log.warning("node %s's tunnel closed: %s", node_id, why)
                    await tunnel.close(CLOSE_PROTOCOL, str(exc)[:120])
                else:
                    why = f"its connection failed ({type(exc).__name__})"
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            tunnel.close_streams(f"the tunnel of node {node_id} closed")
            if self._tunnels.get(node_id) is tunnel:
                del self._tunnels[node_id]
                if record is not None:
                    await self._write(record.closed, node_id)
            log.info("node %s's tunnel closed: %s", node_id, why)

    async def close_node(self, node_id: str, reason: str) -> None:
        """Close the node's tunnel (its node was deleted)."""
        tunnel = self._tunnels.get(node_id)
        if tunnel is not None:
            await tunnel.close(CLOSE_REVOKED, reason)

    async def close_all(self) -> None:
        """At shutdown: every tunnel closed, the agents reconnect to whichever process serves."""
        for tunnel in list(self._tunnels.values()):
            await tunnel.close(CLOSE_GOING_AWAY, "the control plane is stopping")
        if self.record is not None:
            # Whatever the tunnels' own endings get to write before the engine goes.
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.record.closed_all)
        if self.peers is not None:
            await self.peers.aclose()
