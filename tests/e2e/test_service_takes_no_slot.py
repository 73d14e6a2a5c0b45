"""A service takes no work slot (docs/nodes.md: `--parallel` counts jobs only): a node agent
with `--parallel 1` that runs a service still claims and runs a job at the same time. Real
processes: a control plane on Granian, a node agent and its runtime worker; the job calls the
service over HTTP while it runs, so both are running at once on the one node.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.node import live_stack, wait_ready, wait_until
from tests.e2e.server import LiveServer

pytestmark = pytest.mark.e2e

FAST = {
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_TELEMETRY_INTERVAL_SECONDS": "2",
    "MODELFORGE_JOB_PROGRESS_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
}

CALL_SERVICE = """
import urllib.request


def call(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return {"status": response.status}
"""


def _call(server: LiveServer, method: str, path: str, **kw: Any) -> Any:
    with server.client() as client:
        response = client.request(method, path, headers=server.admin, **kw)
    assert response.is_success, f"{method} {path}: {response.status_code} {response.text}"
    return response.json() if response.content else None


def test_a_node_with_one_slot_runs_a_job_while_it_serves(tmp_path: Path) -> None:
    with live_stack(tmp_path, FAST) as (server, node):
        node_id = node.start_worker().start_agent("--parallel", "1").node_id()
        wait_ready(server, node_id, 30)
        service = _call(
            server,
            "POST",
            "/api/v1/services",
            json={
                "name": "files",
                "command": [sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"],
                "health": {"path": "/", "interval_seconds": 0.5, "failure_threshold": 2},
                "resources": {"cpus": 0.5},
            },
        )
        service_id = service["service_id"]
        wait_until(
            lambda: server.get(f"/api/v1/services/{service_id}")["state"] == "healthy",
            30,
            "the service to be healthy",
        )
        serving = server.get(f"/api/v1/services/{service_id}")
        assert serving["node_id"] == node_id

        job = _call(
            server,
            "POST",
            "/api/v1/jobs",
            json={
                "entrypoint": {
                    "kind": "python",
                    "module": "client",
                    "function": "call",
                    "source": {"client.py": CALL_SERVICE},
                },
                "params": {"url": serving["url"] + "/"},
                "resources": {"cpus": 0.5},
            },
        )
        job_id = job["job_id"]
        wait_until(
            lambda: server.get(f"/api/v1/jobs/{job_id}")["state"] not in ("queued", "running"),
            30,
            "the job to end: the one slot must not be held by the service",
        )
        done = server.get(f"/api/v1/jobs/{job_id}")
        assert done["state"] == "succeeded", done
        assert done["node_id"] == node_id
        # The job reached the service while it ran: both ran on the node at the same time.
        assert done["result"] == {"status": 200}
        after = server.get(f"/api/v1/services/{service_id}")
        assert after["state"] == "healthy" and after["restarts"] == 0
        _call(server, "DELETE", f"/api/v1/services/{service_id}")
