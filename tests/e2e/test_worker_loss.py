"""The runtime worker killed (SIGKILL) under a running service, with real processes: a control
plane on Granian, a node agent and its worker (issue 24). Its services die with it, and the API
says so within 5 s: `failed`, no URL, an error event naming the lost worker; readiness fails
naming it; the agent logs the loss once, however long it lasts. When a worker answers again the
services start there, counted as a restart, and the node is ready again."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.node import live_stack, wait_ready, wait_until
from tests.e2e.server import LiveServer

pytestmark = pytest.mark.e2e

ENV = {
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_TELEMETRY_INTERVAL_SECONDS": "2",
    "MODELFORGE_NODE_STALE_AFTER_SECONDS": "10",
    "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": "20",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
}
#: The acceptance bound: from the kill to the API showing the services down.
REPORTED_WITHIN = 5.0
#: Long enough for the agent to have met the lost worker many times (every second).
OUTAGE_SECONDS = 8


def _deploy(server: LiveServer, name: str) -> str:
    with server.client() as client:
        response = client.post(
            "/api/v1/services",
            headers=server.admin,
            json={
                "name": name,
                "command": [sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"],
                "health": {"path": "/", "interval_seconds": 0.5, "failure_threshold": 2},
                "resources": {"cpus": 0.5},
            },
        )
    assert response.status_code == 201, response.text
    return str(response.json()["service_id"])


def _service(server: LiveServer, service_id: str) -> dict[str, Any]:
    return dict(server.get(f"/api/v1/services/{service_id}"))


def _readiness(server: LiveServer, node_id: str) -> dict[str, Any]:
    return dict(server.get(f"/api/v1/admin/nodes/{node_id}/readiness"))


def test_a_killed_worker_is_reported_at_once_and_its_services_come_back(
    tmp_path: Path,
) -> None:
    with live_stack(tmp_path, ENV) as (server, node):
        node_id = node.start_worker().start_agent().node_id()
        wait_ready(server, node_id, 30)
        services = [_deploy(server, "files-a"), _deploy(server, "files-b")]
        wait_until(
            lambda: all(_service(server, s)["state"] == "healthy" for s in services),
            60,
            "the services to be healthy",
        )

        node.stop_worker(signal.SIGKILL)
        killed = time.monotonic()
        wait_until(
            lambda: all(_service(server, s)["state"] == "failed" for s in services),
            REPORTED_WITHIN + 5,
            "the services to be reported down",
            interval=0.05,
        )
        took = time.monotonic() - killed
        assert took <= REPORTED_WITHIN, f"reported down {took:.1f} s after the kill"
        for service_id in services:
            down = _service(server, service_id)
            assert down["url"] is None and down["node_id"] == node_id
            events = server.get(f"/api/v1/services/{service_id}/events")
            lost = [e for e in events if e["data"].get("code") == "RUNTIME_WORKER_LOST"]
            assert len(lost) == 1, events
            assert str(node.socket) in lost[0]["data"]["message"]

        # Readiness names it: the agent's health, and an inventory without a worker.
        wait_until(
            lambda: not _readiness(server, node_id)["ready"], 10, "readiness to fail", interval=0.2
        )
        checks = {c["name"]: c for c in _readiness(server, node_id)["checks"]}
        assert checks["agent_health"]["status"] == "fail"
        assert "runtime worker" in checks["agent_health"]["detail"]
        wait_until(
            lambda: (
                {c["name"]: c for c in _readiness(server, node_id)["checks"]}["protocol"]["status"]
                == "fail"
            ),
            10,
            "the inventory without a worker",
            interval=0.2,
        )
        assert server.get(f"/api/v1/admin/nodes/{node_id}")["state"] == "online"

        time.sleep(OUTAGE_SECONDS)
        assert node.log().count("does not answer") == 1, node.log()
        # Nothing is reported again while the outage lasts: one event per service and loss.
        for service_id in services:
            events = server.get(f"/api/v1/services/{service_id}/events")
            assert len([e for e in events if e["data"].get("code") == "RUNTIME_WORKER_LOST"]) == 1

        node.start_worker()
        wait_until(
            lambda: all(_service(server, s)["state"] == "healthy" for s in services),
            60,
            "the services to be healthy again",
        )
        for service_id in services:
            back = _service(server, service_id)
            assert back["url"] is not None and back["node_id"] == node_id
            assert back["restarts"] >= 1, back
        wait_ready(server, node_id, 30, "the node to be ready again")
        log = node.log()
        assert log.count("does not answer") == 1, log
        assert log.count("answers again after") == 1, log
