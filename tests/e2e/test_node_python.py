"""The node's Python end to end (issue 42): an agent started with `--python <venv>/bin/python`
runs a submitted Python job under that environment, which holds a package the runtime worker's
lacks; a job whose entrypoint asks for `"python": "worker"` still runs under the worker's.
Control plane on Granian, a cpu-mode agent and its runtime worker, all real processes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.node import live_stack, wait_ready, wait_until
from tests.e2e.server import LiveServer
from tests.node_python import PACKAGE, VALUE, make_node_python

pytestmark = pytest.mark.e2e

FAST = {
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_JOB_PROGRESS_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
}

SOURCE = f"""
import importlib.util
import sys


def where():
    found = importlib.util.find_spec("{PACKAGE}") is not None
    return {{
        "executable": sys.executable,
        "value": __import__("{PACKAGE}").VALUE if found else None,
    }}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path]]:
    root = tmp_path_factory.mktemp("node-python")
    python = make_node_python(root / "venv")
    with live_stack(root, FAST) as (server, node):
        node_id = node.start_worker().start_agent("--python", str(python)).node_id()
        wait_ready(server, node_id, 30)
        yield server, python


def _run(server: LiveServer, **entrypoint: Any) -> dict[str, Any]:
    body = {
        "entrypoint": {
            "kind": "python",
            "module": "where",
            "function": "where",
            "source": {"where.py": SOURCE},
            **entrypoint,
        }
    }
    with server.client() as client:
        response = client.post("/api/v1/jobs", headers=server.admin, json=body)
    assert response.status_code == 201, response.text
    job_id = response.json()["job_id"]
    wait_until(
        lambda: server.get(f"/api/v1/jobs/{job_id}")["state"] in {"succeeded", "failed"},
        30,
        "the job's end",
    )
    return dict(server.get(f"/api/v1/jobs/{job_id}"))


def test_a_python_job_runs_under_the_python_the_agent_was_given(
    stack: tuple[LiveServer, Path],
) -> None:
    server, python = stack
    done = _run(server)
    assert done["state"] == "succeeded", done
    assert done["result"] == {"executable": str(python), "value": VALUE}
    assert done["entrypoint"]["python"] == "node"


def test_a_job_may_ask_for_the_runtime_workers_own_python(
    stack: tuple[LiveServer, Path],
) -> None:
    server, _ = stack
    done = _run(server, python="worker")
    assert done["state"] == "succeeded", done
    assert done["result"] == {"executable": sys.executable, "value": None}


def test_an_unknown_choice_of_python_is_refused(stack: tuple[LiveServer, Path]) -> None:
    server, _ = stack
    body = {"entrypoint": {"kind": "python", "module": "m", "function": "f", "python": "conda"}}
    with server.client() as client:
        response = client.post("/api/v1/jobs", headers=server.admin, json=body)
    assert response.status_code == 422, response.text
    assert "python" in response.text
