"""The agent's HTTP/1.1 client to its replicas' ports (`node_agent.local_http`), against a real
HTTP server on a real port; and the tunnel's BATCH framing both ends decode."""

from __future__ import annotations

import asyncio
import json
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
from node_agent.local_http import LocalHTTP, LocalHTTPError


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
