"""The tunnel (issue 27) end to end: a real control plane served by Granian (RSGI, WebSockets)
with a test door into its `TunnelHub` (tests/control_plane/tunnel_app.py, standing in for the
gateway), the agent's real end of the tunnel, and a real HTTP server on loopback as the replica.
Every byte goes HTTP -> hub -> WebSocket -> agent -> HTTP/1.1 and back. The agent's end is the
one it runs, `NativeTunnel`: the `modelforge-tunnel-relay` process `make install` builds."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from modelforge_contracts.tunnel import INITIAL_WINDOW, TUNNEL_PATH
from node_agent.tunnel import RELAY, NativeTunnel
from tests.e2e.server import LiveServer

_ROOT = Path(__file__).resolve().parents[2]
MB = 1024 * 1024


class DoorServer(LiveServer):
    """The control plane with the test door, on Granian as `modelforge-control-plane` runs."""

    def start(self, timeout: float = 30.0) -> DoorServer:
        granian = Path(sys.executable).parent / "granian"
        tls = []
        if "MODELFORGE_TLS_CERT" in self.env_overrides:  # served as the control plane serves it
            tls = [
                f"--ssl-certificate={self.env_overrides['MODELFORGE_TLS_CERT']}",
                f"--ssl-keyfile={self.env_overrides['MODELFORGE_TLS_KEY']}",
            ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    str(granian),
                    "--interface=rsgi",
                    "--loop=uvloop",
                    "--http=1",
                    "--ws",
                    "--factory",
                    "--host=127.0.0.1",
                    f"--port={self.port}",
                    *tls,
                    "tests.control_plane.tunnel_app:create",
                ],
                cwd=_ROOT,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stats(self) -> dict[str, Any]:
        stats = httpx.get(self.url + "/_tunnel_stats", timeout=10, verify=self._verify())
        return dict(stats.json())


class _Listening(http.server.ThreadingHTTPServer):
    """The replica's server, with room for a hundred connections arriving together.

    socketserver listens with a backlog of 5: the connections beyond it wait for the client's
    SYN retries (1 s, 3 s, 7 s, 15 s, 31 s after the first), and on a loaded machine the last
    of a hundred arrived after the test's 30 s. A connection the test has already given up on
    fails quietly: a traceback printed from this thread while another test runs formats its
    carets with ast.parse, whose depth counter CPython 3.11 shares between threads (a
    concurrent Hypothesis run then failed with "AST constructor recursion depth mismatch").
    """

    request_queue_size = 128
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


@dataclass
class Replica:
    """A real HTTP/1.1 server on loopback, the replica the agent forwards to."""

    server: http.server.ThreadingHTTPServer | None = None
    #: Requests waiting at /hold, released together.
    release: threading.Event = field(default_factory=threading.Event)
    holding: int = 0
    broken: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.server_address[1])

    def start(self) -> Replica:
        replica = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_POST(self) -> None:  # /echo: digest of the body, read slowly
                length = int(self.headers["content-length"])
                digest, left = hashlib.sha256(), length
                while left:
                    piece = self.rfile.read(min(left, 256 * 1024))
                    digest.update(piece)
                    left -= len(piece)
                    time.sleep(0.005)  # slower than the tunnel: the windows must hold
                self._send(
                    200, json.dumps({"sha256": digest.hexdigest(), "bytes": length}).encode()
                )

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                if path == "/bytes":
                    size = int(query.split("=")[1])
                    self.send_response(200)
                    self.send_header("content-length", str(size))
                    self.end_headers()
                    block = bytes(range(256)) * 256
                    for start in range(0, size, len(block)):
                        self.wfile.write(block[: min(len(block), size - start)])
                elif path == "/hold":
                    with replica.lock:
                        replica.holding += 1
                    replica.release.wait(30)
                    self._send(200, b"released")
                elif path == "/forever":
                    self.send_response(200)
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    try:
                        while True:
                            self.wfile.write(b"10000\r\n" + b"x" * 65536 + b"\r\n")
                            self.wfile.flush()
                    except OSError:
                        replica.broken.set()
                else:
                    self._send(
                        200, f"{self.command} {self.path} {self.headers['x-hello']}".encode()
                    )

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = _Listening(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[DoorServer]:
    data = tmp_path / "data"
    live = DoorServer(data_dir=data, database_url=f"sqlite:///{tmp_path}/cp.db")
    with live:
        yield live


@pytest.fixture
def replica() -> Iterator[Replica]:
    started = Replica().start()
    yield started
    started.stop()


@dataclass
class Agent:
    node_id: str
    credential: str
    client: NativeTunnel
    stop: threading.Event


def _agent(server: DoorServer, replica: Replica, **options: Any) -> Agent:
    assert RELAY.is_file(), "make install builds node_agent/bin/modelforge-tunnel-relay"
    enrolled = server.enroll()
    stop = threading.Event()
    client = NativeTunnel(
        binary=RELAY,
        control_plane_url=server.url,
        credential=enrolled["credential"],
        ports=lambda: {"r1": replica.port},
        stop=stop,
        **options,
    )
    client.start()
    agent = Agent(enrolled["node_id"], enrolled["credential"], client, stop)
    _wait(lambda: agent.node_id in server.stats()["nodes"], "the hub never held the tunnel")
    return agent


@pytest.fixture
def agent(server: DoorServer, replica: Replica) -> Iterator[Agent]:
    started = _agent(server, replica)
    yield started
    started.stop.set()


def _wait(check: Any, message: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def _through(server: DoorServer, agent: Agent, rest: str, replica_id: str = "r1") -> str:
    return f"{server.url}/_tunnel/{agent.node_id}/{replica_id}/{rest}"


def test_the_tunnel_is_refused_without_a_valid_credential(server: DoorServer) -> None:
    url = server.url.replace("http", "ws") + TUNNEL_PATH
    for headers in ({}, {"Authorization": "Bearer not.a.credential"}):
        with pytest.raises(InvalidStatus) as refused:
            connect(url, additional_headers=headers, open_timeout=10)
        assert refused.value.response.status_code == 401


def test_a_request_reaches_the_replica_and_its_answer_streams_back(
    server: DoorServer, agent: Agent
) -> None:
    answer = httpx.get(_through(server, agent, "hello?a=1"), headers={"x-hello": "there"})

    assert answer.status_code == 200
    assert answer.text == "GET /hello?a=1 there"


def test_ten_megabytes_both_ways_within_the_windows(server: DoorServer, agent: Agent) -> None:
    body = bytes(range(256)) * (40 * 1024)  # 10 MiB
    uploaded = httpx.post(_through(server, agent, "echo"), content=body, timeout=120)

    assert uploaded.status_code == 200
    assert uploaded.json() == {"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}
    # The replica read slower than the tunnel carried: the agent never held more than a window.
    assert 0 < agent.client.peak_buffered <= INITIAL_WINDOW

    digest, size = hashlib.sha256(), 0
    with httpx.stream(
        "GET",
        _through(server, agent, f"bytes?size={10 * MB}"),
        headers={"x-test-read-delay": "0.002"},
        timeout=120,
    ) as download:
        assert download.status_code == 200
        for piece in download.iter_raw():
            digest.update(piece)
            size += len(piece)
    block = bytes(range(256)) * 256
    assert size == 10 * MB
    assert digest.hexdigest() == hashlib.sha256(block * (10 * MB // len(block))).hexdigest()
    # Read slowly at the control plane: the hub never held more of it than the window.
    assert 0 < server.stats()["peak"] <= INITIAL_WINDOW


def test_a_hundred_streams_at_once(server: DoorServer, agent: Agent, replica: Replica) -> None:
    async def hundred() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            calls = [client.get(_through(server, agent, f"hold?{i}")) for i in range(100)]
            waiting = asyncio.gather(*calls)
            # All 100 are at the replica together before any is answered.
            deadline = time.monotonic() + 30
            while replica.holding < 100:
                assert time.monotonic() < deadline, f"only {replica.holding} arrived"
                await asyncio.sleep(0.05)
            # What a draining replica's agent reports: its requests in flight through the tunnel
            # (the native relay's count reaches the agent a few milliseconds after it changes).
            _wait(lambda: agent.client.in_flight("r1") == 100, "not 100 in flight", 5)
            assert agent.client.in_flight("r2") == 0
            replica.release.set()
            return await waiting

    answers = asyncio.run(hundred())

    assert [a.status_code for a in answers] == [200] * 100
    assert {a.text for a in answers} == {"released"}
    _wait(lambda: agent.client.in_flight("r1") == 0, "streams answered are still counted")


def test_a_client_going_away_resets_the_stream_to_the_replica(
    server: DoorServer, agent: Agent, replica: Replica
) -> None:
    with httpx.stream("GET", _through(server, agent, "forever"), timeout=30) as endless:
        assert endless.status_code == 200
        next(endless.iter_raw())
    # The client closed: the hub resets the stream, the agent drops the replica's connection.
    assert replica.broken.wait(20)
    _wait(lambda: agent.client.in_flight("r1") == 0, "a reset stream is still counted")

    unknown = httpx.get(_through(server, agent, "hello", replica_id="gone"), timeout=30)
    assert unknown.status_code == 502
    assert unknown.text == "NO_SUCH_REPLICA"
    # The tunnel still carries the next request.
    assert httpx.get(_through(server, agent, "hello"), timeout=30).status_code == 200


def test_too_many_streams_are_refused(server: DoorServer, replica: Replica) -> None:
    agent = _agent(server, replica, max_streams=3)
    try:

        async def four() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                held = [
                    asyncio.ensure_future(client.get(_through(server, agent, f"hold?{i}")))
                    for i in range(3)
                ]
                _deadline = time.monotonic() + 20
                while replica.holding < 3:
                    assert time.monotonic() < _deadline
                    await asyncio.sleep(0.05)
                refused = await client.get(_through(server, agent, "hello"))
                replica.release.set()
                return list(await asyncio.gather(*held)), refused

        held, refused = asyncio.run(four())
    finally:
        agent.stop.set()

    assert refused.status_code == 502
    assert refused.text == "TOO_MANY_STREAMS"
    assert [a.status_code for a in held] == [200] * 3


def test_a_revoked_credential_closes_the_tunnel(server: DoorServer, agent: Agent) -> None:
    with server.client() as client:
        revoked = client.post(
            f"/api/v1/admin/nodes/{agent.node_id}/credential/revoke", headers=server.admin
        )
    assert revoked.status_code == 200, revoked.text

    _wait(lambda: agent.node_id not in server.stats()["nodes"], "the tunnel stayed open", 10)
    _wait(lambda: not agent.client.connected.is_set(), "the agent still thinks it is open", 10)
    assert httpx.get(_through(server, agent, "hello"), timeout=30).status_code == 503
    # And it stays out: the agent's attempts are refused.
    time.sleep(2)
    assert agent.node_id not in server.stats()["nodes"]


def test_an_expired_credential_closes_the_tunnel(tmp_path: Path, replica: Replica) -> None:
    lifetime = 8.0  # seconds: long enough for the agent to connect on a loaded machine
    live = DoorServer(
        data_dir=tmp_path / "data",
        database_url=f"sqlite:///{tmp_path}/cp.db",
        env_overrides={"MODELFORGE_CREDENTIAL_LIFETIME_DAYS": str(lifetime / 86400)},
    )
    with live:
        enrolling = time.monotonic()
        agent = _agent(live, replica)  # its credential lasts `lifetime` from its enrollment
        try:
            assert httpx.get(_through(live, agent, "hello"), timeout=30).status_code == 200
            _wait(
                lambda: agent.node_id not in live.stats()["nodes"],
                "the tunnel outlived its credential",
                lifetime + 10,
            )
            # Closed at its expiry, not before it (`exp` is in whole seconds: up to 1 s early).
            assert time.monotonic() - enrolling >= lifetime - 1
            assert httpx.get(_through(live, agent, "hello"), timeout=30).status_code == 503
            # The agent's attempts to open it again with that credential are refused (the
            # upgrade's refusal has no body here: its other calls say why).
            url = live.url.replace("http", "ws") + TUNNEL_PATH
            bearer = {"Authorization": f"Bearer {agent.credential}"}
            with pytest.raises(InvalidStatus) as refused:
                connect(url, additional_headers=bearer, open_timeout=10)
            assert refused.value.response.status_code == 401
            with live.client() as client:
                beat = client.post("/api/v1/agent/heartbeat", headers=bearer, json={})
            assert beat.status_code == 401
            assert beat.json()["error"]["code"] == "CREDENTIAL_EXPIRED"
            time.sleep(2)
            assert agent.node_id not in live.stats()["nodes"]
        finally:
            agent.stop.set()


def test_the_agent_reconnects_after_the_control_plane_restarts(
    server: DoorServer, agent: Agent
) -> None:
    server.stop()
    _wait(lambda: not agent.client.connected.is_set(), "the agent did not see the stop", 20)
    server.start()

    _wait(lambda: agent.node_id in server.stats()["nodes"], "the agent did not come back", 40)
    assert agent.client.connections == 2
    assert httpx.get(_through(server, agent, "hello"), timeout=30).status_code == 200
