"""The RSGI bridge (`control_plane.api.rsgi`) under a real Granian process: an ASGI app served
through it sees what a client sent (streamed bodies, headers, query strings, addresses, the
lifespan state), its responses reach the client whole or streamed, it is told when the client
goes away, and a failure becomes a 500 that quotes nothing. The served control plane itself runs
every other end-to-end test through it."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.rsgi_bridge_app import SECRET
from tests.e2e.server import LiveServer, free_port
from tests.factories import heartbeat_body

pytestmark = pytest.mark.e2e

_ROOT = Path(__file__).resolve().parents[2]


#: What `/file` sends: larger than one read, not a multiple of any buffer.
_FILE = bytes(range(256)) * 4099


def _granian(port: int, record: Path, **env: str) -> subprocess.Popen[bytes]:
    sent = record.with_name("sent.bin")
    sent.write_bytes(_FILE)
    granian = Path(sys.executable).parent / "granian"
    return subprocess.Popen(
        [
            str(granian),
            "--interface=rsgi",
            "--loop=uvloop",
            "--http=1",
            "--no-ws",
            "--host=127.0.0.1",
            f"--port={port}",
            "tests.e2e.rsgi_bridge_app:served",
        ],
        cwd=_ROOT,
        env={
            **os.environ,
            "BRIDGE_TEST_RECORD": str(record),
            "BRIDGE_TEST_FILE": str(sent),
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.fixture
def bridge(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    port, record = free_port(), tmp_path / "record.txt"
    record.touch()
    process = _granian(port, record)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60  # a bound, not a wait: on a loaded machine it takes longer
    while True:
        try:
            httpx.get(url + "/ready", timeout=1)
            break
        except httpx.TransportError:
            assert process.poll() is None, process.communicate()[0].decode()
            assert time.monotonic() < deadline, "granian did not start"
            time.sleep(0.1)
    try:
        yield url, record
    finally:
        process.terminate()
        output = process.communicate(timeout=20)[0].decode()
        assert process.returncode == 0, output
        assert "shutdown" in record.read_text()  # the lifespan was told to stop, and did


def _wait_for(record: Path, line: str) -> None:
    deadline = time.monotonic() + 5
    while line not in record.read_text().splitlines():
        assert time.monotonic() < deadline, (line, record.read_text())
        time.sleep(0.05)


def test_the_app_sees_the_request_as_sent(bridge: tuple[str, Path]) -> None:
    url, _ = bridge
    payload = os.urandom(3 * 1024 * 1024 + 17)

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(payload), 65536):
            yield payload[start : start + 65536]

    response = httpx.post(
        url + "/echo?label=site%3Dlab&label=gpu%3Da100&x=%C3%A9",
        content=chunks(),  # no Content-Length: sent chunked, read as it arrives
        headers=[("X-Multi", "one"), ("X-Multi", "two")],
        timeout=30,
    )
    seen = response.json()
    assert response.status_code == 200
    assert seen["size"] == len(payload)
    assert seen["sha256"] == hashlib.sha256(payload).hexdigest()
    assert seen["messages"] > 2  # streamed, not buffered whole
    assert seen["method"] == "POST" and seen["path"] == "/echo"
    assert seen["query_string"] == "label=site%3Dlab&label=gpu%3Da100&x=%C3%A9"
    assert ["x-multi", "one"] in seen["headers"] and ["x-multi", "two"] in seen["headers"]
    assert ["transfer-encoding", "chunked"] in seen["headers"]
    assert seen["client"][0] == "127.0.0.1" and isinstance(seen["client"][1], int)
    assert seen["server"] == ["127.0.0.1", int(url.rsplit(":", 1)[1])]
    assert seen["state"] == {"started": "yes"}  # the lifespan's state, in every request
    assert (seen["http_version"], seen["scheme"]) == ("1.1", "http")

    small = httpx.post(url + "/echo", content=b"abc")
    assert (small.json()["size"], small.headers["content-length"]) == (3, str(len(small.content)))


def test_a_body_cut_short_is_a_disconnect(bridge: tuple[str, Path]) -> None:
    """A client that goes away in the middle of its body is not taken to have sent less."""
    url, record = bridge
    port = int(url.rsplit(":", 1)[1])
    declared = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"a" * 4000
    chunked = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunked += b"fa0\r\n" + b"b" * 4000 + b"\r\n"  # and never the last chunk
    for request in (declared, chunked):
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(request)
            time.sleep(0.3)
        _wait_for(record, "echo: disconnect after 4000 bytes")
        record.write_text("")
    complete = httpx.post(url + "/echo", content=iter([b"c" * 4000]))  # chunked, and whole
    assert complete.json()["size"] == 4000


def test_a_streamed_response_arrives_whole(bridge: tuple[str, Path]) -> None:
    url, _ = bridge
    with httpx.stream("GET", url + "/stream", timeout=30) as response:
        assert response.status_code == 200
        received = b"".join(response.iter_bytes())
    assert received == b"".join(bytes([index]) * 16384 for index in range(64))
    sent = httpx.get(url + "/file", timeout=30)  # a file, sent by the server from its path
    assert (sent.status_code, sent.content) == (200, _FILE)
    assert sent.headers["content-type"] == "application/octet-stream"


def test_the_app_is_told_when_the_client_goes_away(bridge: tuple[str, Path]) -> None:
    url, record = bridge
    port = int(url.rsplit(":", 1)[1])
    # Waiting for an answer that never comes (a long poll), then closing.
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.5)
        assert "wait: http.disconnect" not in record.read_text()
    _wait_for(record, "wait: http.disconnect")
    # In the middle of a streamed response.
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"GET /forever HTTP/1.1\r\nHost: x\r\n\r\n")
        assert client.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(0.3)
    _wait_for(record, "forever: http.disconnect")
    assert httpx.post(url + "/echo", content=b"x").status_code == 200  # still serving


def test_a_failure_is_a_500_that_quotes_nothing(bridge: tuple[str, Path]) -> None:
    url, _ = bridge
    for path in ("/raise", "/silent", "/bad-header"):
        response = httpx.get(url + path)
        assert response.status_code == 500, path
        assert response.json()["error"]["code"] == "INTERNAL_ERROR"
        assert SECRET not in response.text
    assert "x-note" not in httpx.get(url + "/bad-header").headers  # never sent half
    started = httpx.get(url + "/started-only")  # a response started and never ended: ended
    assert (started.status_code, started.content) == (202, b"")


def test_a_failed_startup_stops_the_server(tmp_path: Path) -> None:
    port, record = free_port(), tmp_path / "record.txt"
    process = _granian(port, record, BRIDGE_TEST_FAIL_STARTUP="1")
    output = process.communicate(timeout=30)[0].decode()
    assert process.returncode != 0, output
    assert "the application did not start: the lifespan's startup.failed" in output
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/echo", timeout=1)


def test_the_served_control_plane_answers_agents_alike_on_every_path(tmp_path: Path) -> None:
    """A heartbeat answered by the route (first contact), by the fast path on RSGI (a known
    credential, Content-Length), and by the fast path behind the bridge (sent chunked) gets
    the same answer; one the fast path hands on reaches the route with its body."""
    with LiveServer(tmp_path / "cp", f"sqlite:///{tmp_path / 'cp.db'}") as server:
        node = {
            "Authorization": f"Bearer {server.enroll()['credential']}",
            "Content-Type": "application/json",
        }
        body = json.dumps(heartbeat_body()).encode()
        with server.client() as client:
            answers = [
                client.post("/api/v1/agent/heartbeat", headers=node, content=body),
                client.post("/api/v1/agent/heartbeat", headers=node, content=body),
                client.post("/api/v1/agent/heartbeat", headers=node, content=iter([body])),
            ]
            assert "transfer-encoding" not in answers[1].request.headers
            assert answers[2].request.headers["transfer-encoding"] == "chunked"
            for answer in answers:
                assert answer.status_code == 200, answer.text
                assert answer.json() == answers[0].json()
                for header in ("content-type", "content-security-policy", "referrer-policy"):
                    assert answer.headers[header] == answers[0].headers[header], header
            # A Content-Length beside chunked encoding: the body is read as chunked, so it
            # is not the fast path's to read whole; the edge counts it and stops at its limit.
            raw = (
                f"POST /api/v1/agent/heartbeat HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: {node['Authorization']}\r\nContent-Type: application/json\r\n"
                "Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n"
            ).encode()
            with socket.create_connection(("127.0.0.1", server.port)) as smuggler:
                smuggler.sendall(raw)
                smuggler.settimeout(10)
                try:
                    for _ in range(64):  # 4 MiB, past the 1 MiB limit
                        smuggler.sendall(b"10000\r\n" + b" " * 65536 + b"\r\n")
                except OSError:
                    pass  # refused and closed before it was all sent
                assert smuggler.recv(4096).startswith(b"HTTP/1.1 413"), "not refused"
            # Handed on, body intact: the route refuses what the model refuses, and a body
            # not declared JSON (as FastAPI requires), which the fast path never answers.
            extra = json.dumps({**heartbeat_body(), "extra": 1}).encode()
            undeclared = {"Authorization": node["Authorization"]}
            for headers, content in ((node, extra), (undeclared, body)):
                refused = client.post("/api/v1/agent/heartbeat", headers=headers, content=content)
                assert refused.status_code == 422, refused.text
                assert refused.json()["error"]["code"] == "INVALID_REQUEST"
