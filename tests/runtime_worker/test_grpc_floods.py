"""The native gRPC front (`modelforge-grpc-front`) against clients that send it next to nothing:
the real binary, a stand-in for the model server behind it (a real HTTP server on loopback,
answering every call as ServerLive does), raw HTTP/2 written byte by byte on sockets for the
hostile clients, and grpcio for the well-behaved one, which must be served throughout.

Each test is bounded in seconds: calls that stall hold none of the places of calls running
(others are served beside them) and are ended (DEADLINE_EXCEEDED); only calls running past the
limit at once are refused at once; floods of frames that carry nothing (unknown types,
CONTINUATIONs, resets) end their own connection, leave memory bounded and other clients served;
a front out of descriptors does not spin on `accept()`."""

from __future__ import annotations

import http.server
import resource
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from runtime_worker.serving import grpc_native

LIVE = "/inference.GRPCInferenceService/ServerLive"
INFER = "/inference.GRPCInferenceService/ModelInfer"
#: ServerLiveResponse{live: true}.
LIVE_ANSWER = b"\x08\x01"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY, CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x7, 0x9
END_STREAM, END_HEADERS = 0x1, 0x4
MAX_CALLS = 4
#: The backend holds each ModelInfer until this is set (ServerLive is answered at once), and
#: counts those it took.
RELEASE = threading.Event()
RELEASE.set()
TAKEN: list[str] = []


