"""A service takes no work slot (docs/nodes.md: `--parallel` counts jobs only): a node agent
with `--parallel 1` that runs a service still claims and runs a job at the same time. Real
processes: a control plane on Granian, a node agent and its runtime worker; the job calls the
service over HTTP while it runs, so both are running at once on the one node.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e.node import live_stack, wait_ready
from tests.e2e.test_services import _call, _finished, _job, _service_state

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
        serving = _service_state(server, service_id, "healthy", 30)
        assert serving["node_id"] == node_id

        # The one slot must not be held by the service: the job runs and ends.
        job_id = _job(server, "client", "call", CALL_SERVICE, params={"url": serving["url"] + "/"})
        done = _finished(server, job_id, 30)
        assert done["node_id"] == node_id
        # The job reached the service while it ran: both ran on the node at the same time.
        assert done["result"] == {"status": 200}
        after = server.get(f"/api/v1/services/{service_id}")
        assert after["state"] == "healthy" and after["restarts"] == 0
        _call(server, "DELETE", f"/api/v1/services/{service_id}")
