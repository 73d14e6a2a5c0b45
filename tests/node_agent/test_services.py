"""The ServiceKeeper against a real runtime worker process: it starts what is wanted, restarts
on a new generation, stops what is not wanted (also after an agent restart), fetches weights
through the artifact cache, and reports each event once. The control plane, where one is
needed, is a real HTTP server on loopback answering the sync."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelforge_contracts.errors import error_body
from node_agent.artifact_cache import ArtifactCache
from node_agent.client import ControlPlane
from node_agent.config import AgentSettings
from node_agent.idle import Activity
from node_agent.services import ServiceKeeper
from tests.e2e.node import wait_until
from tests.node_agent.conftest import (
    Answer,
    Recorded,
    RecordingServer,
    agent_env,
    control_plane_client,
    run_agent,
)
from tests.runtime_worker.test_service_host import TELLS_HOST, listening_on

SYNC = "/api/v1/agent/services/sync"
WEIGHTS = b"weights of the model\n"
DIGEST = "sha256:" + hashlib.sha256(WEIGHTS).hexdigest()
#: Serves HTTP on PORT once it has read its weights (argv[1]) and found them right.
READS_WEIGHTS = f"""
import http.server, os, sys
assert open(sys.argv[1], "rb").read() == {WEIGHTS!r}
http.server.test(
    HandlerClass=http.server.SimpleHTTPRequestHandler, port=int(os.environ["PORT"]),
    bind="127.0.0.1",
)
"""


def wanted(service_id: str, generation: int = 1, **overrides: Any) -> dict[str, Any]:
    """A service as the control plane's sync answer lists it."""
    spec: dict[str, Any] = {
        "service_id": service_id,
        "generation": generation,
        "name": service_id,
        "command": [sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"],
        "runner": None,
        "weights": None,
        "params": {},
        "env": {},
        "secrets": {},
        "assigned_gpus": [],
        "resources": {"cpus": 1, "gpus": 0, "memory_mb": 128},
        "health": {"path": "/", "interval_seconds": 0.2, "timeout_seconds": 1},
        "restart": {"initial_backoff_seconds": 0.2, "max_backoff_seconds": 2},
    }
    spec.update(overrides)
    return spec


@pytest.fixture
def worker_socket(tmp_path: Path) -> Iterator[Path]:
    """A real runtime worker process listening there."""
    socket_path = tmp_path / "worker.sock"
    env = dict(os.environ, MODELFORGE_WORKER_SOCKET=str(socket_path))
    with (tmp_path / "worker.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "runtime_worker"], env=env, stderr=log)
    try:
        wait_until(socket_path.exists, 10, "the worker's socket")
        yield socket_path
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def keeper_for(
    worker_socket: Path,
    cache: ArtifactCache,
    control_plane: ControlPlane | None = None,
    service_host: str | None = "gpu-box.lan",
) -> ServiceKeeper:
    def fetch(digest: str) -> Path:
        assert control_plane is not None, "these services have no weights"
        return cache.fetch(digest, control_plane.download_artifact)

    return ServiceKeeper(
        control_plane=control_plane,
        worker_socket=worker_socket,
        agent_socket=worker_socket.parent / "agent.sock",
        fetch_weights=fetch,
        stop=threading.Event(),
        private_paths=[str(worker_socket.parent / "state")],
        service_host=service_host,
    )


def running(keeper: ServiceKeeper) -> dict[str, dict[str, Any]]:
    return {status["service_id"]: status for status in keeper.worker_view()["services"]}


def wait_state(keeper: ServiceKeeper, service_id: str, state: str, timeout: float = 15) -> None:
    wait_until(
        lambda: running(keeper).get(service_id, {}).get("state") == state,
        timeout,
        f"{service_id} {state}",
    )


def test_reconcile_starts_restarts_and_stops_what_is_not_wanted(
    worker_socket: Path, tmp_path: Path
) -> None:
    # Only what reconcile does may start or stop these: probes slow on a loaded machine must not
    # restart one (3 probes over 1 s did; a service between that kill and its restart has no
    # pid, which is how a CI run failed here once, `None == 6718`).
    health = {"path": "/", "interval_seconds": 0.2, "timeout_seconds": 5, "failure_threshold": 10}
    patient = functools.partial(wanted, health=health)

    cache = ArtifactCache(tmp_path / "cache", 1024**2)
    keeper = keeper_for(worker_socket, cache)
    keeper.reconcile([patient("svc_a"), patient("svc_b")])
    wait_state(keeper, "svc_a", "healthy")
    wait_state(keeper, "svc_b", "healthy")
    first = running(keeper)

    keeper.reconcile([patient("svc_a"), patient("svc_b")])  # nothing to do: nothing changes
    assert {k: v["pid"] for k, v in running(keeper).items()} == {
        k: v["pid"] for k, v in first.items()
    }

    keeper.reconcile([patient("svc_a", generation=2), patient("svc_b")])
    wait_until(
        lambda: (
            running(keeper)["svc_a"]["generation"] == 2
            and running(keeper)["svc_a"]["restarts"] == 1
        ),
        15,
        "svc_a at generation 2",
    )
    wait_state(keeper, "svc_a", "healthy")
    assert running(keeper)["svc_a"]["pid"] != first["svc_a"]["pid"]
    assert running(keeper)["svc_b"]["pid"] == first["svc_b"]["pid"]

    # An agent that starts again finds the worker's services and reconciles with them.
    restarted = keeper_for(worker_socket, cache)
    restarted.reconcile([patient("svc_a", generation=2)])
    now = running(restarted)
    assert list(now) == ["svc_a"]  # svc_b was stopped before the answer came
    assert now["svc_a"]["pid"] == running(keeper)["svc_a"]["pid"]
    restarted.reconcile([])
    assert running(restarted) == {}


class ControlPlaneStandIn:
    """A real HTTP server answering the sync with `desired` and serving the weights once
    `weights_served` is set; records every sync body."""

    def __init__(self) -> None:
        self.desired: list[dict[str, Any]] = []
        self.weights_served = True
        self.bodies: list[dict[str, Any]] = []
        self.server = RecordingServer(respond=self.respond)

    def respond(self, request: Recorded) -> Answer:
        if request.path == SYNC:
            self.bodies.append(json.loads(request.body))
            return 200, {"services": self.desired, "poll_interval_seconds": 0.3}
        if request.path == f"/api/v1/agent/artifacts/{DIGEST}" and self.weights_served:
            return 200, WEIGHTS
        return 404, error_body("ARTIFACT_NOT_FOUND", "no such artifact")

    def events(self, service_id: str) -> list[tuple[str, Any]]:
        return [
            (event["kind"], event["data"])
            for body in self.bodies
            for status in body["services"]
            if status["service_id"] == service_id
            for event in status["events"]
        ]


@pytest.fixture
def control_plane() -> Iterator[ControlPlaneStandIn]:
    stand_in = ControlPlaneStandIn()
    stand_in.server.start()
    yield stand_in
    stand_in.server.stop()


def test_sync_hands_over_weights_and_secrets_and_reports_each_event_once(
    worker_socket: Path,
    tmp_path: Path,
    control_plane: ControlPlaneStandIn,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "sk-" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:20]
    control_plane.desired = [
        wanted(
            "svc_w",
            command=[sys.executable, "-c", READS_WEIGHTS, "{weights}"],
            weights=DIGEST,
            secrets={"API_KEY": secret},
        )
    ]
    client = control_plane_client(control_plane.server.url)
    try:
        keeper = keeper_for(worker_socket, ArtifactCache(tmp_path / "cache", 1024**2), client)
        keeper.sync_once()  # the first report is empty; the answer starts the service
        assert control_plane.bodies[0] == {"service_host": "gpu-box.lan", "services": []}
        assert keeper.interval == 0.3
        wait_state(keeper, "svc_w", "healthy")
        keeper.in_flight = lambda replica_id: 7 if replica_id == "svc_w" else 0
        for _ in range(3):
            keeper.sync_once()
        assert os.environ.get("API_KEY") != secret
        # Told it drains (out of the gateway's rotation): its requests in flight through the
        # tunnel are reported from the next sync on, so its drain can end once none is left.
        control_plane.desired = [dict(control_plane.desired[0], draining=True)]
        keeper.sync_once()
        keeper.sync_once()
        draining = control_plane.bodies[-1]["services"][-1]
        assert draining["service_id"] == "svc_w" and draining["in_flight"] == 7
        control_plane.bodies.pop()
    finally:
        client.close()
    reported = [s for body in control_plane.bodies for s in body["services"]]
    assert reported[-1]["state"] == "healthy" and reported[-1]["generation"] == 1
    assert set(reported[-1]) == {
        "service_id",
        "generation",
        "state",
        "port",
        "restarts",
        "last_exit",
        "events",
        "log_tail",
    }
    events = control_plane.events("svc_w")
    assert events.count(("state", {"state": "starting"})) == 1
    assert events.count(("state", {"state": "healthy"})) == 1
    assert len(events) == len(running(keeper)["svc_w"]["events"])  # all of them, once each
    assert all(event["at"] for status in reported for event in status["events"])
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert secret not in logged and secret not in json.dumps(control_plane.bodies)


def test_weights_that_cannot_be_fetched_fail_the_service_once_and_are_tried_again(
    worker_socket: Path, tmp_path: Path, control_plane: ControlPlaneStandIn
) -> None:
    control_plane.weights_served = False
    control_plane.desired = [
        wanted("svc_w", command=[sys.executable, "-c", READS_WEIGHTS, "{weights}"], weights=DIGEST)
    ]
    client = control_plane_client(control_plane.server.url)
    try:
        keeper = keeper_for(worker_socket, ArtifactCache(tmp_path / "cache", 1024**2), client)
        for _ in range(4):
            keeper.sync_once()
        assert "svc_w" not in running(keeper)
        failures = [
            status
            for body in control_plane.bodies
            for status in body["services"]
            if status["service_id"] == "svc_w"
        ]
        assert len(failures) == 3  # every report after the first answer
        assert all(status["state"] == "failed" for status in failures)
        errors = control_plane.events("svc_w")
        assert len(errors) == 1 and errors[0][0] == "error"
        assert errors[0][1]["code"] == "WEIGHTS_UNAVAILABLE"
        assert "ARTIFACT_NOT_FOUND" in errors[0][1]["message"]

        control_plane.weights_served = True
        keeper.sync_once()
        wait_state(keeper, "svc_w", "healthy")
        keeper.sync_once()
        assert control_plane.bodies[-1]["services"][0]["state"] == "healthy"
    finally:
        client.close()


@pytest.mark.parametrize(
    ("host", "problem"),
    [
        ("http://gpu-box.lan", "without the scheme"),
        ("gpu-box.lan:8080", "without a port"),
        ("gpu box", "spaces"),
        ("gpu-box.lan/serve", "without a path"),
    ],
)
def test_a_service_host_that_is_not_a_host_stops_the_start(
    tmp_path: Path, host: str, problem: str
) -> None:
    result = run_agent(agent_env(tmp_path / "state", MODELFORGE_AGENT_SERVICE_HOST=host))
    assert result.returncode == 2, result.stderr
    assert "MODELFORGE_AGENT_SERVICE_HOST" in result.stderr and problem in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("host", ["gpu-box.lan", "192.0.2.10", "2001:db8::5", "[2001:db8::5]"])
def test_a_host_name_or_address_is_a_service_host(host: str) -> None:
    settings = AgentSettings(control_plane_url="https://cp.lan", service_host=host)
    assert settings.service_host == host


def test_replicas_listen_on_loopback_unless_the_node_turned_direct_access_on(
    worker_socket: Path, tmp_path: Path
) -> None:
    cache = ArtifactCache(tmp_path / "cache", 1024**2)
    direct = keeper_for(worker_socket, cache)  # names its service host: direct access on
    quiet = keeper_for(worker_socket, cache, service_host=None)
    for keeper, service_id, expected in (
        (quiet, "svc_quiet", "127.0.0.1"),
        (direct, "svc_direct", "0.0.0.0"),  # noqa: S104 - what direct access means
    ):
        out = tmp_path / service_id
        out.mkdir()
        command = [sys.executable, "-c", TELLS_HOST, "{host}"]
        keeper.reconcile([wanted(service_id, command=command, env={"OUT_DIR": str(out)})])
        wait_state(keeper, service_id, "healthy")
        assert json.loads((out / "host.json").read_text())["HOST"] == expected
        assert listening_on(running(keeper)[service_id]["port"]) == {expected}
        keeper.reconcile([])


def test_a_service_wanted_or_running_keeps_the_node_from_idling(
    worker_socket: Path, tmp_path: Path, control_plane: ControlPlaneStandIn
) -> None:
    now = [100.0]
    activity = Activity(clock=lambda: now[0])
    control_plane.desired = [wanted("svc_a")]
    client = control_plane_client(control_plane.server.url)
    try:
        keeper = keeper_for(worker_socket, ArtifactCache(tmp_path / "cache", 1024**2), client)
        keeper.activity = activity
        keeper.sync_once()  # wanted here: busy before the worker runs it
        now[0] += 50
        assert activity.idle_for() == 0
        wait_state(keeper, "svc_a", "healthy")
        control_plane.desired = []
        keeper.sync_once()  # no longer wanted, but it ran when the worker was asked: busy
        assert activity.idle_for() == 0
        assert "svc_a" not in running(keeper)  # stopped by that round
        keeper.sync_once()  # nothing wanted, nothing running: idle from now on
        now[0] += 7
        assert activity.idle_for() == 7
    finally:
        client.close()
