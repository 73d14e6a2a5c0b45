"""One address for every model (issue 27's acceptance), with real processes: a control plane on
Granian listening on a bridge's address (every test twice: the gateway in Python, then in the
native front, `MODELFORGE_GATEWAY_FRONT=native`, with Granian behind it), and two nodes (an
agent and its runtime worker each) in network namespaces of their own (tests/e2e/netns.py), so
the control plane cannot reach a port of either: everything it asks of them goes over their
agents' outbound tunnels.

- No listening port of a node is reachable from the control plane's side.
- An ONNX service with 2 replicas, one per node, answers `tritonclient.http` at the control
  plane's address with a token exactly as onnxruntime does (metadata, readiness); a command
  service answers at `/services/{name}/...`, bodies both ways.
- Hostile input: a huge body (413), a slow client (408), another service's token, a node
  credential and the admin token as tokens (401), and no error names the other service.
- A rollout to a new model version under a steady load: no failed request; a replica's node
  killed (SIGKILL of its agent and worker) under load: no failed request; a service scaled to
  zero after its idle time comes back on the next request.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import numpy as np
import pytest

from modelforge_contracts.ipc import UnixHTTPConnection
from tests.e2e.netns import Fabric, NamespacedNode, NamespacedServer, reachable
from tests.e2e.node import wait_ready, wait_until
from tests.onnx_models import mlp

pytestmark = pytest.mark.e2e

MAX_BODY = 1024 * 1024
BODY_TIMEOUT = 2.0
FAST = {
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_TELEMETRY_INTERVAL_SECONDS": "2",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
    "MODELFORGE_HEARTBEAT_FLUSH_INTERVAL_SECONDS": "0.2",
    "MODELFORGE_NODE_STALE_AFTER_SECONDS": "4",
    "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": "8",
    "MODELFORGE_GATEWAY_MAX_BODY_BYTES": str(MAX_BODY),
    "MODELFORGE_GATEWAY_BODY_TIMEOUT_SECONDS": str(BODY_TIMEOUT),
    "MODELFORGE_GATEWAY_COLD_START_SECONDS": "60",
}

#: A command service: answers any method with its path and the request body it was sent.
ECHO = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def _body(self):
        if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = []
        while True:
            size = int(self.rfile.readline().split(b";")[0], 16)
            parts.append(self.rfile.read(size))
            self.rfile.readline()
            if size == 0:
                return b"".join(parts)
    def _answer(self):
        body = self._body()
        out = self.command.encode() + b" " + self.path.encode() + b"\\n" + body
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    do_GET = do_POST = do_PUT = _answer
    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Echo).serve_forever()
"""


@dataclass
class Fleet:
    server: NamespacedServer
    nodes: list[NamespacedNode]
    node_ids: list[str]
    models: dict[str, bytes] = field(default_factory=dict)
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)

    def call(self, method: str, path: str, **kw: Any) -> Any:
        with self.server.client() as client:
            response = client.request(method, path, headers=self.server.admin, **kw)
        assert response.is_success, f"{method} {path}: {response.status_code} {response.text}"
        return response.json() if response.content else None

    def service(self, name: str) -> dict[str, Any]:
        return dict(self.call("GET", f"/api/v1/services/{self.services[name]['service_id']}"))

    def bearer(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[name]}"}

    def host_port(self) -> str:
        return self.server.url.removeprefix("http://")


def _worker_services(node: NamespacedNode) -> dict[str, dict[str, Any]]:
    connection = UnixHTTPConnection(node.socket, timeout=10)
    try:
        connection.request("GET", "/v1/services")
        body = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    return {service["service_id"]: service for service in body["services"]}


def _expected(model: bytes, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["y"], {"x": x})[0])


def _healthy_replicas(fleet: Fleet, name: str) -> list[dict[str, Any]]:
    return [r for r in fleet.service(name).get("replicas", []) if r["state"] == "healthy"]


