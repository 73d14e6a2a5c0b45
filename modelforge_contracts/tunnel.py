"""The tunnel (issue 27): one WebSocket an agent opens to the control plane, over which the
control plane's gateway reaches the replicas running on that node. The control plane never
dials a node: the agent connects out (`TUNNEL_PATH`, the node credential as every agent call
sends it) and the control plane opens streams inside it, one per HTTP request.

Every WebSocket message is one binary frame, `type u8 | stream u32 | payload`, or a BATCH of
them (below).

- OPEN (control plane -> agent): JSON `{"replica_id", "method", "path", "query", "headers"}`,
  at most `MAX_OPEN` bytes; `path` and `query` percent-encoded, as the replica is to get them
  (the agent puts them in the URL as they are). Stream ids are the control plane's, never 0,
  never reused within a tunnel.
- DATA (both): a piece of this direction's body, at most `MAX_PAYLOAD` bytes.
- END (both): this direction's body is complete.
- RESPONSE (agent -> control plane): JSON `{"status", "headers"}`, before any DATA.
- RESET (both): JSON `{"code", "message"}`; the stream is over in both directions.
- WINDOW (both): u32 increment of the sender's window for that stream. On stream 0 (increment
  0) it is the agent's keepalive: the control plane drops a tunnel it has heard nothing from
  for `IDLE_TIMEOUT` seconds (RSGI servers answer WebSocket pings without telling the app, so a
  ping alone cannot show the tunnel is alive there).
- BATCH (both, stream 0): several of the frames above in one WebSocket message, each as
  `length u32 | frame`, in order, at most `MAX_BATCH` bytes in all (a batch holds no batch). A
  small request's OPEN, DATA and END, or a small answer's RESPONSE, DATA and END, go as one
  message: each WebSocket message costs the control plane's server a hand-over between its
  threads, more than the frames' own work. Each side writes through one `FrameWriter`, so the
  frames of concurrent streams sent while a message is being written leave together in the next.

Flow control is per stream and direction: a sender may have at most its window in DATA payload
unacknowledged; each side starts with `INITIAL_WINDOW` and the receiver grants more (WINDOW) as
its reader consumes. A peer sending past its window is reset with `FLOW_CONTROL`. At most
`MAX_STREAMS` streams are open in a tunnel: the agent resets one more with `TOO_MANY_STREAMS`.

`SendWindow` and `ReceiveWindow` are the one accounting both sides use.

Floods are bounded by the control plane's ends (the numbers below; `native/tunnel_relay/src/
frames.rs` holds the same): a BATCH holds at most `MAX_BATCH_FRAMES` frames (both writers keep
to it; a longer one closes the tunnel, `CLOSE_PROTOCOL` with the reason); a tunnel's reader takes
`FRAMES_PER_SECOND` frames a second, `FRAME_BURST` at once (`FrameBudget`), and waits past them,
so the agent's sends wait too; a write toward the agent not done within `WRITE_TIMEOUT` means it
does not read: the tunnel is cut off (`CLOSE_POLICY`), never buffered for. WebSocket pings reach
only the native end (Granian answers them itself, one pong for the latest): more than
`PING_BURST` at once (`PINGS_PER_SECOND` after) close the tunnel there (`CLOSE_POLICY`).
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any

#: The agents' WebSocket endpoint on the control plane.
TUNNEL_PATH = "/api/v1/agent/tunnel"
INITIAL_WINDOW = 256 * 1024
MAX_PAYLOAD = 64 * 1024
MAX_OPEN = 16 * 1024
MAX_STREAMS = 256
#: The most one BATCH message holds: an OPEN and a full DATA with their headers and ENDs.
MAX_BATCH = MAX_OPEN + MAX_PAYLOAD + 64
#: How often the agent sends its keepalive (and a WebSocket ping).
KEEPALIVE_SECONDS = 10.0
#: A tunnel silent this long is dropped (by the control plane; the agent's pings time out too).
IDLE_TIMEOUT = 30.0
#: The most frames one BATCH holds.
MAX_BATCH_FRAMES = 256
#: The frames a tunnel's reader takes per second on average (a ping counts as one), and at once.
FRAMES_PER_SECOND = 20_000
FRAME_BURST = 2_000
#: The WebSocket pings an agent may send per second on average, and at once (it pings every
#: `KEEPALIVE_SECONDS`).
PINGS_PER_SECOND = 1
PING_BURST = 16
#: Seconds a write toward the agent may take; past it the agent does not read.
WRITE_TIMEOUT = 10.0
#: WebSocket close codes either side ends a tunnel with for a broken protocol, or going away;
#: the control plane's for a peer past its bounds (it does not read, or floods pings).
CLOSE_PROTOCOL = 1002
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
#: A window never grows past this (RFC 9113's limit, for the same reason: it fits in 31 bits).
_MAX_WINDOW = 2**31 - 1
_HEAD = struct.Struct(">BI")
_U32 = struct.Struct(">I")
#: Headers of one hop: never forwarded through the tunnel in either direction.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)


class FrameType(IntEnum):
    OPEN = 1
    DATA = 2
    END = 3
    RESPONSE = 4
    RESET = 5
    WINDOW = 6
    BATCH = 7


class ResetCode(StrEnum):
    #: The tunnel has `MAX_STREAMS` streams open already.
    TOO_MANY_STREAMS = "TOO_MANY_STREAMS"
    #: The other side no longer wants the stream (the client went away).
    CANCELLED = "CANCELLED"
    #: The agent runs no replica of that id, or has no port for it.
    NO_SUCH_REPLICA = "NO_SUCH_REPLICA"
    #: The replica's local port refused the connection or broke it before answering.
    UPSTREAM_UNREACHABLE = "UPSTREAM_UNREACHABLE"
    #: The replica broke the connection after its answer began.
    UPSTREAM_FAILED = "UPSTREAM_FAILED"
    #: The peer sent DATA past its window.
    FLOW_CONTROL = "FLOW_CONTROL"
    #: A malformed frame for this stream.
    PROTOCOL_ERROR = "PROTOCOL_ERROR"
    #: The tunnel closed while the stream was open.
    TUNNEL_CLOSED = "TUNNEL_CLOSED"


class TunnelProtocolError(ValueError):
    """A frame that breaks this module's rules; the tunnel (or the stream) is reset."""

    #: What a stream is reset with for it.
    code: str = ResetCode.PROTOCOL_ERROR