class _Backend(http.server.ThreadingHTTPServer):
    """The model server's relay, as the front reaches it: every call answered live."""

    daemon_threads = True

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path.endswith("/ModelInfer"):
                    TAKEN.append(self.path)
                    RELEASE.wait(10)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(LIVE_ANSWER)))
                self.end_headers()
                self.wfile.write(LIVE_ANSWER)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Front:
    """The front's process, listening on `port`."""

    def __init__(self, backend: int, *flags: str, files: int | None = None) -> None:
        binary = grpc_native.BUILT
        assert binary.exists(), "the native gRPC front is not built: make install"

        def limit_files() -> None:
            if files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

        self.process = subprocess.Popen(  # noqa: S603 - our own binary
            [
                str(binary),
                *("--listen", "127.0.0.1:0", "--backend", f"127.0.0.1:{backend}"),
                *("--max-message-bytes", "65536", "--max-calls", str(MAX_CALLS)),
                *("--grace-seconds", "1", *flags),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=limit_files,  # noqa: PLW1509 - only setrlimit, before exec
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(b"token0123\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline().decode()
        assert line.startswith("listening "), line
        self.port = int(line.split()[1])

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return next(
            int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")
        )

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks

    def stop(self) -> str:
        assert self.process.stdin is not None and self.process.stderr is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        log = self.process.stderr.read().decode()
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()
        return log


@pytest.fixture(scope="module")
def backend() -> Iterator[int]:
    server = _Backend()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def front(backend: int) -> Iterator[_Front]:
    running = _Front(backend, "--first-message-seconds", "1", "--message-seconds", "2")
    yield running
    running.stop()


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)


def _frame_with(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return _frame(kind, flags, stream, payload) + payload


def _string(text: bytes) -> bytes:
    assert len(text) < 127
    return bytes([len(text)]) + text


def _call_head(path: str = INFER) -> bytes:
    """HPACK without the dynamic table: POST, http, the path, and gRPC's two headers."""
    return (
        b"\x83\x86"  # :method POST, :scheme http (static table)
        + b"\x04"
        + _string(path.encode())  # :path, a literal with an indexed name
        + b"\x01"
        + _string(b"front")  # :authority
        + b"\x0f\x10"
        + _string(b"application/grpc")  # content-type (static index 31)
        + b"\x00"
        + _string(b"te")
        + _string(b"trailers")
    )


class _Raw:
    """An HTTP/2 connection written byte by byte."""

    def __init__(self, port: int) -> None:
        self.socket = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.socket.sendall(PREFACE + _frame_with(SETTINGS, 0, 0))
        self.socket.sendall(_frame_with(SETTINGS, 0x1, 0))  # the server's, acknowledged
        self._buffer = b""

    def send(self, data: bytes) -> bool:
        """False once the front has closed the connection."""
        try:
            self.socket.sendall(data)
        except OSError:
            return False
        return True

    def frames(self, seconds: float) -> Iterator[tuple[int, int, int]]:
        """The front's frames (type, flags, stream) for up to `seconds`, until it closes."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            while len(self._buffer) >= 9:
                length = int.from_bytes(self._buffer[:3], "big")
                if len(self._buffer) < 9 + length:
                    break
                kind, flags = self._buffer[3], self._buffer[4]
                stream = int.from_bytes(self._buffer[5:9], "big") & 0x7FFFFFFF
                self._buffer = self._buffer[9 + length :]
                yield kind, flags, stream
            self.socket.settimeout(left)
            try:
                data = self.socket.recv(65536)
            except TimeoutError:
                return
            except OSError:
                data = b""
            if not data:
                yield GOAWAY, 0, 0  # closed: as good as a GOAWAY here
                return
            self._buffer += data

    def ended(self, streams: list[int], seconds: float) -> bool:
        """Whether the front ends each of `streams` (its trailers, or a reset) in `seconds`."""
        waiting = set(streams)
        for kind, flags, stream in self.frames(seconds):
            if (kind == HEADERS and flags & END_STREAM) or kind == RST_STREAM:
                waiting.discard(stream)
            if not waiting:
                return True
        return False

    def closed_within(self, seconds: float) -> bool:
        return any(kind == GOAWAY for kind, _, _ in self.frames(seconds))

    def close(self) -> None:
        self.socket.close()


def _live(port: int, timeout: float = 5.0, method: str = LIVE) -> grpc.StatusCode:
    """One call (ServerLive) on a connection of its own: its status."""
    own = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=own) as channel:
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(method)
        try:
            answer = call(b"", timeout=timeout)
        except grpc.RpcError as failed:
            return failed.code()
    assert answer == LIVE_ANSWER
    return grpc.StatusCode.OK


def test_calls_that_stall_hold_no_place_and_are_ended(front: _Front) -> None:
    # As many calls as the front runs at once, on each of two connections, sending nothing or
    # a length prefix (100 bytes to come) and stopping there.
    raws = [_Raw(front.port), _Raw(front.port)]
    streams = [1, 3, 5, 7][:MAX_CALLS]
    for raw in raws:
        for stream in streams:
            raw.send(_frame_with(HEADERS, END_HEADERS, stream, _call_head()))
            if stream % 4 == 1:
                raw.send(_frame_with(DATA, 0, stream, b"\x00" + struct.pack(">I", 100)))
    time.sleep(0.2)
    # A call takes a place only once its message is whole: another client is served all the
    # same (it was refused, RESOURCE_EXHAUSTED, while one client's stalled calls held them)...
    assert _live(front.port) == grpc.StatusCode.OK
    started = time.monotonic()
    # ...and the front ends the stalled calls (`--first-message-seconds 1`, `--message-seconds
    # 2`): each stream answered and ended, though the client still holds its connection open.
    for raw in raws:
        assert raw.ended(streams, 5) and time.monotonic() - started < 3
    raws[1].close()
    raw = raws[0]
    assert _live(front.port) == grpc.StatusCode.OK
    # A call whose message began but never ended is ended by `--message-seconds 2`.
    raw.send(_frame_with(HEADERS, END_HEADERS, 9, _call_head()))
    raw.send(_frame_with(DATA, 0, 9, b"\x00" + struct.pack(">I", 100) + b"x" * 10))
    started = time.monotonic()
    assert raw.ended([9], 5)
    assert 1.5 < time.monotonic() - started < 4
    raw.close()


def test_calls_past_the_limit_running_at_once_are_refused_at_once(front: _Front) -> None:
    # MAX_CALLS calls whose messages arrived, held by the model server: one more is refused.
    RELEASE.clear()
    TAKEN.clear()
    try:
        with ThreadPoolExecutor(MAX_CALLS) as pool:
            running = [pool.submit(_live, front.port, 10.0, INFER) for _ in range(MAX_CALLS)]
            deadline = time.monotonic() + 5
            while len(TAKEN) < MAX_CALLS:
                assert time.monotonic() < deadline, TAKEN
                time.sleep(0.01)
            started = time.monotonic()
            assert _live(front.port, 5.0, INFER) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - started < 1.0
            assert len(TAKEN) == MAX_CALLS
            RELEASE.set()
            assert [call.result() for call in running] == [grpc.StatusCode.OK] * MAX_CALLS
    finally:
        RELEASE.set()


def _flood_while_calling(front: _Front, flood: bytes, rounds: int) -> tuple[bool, int, list[float]]:
    """Send `flood` `rounds` times on one connection while a well-behaved client calls: whether
    the front closed the flooding connection, its RSS after (KiB), the calls' latencies."""
    raw = _Raw(front.port)
    latencies: list[float] = []
    closed = False
    for _ in range(rounds):
        if not raw.send(flood):
            closed = True
            break
        started = time.monotonic()
        assert _live(front.port) == grpc.StatusCode.OK
        latencies.append(time.monotonic() - started)
    closed = closed or raw.closed_within(5)
    raw.close()
    return closed, front.rss_kib(), latencies


def test_a_flood_of_unknown_frames_ends_its_connection_and_no_one_else_waits(
    front: _Front,
) -> None:
    before = front.rss_kib()
    unknown = b"".join(_frame_with(0xFA, 0, 0, b"x" * 16) for _ in range(2000))
    closed, rss, latencies = _flood_while_calling(front, unknown, rounds=20)
    assert closed
    assert rss < before + 16 * 1024, (before, rss)
    assert sorted(latencies)[len(latencies) // 2] < 0.5, latencies
    assert _live(front.port) == grpc.StatusCode.OK


def test_a_continuation_flood_ends_its_connection_and_no_one_else_waits(front: _Front) -> None:
    before = front.rss_kib()
    raw = _Raw(front.port)
    # A HEADERS that never ends, then CONTINUATIONs of one header each (RUSTSEC-2024-0332).
    assert raw.send(_frame_with(HEADERS, 0, 1, _call_head()))
    header = b"\x00" + _string(b"x-a") + _string(b"b")
    continuations = b"".join(_frame_with(CONTINUATION, 0, 1, header) for _ in range(5000))
    latencies = []
    closed = False
    for _ in range(20):
        if not raw.send(continuations):
            closed = True
            break
        started = time.monotonic()
        assert _live(front.port) == grpc.StatusCode.OK
        latencies.append(time.monotonic() - started)
    assert closed or raw.closed_within(5)
    raw.close()
    assert front.rss_kib() < before + 16 * 1024
    assert not latencies or sorted(latencies)[len(latencies) // 2] < 0.5, latencies
    assert _live(front.port) == grpc.StatusCode.OK


def test_a_rapid_reset_burst_ends_its_connection_and_no_one_else_waits(front: _Front) -> None:
    before = front.rss_kib()
    opened_and_reset = b"".join(
        _frame_with(HEADERS, END_HEADERS, stream, _call_head(LIVE))
        + _frame_with(RST_STREAM, 0, stream, struct.pack(">I", 8))  # CANCEL
        for stream in range(1, 4001, 2)
    )
    closed, rss, latencies = _flood_while_calling(front, opened_and_reset, rounds=5)
    assert closed
    assert rss < before + 16 * 1024, (before, rss)
    assert sorted(latencies)[len(latencies) // 2] < 0.5, latencies
    assert _live(front.port) == grpc.StatusCode.OK


def test_out_of_descriptors_the_front_pauses_instead_of_spinning(backend: int) -> None:
    front = _Front(backend, files=24)  # its own few (the runtime's, the listener, stdio...)
    held: list[socket.socket] = []
    try:
        for _ in range(40):  # more than it may accept: the rest wait in the backlog
            held.append(socket.create_connection(("127.0.0.1", front.port), timeout=5))
        time.sleep(0.5)
        used = front.cpu_seconds()
        time.sleep(1.5)
        assert front.cpu_seconds() - used < 0.3  # a spin would take the whole 1.5 s
        for connection in held:
            connection.close()
        held.clear()
        deadline = time.monotonic() + 10
        while _live(front.port, timeout=2) != grpc.StatusCode.OK:
            assert time.monotonic() < deadline, "the front never accepted again"
    finally:
        for connection in held:
            connection.close()
        log = front.stop()
    assert "accept failed" in log and "accepting connections again" in log, log