def _deploy(fleet: Fleet, name: str, body: dict[str, Any], replicas: int, timeout: float) -> None:
    service = fleet.call("POST", "/api/v1/services", json={"name": name, **body})
    fleet.services[name] = service
    path = f"/api/v1/services/{service['service_id']}"
    try:
        wait_until(
            lambda: len(_healthy_replicas(fleet, name)) >= replicas,
            timeout,
            f"{replicas} healthy replicas of {name}",
        )
    except AssertionError:
        raise AssertionError(
            f"{fleet.service(name)}\n{fleet.call('GET', f'{path}/events')}"
        ) from None
    minted = fleet.call(
        "POST", f"{path}/access-tokens", json={"name": f"{name}-e2e", "rate_per_second": None}
    )
    fleet.tokens[name] = minted["token"]


@pytest.fixture(scope="module", params=["python", "native"])
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    """The fleet, its gateway in the control plane's Python or in its native front."""
    root = tmp_path_factory.mktemp(f"gateway-{request.param}")
    with Fabric() as fabric:
        server = fabric.server(root, {**FAST, "MODELFORGE_GATEWAY_FRONT": request.param})
        with server:
            nodes = [
                NamespacedNode(
                    root / f"node{index}",
                    server.url,
                    token=server.mint()["token"],
                    namespace=fabric.namespace(),
                )
                for index in range(2)
            ]
            try:
                node_ids = [node.start_worker().start_agent().node_id() for node in nodes]
                for node_id in node_ids:
                    wait_ready(server, node_id, 60)
                found = Fleet(server, nodes, node_ids)
                echo = root / "echo.py"  # both nodes see this machine's files
                echo.write_text(ECHO)
                for version, seed in (("1", 0), ("2", 1)):
                    model = mlp(seed=seed)
                    found.models[version] = model
                    digest = found.call("POST", "/api/v1/artifacts", content=model)["digest"]
                    found.call(
                        "POST",
                        "/api/v1/models",
                        json={
                            "name": "mlp",
                            "version": version,
                            "runner": "onnx",
                            "weights": digest,
                        },
                    )
                _deploy(
                    found,
                    "mlp",
                    {"model": "mlp@1", "replicas": 2, "resources": {"cpus": 0.5}},
                    2,
                    120,
                )
                _deploy(
                    found,
                    "echo",
                    {
                        "command": [sys.executable, str(echo), "{port}"],
                        "health": {"path": "/", "interval_seconds": 0.5},
                        "resources": {"cpus": 0.25},
                    },
                    1,
                    60,
                )
                yield found
            finally:
                for node in nodes:
                    node.__exit__(None, None, None)


# -- no inbound connection ---------------------------------------------------------------------


def test_no_port_of_a_node_is_reachable_from_the_control_planes_side(fleet: Fleet) -> None:
    replicas = fleet.service("mlp")["replicas"]
    assert sorted(r["node_id"] for r in replicas) == sorted(fleet.node_ids), replicas
    for node in fleet.nodes:
        namespace = node.namespace
        listening = namespace.listening()
        ports = {port for _, port in listening}
        # The replicas the worker runs listen in the namespace, and the check sees them.
        served = _worker_services(node)
        assert served, f"the worker of {namespace.name} runs nothing"
        for entry in served.values():
            for key in ("port", "grpc_port"):
                if entry.get(key):
                    assert entry[key] in ports, (entry, listening)
        assert ports, listening
        open_to_host = [
            f"{address}:{port}" for address, port in listening if reachable(namespace.address, port)
        ]
        assert open_to_host == [], (
            f"listening sockets of {namespace.name} reachable from the host at "
            f"{namespace.address}: {open_to_host}; the worker's services: {served}"
        )
        # The node reaches the control plane (its address is on the bridge), not the reverse.
        assert reachable(fleet.server.host, fleet.server.port)


# -- the Open Inference Protocol and /services through the gateway ----------------------------


