"""The agent's HTTP/1.1 client to its replicas' ports (`node_agent.local_http`), against a real
HTTP server on a real port; and the tunnel's BATCH framing both ends decode."""

from __future__ import annotations

import asyncio
import json
import socketserver
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import pytest

from modelforge_contracts.tunnel import (
    MAX_BATCH,
    FrameType,
    TunnelProtocolError,
    batch,
    decode_message,
    encode,
    window,
)
from node_agent.local_http import LengthMismatch, LocalHTTP, LocalHTTPError


class _Replica(BaseHTTPRequestHandler):
    """Echoes the request as JSON; `/chunked` answers in chunks, `/close` closes after."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding") == "chunked":
            data = b""
            while size := int(self.rfile.readline().strip(), 16):
                data += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return data
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_POST(self) -> None:
        body = self._body()
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in (b"abc", b"defg"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
            return
        answer = json.dumps(
            {
                "path": self.path,
                "body": body.decode(),
                "chunked": self.headers.get("Transfer-Encoding") == "chunked",
                "host": self.headers.get("Host"),
            }
        ).encode()
        self.send_response(201)
        self.send_header("Content-Length", str(len(answer)))
        self.send_header("X-Replica", "yes")
        if self.path == "/close":
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_POST


@contextmanager
def _replica() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Replica)
    thread = Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


async def _call(http: LocalHTTP, port: int, path: str, body: object) -> tuple[int, dict, bytes]:  # type: ignore[type-arg]
    response = await http.request(port, "POST", path, [("Content-Type", "text/plain")], body)  # type: ignore[arg-type]
    try:
        data = await response.read()
    finally:
        response.release()
    return response.status, dict(response.headers), data


def test_keeps_the_connection_and_sends_whole_or_streamed_bodies() -> None:
    async def pieces() -> AsyncIterator[bytes]:
        yield b"one,"
        yield b"two"

    async def scenario(port: int) -> None:
        http = LocalHTTP()
        status, headers, data = await _call(http, port, "/a?x=1", b"whole")
        assert status == 201 and headers["X-Replica"] == "yes"
        assert json.loads(data) == {
            "path": "/a?x=1",
            "body": "whole",
            "chunked": False,
            "host": f"127.0.0.1:{port}",
        }
        _, _, data = await _call(http, port, "/b", pieces())
        assert json.loads(data)["body"] == "one,two" and json.loads(data)["chunked"] is True
        _, _, data = await _call(http, port, "/chunked", None)
        assert data == b"abcdefg"
        assert http.opened == 1  # three exchanges, one connection
        _, _, data = await _call(http, port, "/close", b"")
        _, _, data = await _call(http, port, "/c", b"")
        assert http.opened == 2  # the replica closed it: a new one
        await http.aclose()

    with _replica() as port:
        asyncio.run(scenario(port))


def test_a_port_nobody_listens_on_is_unreached() -> None:
    async def scenario(port: int) -> None:
        with pytest.raises(LocalHTTPError) as caught:
            await LocalHTTP().request(port, "GET", "/", [], None)
        assert caught.value.reached is False

    with _replica() as port:
        free = port
    asyncio.run(scenario(free))


def test_batch_carries_frames_in_order_and_refuses_malformed_ones() -> None:
    frames = [encode(FrameType.OPEN, 3, b"{}"), encode(FrameType.DATA, 3, b"x"), window(3, 9)]
    decoded = decode_message(batch(frames))
    assert [(f.kind, f.stream) for f in decoded] == [
        (FrameType.OPEN, 3),
        (FrameType.DATA, 3),
        (FrameType.WINDOW, 3),
    ]
    assert decode_message(batch(frames[:1]))[0].payload == b"{}"  # one frame: no BATCH
    message = batch(frames)
    with pytest.raises(TunnelProtocolError, match="cut"):
        decode_message(message[:-1])
    with pytest.raises(TunnelProtocolError, match="inside a BATCH"):
        decode_message(batch([message, frames[0]]))
    with pytest.raises(TunnelProtocolError, match="over"):
        decode_message(batch([encode(FrameType.DATA, 1, b"x" * 60_000)] * 2))
    assert MAX_BATCH < 2 * 64 * 1024  # what the agent's WebSocket takes in one message


# -- framing (issue 40) ---------------------------------------------------------------------------

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
SPLIT = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n"
    b"16\r\n<h1>attacker page</h1>\r\n0\r\n\r\n"
)


#: Answers whose framing no reader may guess at, by target.
ANSWERS = {
    "/split": SPLIT,
    # Unicode digits: str.isdigit() takes them, int() does not, HTTP does not.
    "/superscript": "HTTP/1.1 200 OK\r\nContent-Length: ²\r\n\r\n".encode(),
    # A coding that does not end with chunked: the body would run to the connection's end.
    "/gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nok",
    # A chunk size int(..., 16) takes but HTTP does not.
    "/hex": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nok\r\n0\r\n\r\n",
}


class _RawReplica(socketserver.ThreadingTCPServer):
    """A replica that frames HTTP/1.1 by hand: `requests` holds each request it read whole
    (target, headers, body), `closed` counts the connections that ended; `/split` answers
    chunked with a `Content-Length: 0`, anything else `ok`."""

    daemon_threads = True

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.closed = 0
        replica = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while line := self.rfile.readline():
                    headers: dict[str, str] = {}
                    while (raw := self.rfile.readline()) not in (b"\r\n", b""):
                        name, _, value = raw.decode("latin-1").partition(":")
                        headers[name.strip().lower()] = value.strip()
                    if headers.get("transfer-encoding") == "chunked":
                        body = b""
                        while size := int(self.rfile.readline().split(b";")[0] or b"-1", 16):
                            if size < 0:
                                return  # cut: no last chunk
                            body += self.rfile.read(size)
                            self.rfile.readline()
                        self.rfile.readline()
                    else:
                        length = int(headers.get("content-length") or 0)
                        if len(body := self.rfile.read(length)) < length:
                            return  # cut short
                    target = line.split(b" ")[1].decode()
                    replica.requests.append((target, headers, body))
                    if target in ANSWERS:
                        self.wfile.write(ANSWERS[target])
                    else:
                        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

            def finish(self) -> None:
                super().finish()
                replica.closed += 1

        super().__init__(("127.0.0.1", 0), Handler)
        Thread(target=self.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def targets(self) -> list[str]:
        return [target for target, _, _ in self.requests]


async def _ended(replica: _RawReplica, connections: int) -> None:
    """Wait (bounded) until the replica saw `connections` connections end."""
    for _ in range(200):
        if replica.closed >= connections:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{replica.closed} of {connections} connections ended")


def test_the_request_is_framed_here_never_by_the_clients_headers() -> None:
    async def pieces(*parts: bytes) -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    async def scenario(replica: _RawReplica) -> None:
        http = LocalHTTP()
        both = [("Content-Length", "5"), ("Transfer-Encoding", "chunked")]
        response = await http.request(replica.port, "POST", "/both", both, b"hello")
        assert await response.read() == b"ok"
        response.release()
        target, headers, body = replica.requests[-1]
        assert (target, body, headers["content-length"]) == ("/both", b"hello", "5")
        assert "transfer-encoding" not in headers
        # Longer or shorter than declared, whole or streamed: never a complete request.
        declared = [("Content-Length", "5")]
        for body_of in (
            lambda: b"hello" + SMUGGLED,
            lambda: b"hel",
            lambda: pieces(b"hel", b"lo" + SMUGGLED),
            lambda: pieces(b"hel"),
        ):
            with pytest.raises(LengthMismatch):
                await http.request(replica.port, "POST", "/cut", declared, body_of())
        # Streamed without a length: chunked; cancelled in the middle, never completed.
        gate = asyncio.Event()

        async def stalled() -> AsyncIterator[bytes]:
            yield b"part"
            gate.set()
            await asyncio.Event().wait()

        task = asyncio.ensure_future(http.request(replica.port, "POST", "/cut", [], stalled()))
        await gate.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        response = await http.request(replica.port, "POST", "/chunked", [], pieces(b"a", b"b"))
        response.release()
        assert replica.requests[-1][1]["transfer-encoding"] == "chunked"
        assert replica.requests[-1][2] == b"ab"
        await http.aclose()
        await _ended(replica, http.opened)
        assert replica.targets() == ["/both", "/chunked"]

    with _RawReplica() as replica:
        asyncio.run(scenario(replica))


def test_an_answer_framed_two_ways_fails_and_its_connection_is_never_reused() -> None:
    async def scenario(replica: _RawReplica) -> None:
        http = LocalHTTP()
        with pytest.raises(LocalHTTPError, match="both Content-Length and Transfer-Encoding"):
            await http.request(replica.port, "GET", "/split", [], None)
        response = await http.request(replica.port, "GET", "/next", [], None)
        assert await response.read() == b"ok"
        response.release()
        assert http.opened == 2  # the split answer's connection was closed, not pooled
        await http.aclose()

    with _RawReplica() as replica:
        asyncio.run(scenario(replica))


@pytest.mark.parametrize("target", ["/superscript", "/gzip", "/hex"])
def test_an_answer_with_numbers_or_codings_http_does_not_write_fails(target: str) -> None:
    async def scenario(replica: _RawReplica) -> None:
        http = LocalHTTP()
        try:
            response = await http.request(replica.port, "GET", target, [], None)
        except LocalHTTPError:
            pass  # refused by its head
        else:  # or by its body, never read as a body
            with pytest.raises(LocalHTTPError, match="broke off"):
                await response.read()
            response.release()
        await http.aclose()

    with _RawReplica() as replica:  # bounded: a reader that guesses waits for the connection's end
        asyncio.run(asyncio.wait_for(scenario(replica), 10))