class FlowControlError(TunnelProtocolError):
    """DATA past the stream's window."""

    code = ResetCode.FLOW_CONTROL


@dataclass(frozen=True)
class Frame:
    kind: FrameType
    stream: int
    payload: bytes = b""


def encode(kind: FrameType, stream: int, payload: bytes = b"") -> bytes:
    return _HEAD.pack(kind, stream) + payload


_BATCH_HEAD = encode(FrameType.BATCH, 0)
_BATCH_TYPE = _BATCH_HEAD[:1]


def decode(message: bytes) -> Frame:
    """One WebSocket message as a frame; `TunnelProtocolError` for anything else."""
    if len(message) < _HEAD.size:
        raise TunnelProtocolError("a frame shorter than its header")
    kind, stream = _HEAD.unpack_from(message)
    try:
        frame_type = FrameType(kind)
    except ValueError:
        raise TunnelProtocolError(f"unknown frame type {kind}") from None
    payload = bytes(message[_HEAD.size :])
    limit = MAX_OPEN if frame_type in (FrameType.OPEN, FrameType.RESPONSE) else MAX_PAYLOAD
    if len(payload) > limit:
        raise TunnelProtocolError(f"a {frame_type.name} frame over {limit} bytes")
    if stream == 0 and frame_type is not FrameType.WINDOW:
        raise TunnelProtocolError("only the keepalive (WINDOW) and BATCH use stream 0")
    return Frame(frame_type, stream, payload)