def test_tritonclient_at_the_control_planes_address_answers_as_onnxruntime(fleet: Fleet) -> None:
    import tritonclient.http as triton  # type: ignore[import-untyped]

    # A fresh dict per call: tritonclient writes Inference-Header-Content-Length into the one it
    # is given, which a later JSON request would then carry.
    def headers() -> dict[str, str]:
        return fleet.bearer("mlp")

    client = triton.InferenceServerClient(url=fleet.host_port())
    try:
        assert client.is_server_live(headers=headers())
        assert client.is_server_ready(headers=headers())
        assert client.is_model_ready("mlp", headers=headers())
        metadata = client.get_model_metadata("mlp", headers=headers())
        assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 256]}]
        assert metadata["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 10]}]
        rng = np.random.default_rng(27)
        for rows in (1, 3, 8):
            x = rng.standard_normal((rows, 256)).astype(np.float32)
            for binary in (True, False):
                inputs = [triton.InferInput("x", list(x.shape), "FP32")]
                inputs[0].set_data_from_numpy(x, binary_data=binary)
                outputs = [triton.InferRequestedOutput("y", binary_data=binary)]
                y = client.infer("mlp", inputs, outputs=outputs, headers=headers()).as_numpy("y")
                np.testing.assert_allclose(y, _expected(fleet.models["1"], x), rtol=1e-5, atol=1e-6)
    finally:
        client.close()


def test_a_command_service_answers_at_services_name(fleet: Fleet) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB less than the bound's answer, both ways
    body = body[: MAX_BODY - 1]
    with httpx.Client(base_url=fleet.server.url, timeout=30) as client:
        got = client.get("/services/echo/some/path?x=1", headers=fleet.bearer("echo"))
        assert got.status_code == 200, got.text
        assert got.content == b"GET /some/path?x=1\n"
        posted = client.post("/services/echo/upload", content=body, headers=fleet.bearer("echo"))
        assert posted.status_code == 200, posted.text[:200]
        assert posted.content == b"POST /upload\n" + body


def test_every_request_is_counted_and_a_revoked_token_stops_within_its_second(
    fleet: Fleet,
) -> None:
    """Each request lands once in the service's traffic (through the native front's fast path
    too, reported to the control plane), and a revoked token is refused once the control
    plane's one-second check of it has run out, whichever end carries it."""
    service_id = fleet.services["echo"]["service_id"]
    path = f"/api/v1/services/{service_id}"
    minted = fleet.call(
        "POST", f"{path}/access-tokens", json={"name": "counted", "rate_per_second": None}
    )
    headers = {"Authorization": f"Bearer {minted['token']}"}

    def answered() -> int:
        return int(fleet.call("GET", f"{path}/traffic")["requests"].get("200", 0))

    time.sleep(0.6)  # the earlier tests' last requests reported (the front's, 4 times a second)
    before = answered()
    with httpx.Client(base_url=fleet.server.url, timeout=30) as client:
        for index in range(40):
            got = client.get(f"/services/echo/n{index}", headers=headers)
            assert got.status_code == 200, got.text
        wait_until(lambda: answered() - before >= 40, 10, "40 answers counted")
        time.sleep(0.6)  # a report later: none counted twice
        assert answered() - before == 40
        fleet.call("DELETE", f"{path}/access-tokens/{minted['id']}")
        revoked = time.monotonic()
        while (status := client.get("/services/echo/x", headers=headers).status_code) == 200:
            assert time.monotonic() - revoked < 2.5, "the revoked token still opens the service"
            time.sleep(0.05)
        assert status == 401


def test_the_fronts_key_is_in_no_process_argument_or_environment(fleet: Fleet) -> None:
    """With the native front, the key that makes Granian believe its client addresses reaches
    the front on its stdin and the served process in memory: no process shows it in its
    arguments or its environment (`/proc/<pid>/cmdline`, `environ`)."""
    import psutil

    assert fleet.server.process is not None
    family = [
        psutil.Process(fleet.server.process.pid),
        *psutil.Process(fleet.server.process.pid).children(recursive=True),
    ]
    fronts = [process for process in family if process.name() == "modelforge-gateway-front"]
    native = fleet.server.env().get("MODELFORGE_GATEWAY_FRONT") == "native"
    assert len(fronts) == (1 if native else 0)
    for process in family:
        assert "MODELFORGE_GATEWAY_FRONT_KEY" not in process.environ(), process.cmdline()
    for front in fronts:
        assert front.cmdline() == [front.exe()]


# -- hostile input ----------------------------------------------------------------------------


def _infer_body(rows: int = 1) -> dict[str, Any]:
    return {
        "inputs": [
            {"name": "x", "shape": [rows, 256], "datatype": "FP32", "data": [0.5] * (256 * rows)}
        ]
    }


def _refusals(fleet: Fleet) -> list[tuple[str, httpx.Response]]:
    credential = json.loads((fleet.nodes[0].state / "identity.json").read_text())["credential"]
    admin = fleet.server.admin["X-ModelForge-Admin-Token"]
    cases: list[tuple[str, str, str, dict[str, str]]] = [
        ("another service's token", "POST", "/v2/models/mlp/infer", fleet.bearer("echo")),
        ("another service's token", "GET", "/v2/models/mlp", fleet.bearer("echo")),
        ("another service's token", "GET", "/services/echo/x", fleet.bearer("mlp")),
        (
            "a node credential",
            "POST",
            "/v2/models/mlp/infer",
            {"Authorization": f"Bearer {credential}"},
        ),
        ("the admin token", "POST", "/v2/models/mlp/infer", {"Authorization": f"Bearer {admin}"}),
        ("the admin token header", "POST", "/v2/models/mlp/infer", fleet.server.admin),
        ("no token", "POST", "/v2/models/mlp/infer", {}),
        ("a wrong token", "GET", "/services/echo/x", {"Authorization": "Bearer mfs_" + "A" * 43}),
    ]
    answers = []
    with httpx.Client(base_url=fleet.server.url, timeout=30) as client:
        for what, method, path, headers in cases:
            body = _infer_body() if method == "POST" else None
            answers.append((what, client.request(method, path, json=body, headers=headers)))
    return answers


def test_wrong_tokens_are_refused_401_naming_nothing_of_another_service(fleet: Fleet) -> None:
    for what, response in _refusals(fleet):
        assert response.status_code == 401, (what, response.status_code, response.text)
        assert response.headers.get("www-authenticate", "").startswith("Bearer"), what
        error = response.json()["error"]
        assert isinstance(error, str) and error, (what, response.text)
        asked = response.request.url.path
        for name, service in fleet.services.items():
            assert service["service_id"] not in response.text, (what, response.text)
            if name not in asked:  # the other service: never named
                assert name not in response.text, (what, asked, response.text)
        for token in fleet.tokens.values():
            assert token not in response.text


def test_a_huge_body_is_refused_413(fleet: Fleet) -> None:
    with httpx.Client(base_url=fleet.server.url, timeout=30) as client:
        huge = client.post(
            "/services/echo/upload", content=b"\0" * (MAX_BODY + 1), headers=fleet.bearer("echo")
        )
        assert huge.status_code == 413, huge.text[:200]
        assert "error" in huge.json()

        def chunks() -> Iterator[bytes]:  # no Content-Length: the bound holds as it arrives
            for _ in range(MAX_BODY // 65536 + 2):
                yield b"\0" * 65536

        streamed = client.post(
            "/services/echo/upload", content=chunks(), headers=fleet.bearer("echo")
        )
        assert streamed.status_code == 413, streamed.text[:200]
        # Through the OIP path too, with a declared length far past the bound.
        declared = client.post(
            "/v2/models/mlp/infer",
            content=b"{" + b" " * (MAX_BODY + 10) + b"}",
            headers={**fleet.bearer("mlp"), "Content-Type": "application/json"},
        )
        assert declared.status_code == 413, declared.text[:200]


def test_a_slow_client_is_answered_408(fleet: Fleet) -> None:
    head = (
        f"POST /services/echo/slow HTTP/1.1\r\nHost: {fleet.host_port()}\r\n"
        f"Authorization: Bearer {fleet.tokens['echo']}\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    with socket.create_connection((fleet.server.host, fleet.server.port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(head + b"x" * 10)  # then nothing more
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert BODY_TIMEOUT * 0.8 <= waited <= BODY_TIMEOUT + 10, waited


# -- rollout, a node lost, scale to zero: under load --------------------------------------------


@dataclass
class Load:
    """A thread sending inferences through the gateway back to back until stopped."""

    fleet: Fleet
    name: str = "mlp"
    x: np.ndarray = field(default_factory=lambda: np.linspace(-1, 1, 256, dtype=np.float32))
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    answers: list[np.ndarray] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Load:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        body = {
            "inputs": [
                {"name": "x", "shape": [1, 256], "datatype": "FP32", "data": self.x.tolist()}
            ]
        }
        with httpx.Client(base_url=self.fleet.server.url, timeout=60) as client:
            while not self._stop.is_set():
                try:
                    response = client.post(
                        f"/v2/models/{self.name}/infer",
                        json=body,
                        headers=self.fleet.bearer(self.name),
                    )
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                if response.status_code != 200:
                    self.failures.append(f"{response.status_code} {response.text[:300]}")
                    continue
                self.ok += 1
                data = response.json()["outputs"][0]["data"]
                self.answers.append(np.asarray(data, dtype=np.float32))

    def seen(self, version: str) -> bool:
        want = _expected(self.fleet.models[version], self.x[None, :])[0]
        return any(np.allclose(a, want, rtol=1e-4, atol=1e-5) for a in self.answers[-50:])

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=60)


def test_a_rollout_to_a_new_model_version_under_load_fails_no_request(fleet: Fleet) -> None:
    path = f"/api/v1/services/{fleet.services['mlp']['service_id']}"
    with Load(fleet) as load:
        wait_until(lambda: load.ok >= 20, 30, "the load to run")
        assert load.seen("1")
        fleet.call("PATCH", path, json={"model": "mlp@2"})
        wait_until(
            lambda: (
                len(_healthy_replicas(fleet, "mlp")) == 2
                and all(r["revision"] >= 2 for r in fleet.service("mlp")["replicas"])
            ),
            120,
            "both replicas on the new revision",
        )
        before = load.ok
        wait_until(lambda: load.ok >= before + 20, 30, "requests after the rollout")
    assert load.failures == [], load.failures[:5]
    assert load.seen("2"), "the rollout's model never answered"
    # Still one replica per node ("distinct nodes where they can be"): a node lost loses one.
    after = _healthy_replicas(fleet, "mlp")
    assert len({r["node_id"] for r in after}) == 2, after
    listed = fleet.call("GET", f"{path}/events")
    events = json.dumps(listed)
    assert "rollout" in events.lower(), events[:2000]
    # The old replicas stopped once their agents reported no request in flight, well before
    # the drain period (30 s) that bounds a drain.
    changes: dict[str, dict[str, datetime]] = {}
    for event in listed:
        if event["kind"] == "state" and event.get("replica_id"):
            at = datetime.fromisoformat(event["at"])
            changes.setdefault(event["replica_id"], {})[event["data"]["state"]] = at
    drained = [
        c["stopped"] - c["draining"] for c in changes.values() if {"draining", "stopped"} <= set(c)
    ]
    assert len(drained) == 2 and all(d.total_seconds() < 20 for d in drained), changes


def test_a_replicas_node_killed_under_load_fails_no_request(fleet: Fleet) -> None:
    # A service of its own, placed afresh (one replica per node), whatever the rollout left.
    _deploy(
        fleet, "mlp-kill", {"model": "mlp@1", "replicas": 2, "resources": {"cpus": 0.25}}, 2, 90
    )
    replicas = _healthy_replicas(fleet, "mlp-kill")
    assert len(replicas) == 2, replicas
    # Only a replica on another node can answer once one node is gone.
    assert replicas[0]["node_id"] != replicas[1]["node_id"], replicas
    victim_id = replicas[0]["node_id"]
    victim = fleet.nodes[fleet.node_ids.index(victim_id)]
    with Load(fleet, "mlp-kill") as load:
        wait_until(lambda: load.ok >= 20, 30, "the load to run")
        victim.kill()
        killed_at = load.ok
        # Past the node's stale time, requests keep being answered by the other replica.
        wait_until(
            lambda: (
                fleet.call("GET", f"/api/v1/admin/nodes/{victim_id}")["state"]
                in ("stale", "offline")
            ),
            30,
            "the killed node to go stale",
        )
        wait_until(lambda: load.ok >= killed_at + 30, 30, "requests after the kill")
    assert load.failures == [], load.failures[:5]


def test_a_service_scaled_to_zero_comes_back_on_the_next_request(fleet: Fleet) -> None:
    name = "mlp-idle"
    service = fleet.call(
        "POST",
        "/api/v1/services",
        json={
            "name": name,
            "model": "mlp@1",
            "resources": {"cpus": 0.25},
            "autoscale": {"min": 0, "max": 1, "target_in_flight": 4, "idle_seconds": 3},
        },
    )
    fleet.services[name] = service
    path = f"/api/v1/services/{service['service_id']}"
    minted = fleet.call("POST", f"{path}/access-tokens", json={"name": "idle"})
    fleet.tokens[name] = minted["token"]
    body = _infer_body()
    with httpx.Client(base_url=fleet.server.url, timeout=90) as client:
        # Known to the gateway once its routing table has read it (an unknown name is a 401).
        wait_until(
            lambda: (
                client.get(f"/v2/models/{name}/ready", headers=fleet.bearer(name)).status_code
                in (200, 503)
            ),
            10,
            "the gateway to know the new service",
        )
        first = client.post(f"/v2/models/{name}/infer", json=body, headers=fleet.bearer(name))
        assert first.status_code == 200, first.text
        served = {r["id"] for r in fleet.service(name)["replicas"]}
        assert served, fleet.service(name)

        def running() -> set[str]:
            return {
                replica_id
                for node in fleet.nodes
                if node.worker is not None
                for replica_id in _worker_services(node)
                if replica_id in served
            }

        # Scaled to zero: no replica taking traffic, and none running on a node.
        wait_until(
            lambda: _healthy_replicas(fleet, name) == [] and not running(),
            60,
            "the scale to zero",
        )
        started = time.monotonic()
        again = client.post(f"/v2/models/{name}/infer", json=body, headers=fleet.bearer(name))
        cold = time.monotonic() - started
    assert again.status_code == 200, again.text
    expected = _expected(fleet.models["1"], np.full((1, 256), 0.5, dtype=np.float32))
    np.testing.assert_allclose(
        np.asarray(again.json()["outputs"][0]["data"], dtype=np.float32).reshape(1, 10),
        expected,
        rtol=1e-5,
        atol=1e-6,
    )
    print(f"scale from zero to the first answer: {cold:.2f} s")


def test_a_killed_front_is_started_again_and_the_gateway_serves_again(fleet: Fleet) -> None:
    """The native front owns the port: SIGKILLed, the control plane starts it again within
    seconds, the agents open their tunnels to it again, and the gateway answers as before."""
    import psutil

    assert fleet.server.process is not None
    family = psutil.Process(fleet.server.process.pid).children(recursive=True)
    fronts = [process for process in family if process.name() == "modelforge-gateway-front"]
    if fleet.server.env().get("MODELFORGE_GATEWAY_FRONT") != "native":
        assert fronts == []
        return
    (front,) = fronts
    front.kill()
    body = _infer_body()
    with httpx.Client(base_url=fleet.server.url, timeout=10) as client:

        def answers() -> bool:
            try:
                response = client.post(
                    "/v2/models/mlp/infer", json=body, headers=fleet.bearer("mlp")
                )
            except httpx.TransportError:
                return False
            return response.status_code == 200

        took = wait_until(answers, 60, "the gateway to answer through a new front")
    assert "the native gateway front exited with code" in fleet.server.log()
    print(f"the gateway answered again {took:.1f} s after its front was killed")