def decode_message(message: bytes) -> list[Frame]:
    """The frames of one WebSocket message: one, or those of a BATCH in order;
    `TunnelProtocolError` for anything malformed."""
    if message[:1] != _BATCH_TYPE:
        return [decode(message)]
    if len(message) > MAX_BATCH + _HEAD.size:
        raise TunnelProtocolError(f"a BATCH over {MAX_BATCH} bytes")
    if _HEAD.unpack_from(message)[1] != 0:
        raise TunnelProtocolError("a BATCH is on stream 0")
    frames: list[Frame] = []
    at, size = _HEAD.size, len(message)
    while at < size:
        if len(frames) == MAX_BATCH_FRAMES:
            raise TunnelProtocolError(f"a BATCH of more than {MAX_BATCH_FRAMES} frames")
        if at + _U32.size > size:
            raise TunnelProtocolError("a BATCH cut inside a frame's length")
        (length,) = _U32.unpack_from(message, at)
        at += _U32.size
        if at + length > size:
            raise TunnelProtocolError("a BATCH cut inside a frame")
        inner = message[at : at + length]
        if inner[:1] == _BATCH_TYPE:
            raise TunnelProtocolError("a BATCH inside a BATCH")
        frames.append(decode(inner))
        at += length
    return frames


def batch(frames: list[bytes]) -> bytes:
    """`frames` (each `encode`d, together at most `MAX_BATCH` bytes) as one WebSocket message: a
    BATCH, or the frame itself when there is one."""
    if len(frames) == 1:
        return frames[0]
    parts = [_BATCH_HEAD]
    for frame in frames:
        parts += (_U32.pack(len(frame)), frame)
    return b"".join(parts)


class FrameWriter:
    """The one writer of a tunnel's WebSocket, on either side: frames sent while a message is
    being written wait, and go out together, as one BATCH (at most `MAX_BATCH` bytes and
    `MAX_BATCH_FRAMES` frames), once it is. Each WebSocket message costs the control plane's
    server a hand-over between its threads (the largest cost of a small request), so
    concurrent streams share them, where an
    `asyncio.Lock` around each write made every frame wait a whole hand-over of its own.
    `linger` lets the event loop run once before a message is taken, so that frames made ready
    together (answers read in the same wake-up) join it where writes never wait (a client
    library that only buffers). Frames leave in the order sent; `send` returns once its frames
    are written and raises `ConnectionError` once a write has failed (every later send too).
    A sender cancelled while waiting does not take its frames back: they follow the frames sent
    before them, so the peer sees the stream's frames in order either way."""

    def __init__(self, write: Callable[[bytes], Awaitable[None]], *, linger: bool = False) -> None:
        self._write = write
        self._linger = linger
        #: Frames not yet written, each with the future of the send it ends (else None).
        self._pending: list[tuple[bytes, asyncio.Future[None] | None]] = []
        self._task: asyncio.Task[None] | None = None
        self._failed = False
        #: How many messages were written, and how many frames they held (tests read them).
        self.messages = 0
        self.frames = 0

    async def send(self, *frames: bytes) -> None:
        if self._failed:
            raise ConnectionError("the tunnel closed")
        if not frames or any(frame[:1] == _BATCH_TYPE for frame in frames):
            raise ValueError("send frames, at least one, none of them a BATCH")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending += [(frame, None) for frame in frames[:-1]]
        self._pending.append((frames[-1], done))
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        await done

    async def _run(self) -> None:
        group: list[tuple[bytes, asyncio.Future[None] | None]] = []
        try:
            if self._linger:
                await asyncio.sleep(0)
            while self._pending:
                taken, size = 0, _HEAD.size
                for frame, _ in self._pending:
                    size += _U32.size + len(frame)
                    if taken and (size > MAX_BATCH or taken == MAX_BATCH_FRAMES):
                        break
                    taken += 1
                group, self._pending = self._pending[:taken], self._pending[taken:]
                await self._write(batch([frame for frame, _ in group]))
                self.messages += 1
                self.frames += len(group)
                for _, done in group:
                    if done is not None and not done.done():
                        done.set_result(None)
                group = []
        except BaseException as exc:
            # The transport's own closed-socket errors, or this task cancelled (the loop
            # stopping): every waiting sender is told, as every later one will be.
            self._failed = True
            waiting, self._pending = group + self._pending, []
            for _, done in waiting:
                if done is not None and not done.done():
                    failed = ConnectionError("the tunnel closed")
                    failed.__cause__ = exc  # what the transport said, for the logs
                    done.set_exception(failed)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._task = None


class FrameBudget:
    """The frames a tunnel's reader takes: `rate` a second on average, `burst` at once (a token
    bucket); `spend` says how long to wait before reading on."""

    def __init__(
        self,
        rate: float = FRAMES_PER_SECOND,
        burst: float = FRAME_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rate, self._burst, self._clock = rate, burst, clock
        self._tokens = burst
        self._at = clock()

    def spend(self, frames: int) -> float:
        """Take `frames`; the seconds until the balance is back to zero (0.0: read on)."""
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate) - frames
        self._at = now
        return 0.0 if self._tokens >= 0 else -self._tokens / self._rate


def keepalive() -> bytes:
    return encode(FrameType.WINDOW, 0, _U32.pack(0))


def window(stream: int, increment: int) -> bytes:
    return encode(FrameType.WINDOW, stream, _U32.pack(increment))


def reset_frame(stream: int, code: str, message: str) -> bytes:
    """A RESET frame: `stream` is over in both directions, for `code`."""
    return encode(FrameType.RESET, stream, Reset(code, message).to_payload())


def parse_window(payload: bytes) -> int:
    if len(payload) != _U32.size:
        raise TunnelProtocolError("a WINDOW frame's payload is 4 bytes")
    return int(_U32.unpack(payload)[0])


Headers = list[tuple[str, str]]


@dataclass(frozen=True)
class OpenRequest:
    replica_id: str
    method: str
    path: str
    query: str
    headers: Headers

    def to_payload(self) -> bytes:
        body = {
            "replica_id": self.replica_id,
            "method": self.method,
            "path": self.path,
            "query": self.query,
            "headers": [list(pair) for pair in self.headers],
        }
        payload = json.dumps(body, separators=(",", ":")).encode()
        if len(payload) > MAX_OPEN:
            raise TunnelProtocolError(f"the request's head is over {MAX_OPEN} bytes")
        return payload

    @classmethod
    def from_payload(cls, payload: bytes) -> OpenRequest:
        body = _object(payload, "OPEN")
        fields = [body.get(name) for name in ("replica_id", "method", "path", "query")]
        if not all(isinstance(value, str) for value in fields):
            raise TunnelProtocolError("an OPEN frame needs replica_id, method, path and query")
        replica_id, method, path, query = (str(value) for value in fields)
        if not path.startswith("/"):
            raise TunnelProtocolError("an OPEN frame's path starts with /")
        return cls(replica_id, method, path, query, _headers(body.get("headers")))


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: Headers

    def to_payload(self) -> bytes:
        body = {"status": self.status, "headers": [list(pair) for pair in self.headers]}
        payload = json.dumps(body, separators=(",", ":")).encode()
        if len(payload) > MAX_OPEN:
            raise TunnelProtocolError(f"the response's head is over {MAX_OPEN} bytes")
        return payload

    @classmethod
    def from_payload(cls, payload: bytes) -> ResponseHead:
        body = _object(payload, "RESPONSE")
        status = body.get("status")
        if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
            raise TunnelProtocolError("a RESPONSE frame's status is an HTTP status")
        return cls(status, _headers(body.get("headers")))


@dataclass(frozen=True)
class Reset:
    code: str
    message: str

    def to_payload(self) -> bytes:
        return json.dumps({"code": self.code, "message": self.message[:500]}).encode()

    @classmethod
    def from_payload(cls, payload: bytes) -> Reset:
        try:
            body = _object(payload, "RESET")
        except TunnelProtocolError:
            return cls(ResetCode.PROTOCOL_ERROR, "a RESET frame without a readable reason")
        return cls(str(body.get("code", ResetCode.PROTOCOL_ERROR)), str(body.get("message", "")))


def forwarded(headers: Headers) -> Headers:
    """`headers` less those of one hop (`HOP_BY_HOP`)."""
    return [(name, value) for name, value in headers if name.lower() not in HOP_BY_HOP]


def _object(payload: bytes, kind: str) -> dict[str, Any]:
    try:
        body = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise TunnelProtocolError(f"a {kind} frame's payload is not JSON") from None
    if not isinstance(body, dict):
        raise TunnelProtocolError(f"a {kind} frame's payload is a JSON object")
    return body


def _headers(value: Any) -> Headers:
    if not isinstance(value, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(s, str) for s in pair)
        for pair in value
    ):
        raise TunnelProtocolError("headers are a list of [name, value] pairs of strings")
    return [(str(name), str(text)) for name, text in value]


class SendWindow:
    """How much DATA this side may still send on a stream; `take` waits for a grant."""

    def __init__(self, initial: int = INITIAL_WINDOW) -> None:
        self.available = initial
        self._granted = asyncio.Event()
        self._closed = False

    def grant(self, increment: int) -> None:
        if self.available + increment > _MAX_WINDOW:
            raise TunnelProtocolError("a WINDOW past 2**31 - 1")
        self.available += increment
        if self.available > 0:
            self._granted.set()

    async def take(self, wanted: int) -> int:
        """Up to `wanted` bytes of window, at least 1, once there is some; 0 when closed."""
        while self.available <= 0 and not self._closed:
            self._granted.clear()
            await self._granted.wait()
        if self._closed:
            return 0
        taken = min(wanted, self.available)
        self.available -= taken
        return taken

    def close(self) -> None:
        self._closed = True
        self._granted.set()


async def send_data(
    send: Callable[[bytes], Awaitable[None]], stream: int, data: bytes, window: SendWindow
) -> bool:
    """`data` as DATA frames on `stream`, each as large as `window` lets (at most
    `MAX_PAYLOAD`); False when the window closed before all of it went (the stream is over)."""
    view = memoryview(data)
    while view:
        taken = await window.take(min(len(view), MAX_PAYLOAD))
        if not taken:
            return False
        await send(encode(FrameType.DATA, stream, bytes(view[:taken])))
        view = view[taken:]
    return True


class ReceiveWindow:
    """What the peer may still send on a stream, and when to grant it more: once the reader has
    consumed half the initial window, all of it is granted back at once (fewer WINDOW frames)."""

    def __init__(self, initial: int = INITIAL_WINDOW) -> None:
        self.initial = initial
        self.remaining = initial
        self._consumed = 0
        #: Received, not yet consumed: what this side holds for the stream.
        self.buffered = 0
        #: The most it ever held at once.
        self.peak = 0

    def received(self, size: int) -> None:
        """DATA of `size` bytes arrived; `FlowControlError` past the window."""
        if size > self.remaining:
            raise FlowControlError("DATA past the stream's window")
        self.remaining -= size
        self.buffered += size
        self.peak = max(self.peak, self.buffered)

    def consumed(self, size: int) -> int:
        """The reader took `size` bytes; the increment to grant now (0: none yet)."""
        self.buffered -= size
        self._consumed += size
        if self._consumed < self.initial // 2:
            return 0
        increment, self._consumed = self._consumed, 0
        self.remaining += increment
        return increment
