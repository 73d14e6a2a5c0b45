"""GPU assignment end to end with real processes: a control plane on Granian, an nvidia-mode
node agent over the substitute NVML (two GPUs) and its runtime worker. Each job sees exactly
the GPUs the control plane assigned it, and a CPU job none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.node import Node, live_stack, wait_ready, wait_until
from tests.e2e.server import LiveServer
from tests.nvml_substitute import EXPECTED_GPUS, build_fake_nvml

pytestmark = pytest.mark.e2e

FAST = {
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_TELEMETRY_INTERVAL_SECONDS": "2",
    "MODELFORGE_JOB_PROGRESS_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
}

VISIBLE = """
import os, time
from pathlib import Path


def devices(meet=None, parties=1):
    # With `meet`, wait until `parties` jobs are running at once before answering.
    if meet:
        Path(meet, os.environ["MODELFORGE_JOB_ID"]).touch()
        deadline = time.monotonic() + 30
        while len(os.listdir(meet)) < parties and time.monotonic() < deadline:
            time.sleep(0.05)
    return {
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "nvidia": os.environ.get("NVIDIA_VISIBLE_DEVICES"),
        "met": len(os.listdir(meet)) if meet else None,
    }
"""


@pytest.fixture(scope="module")
def gpu_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Node]]:
    nvml = build_fake_nvml(tmp_path_factory.mktemp("nvml"))
    root = tmp_path_factory.mktemp("gpu-jobs")
    with live_stack(root, FAST, mode="nvidia", nvml_dir=nvml) as (server, node):
        node_id = node.start_worker().start_agent("--parallel", "2").node_id()
        wait_ready(server, node_id, 30)
        inventory = server.get(f"/api/v1/admin/nodes/{node_id}")["inventory"]
        assert [g["uuid"] for g in inventory["gpus"]] == [g["uuid"] for g in EXPECTED_GPUS]
        yield server, node


def _submit(server: LiveServer, gpus: int, **params: Any) -> str:
    body = {
        "entrypoint": {
            "kind": "python",
            "module": "visible",
            "function": "devices",
            "source": {"visible.py": VISIBLE},
        },
        "params": params,
        "resources": {"cpus": 0.5, "gpus": gpus},
    }
    with server.client() as client:
        response = client.post("/api/v1/jobs", headers=server.admin, json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["job_id"])


def _finished(server: LiveServer, job_id: str, timeout: float = 45) -> dict[str, Any]:
    def view() -> dict[str, Any]:
        return dict(server.get(f"/api/v1/jobs/{job_id}"))

    wait_until(lambda: view()["state"] not in ("queued", "running"), timeout, "job end")
    done = view()
    assert done["state"] == "succeeded", done
    return done


def test_two_concurrent_one_gpu_jobs_see_different_gpus(
    gpu_stack: tuple[LiveServer, Node], tmp_path: Path
) -> None:
    server, _ = gpu_stack
    meet = tmp_path / "meet"
    meet.mkdir()
    jobs = [_submit(server, 1, meet=str(meet), parties=2) for _ in range(2)]
    done = [_finished(server, job_id) for job_id in jobs]
    seen = []
    for job in done:
        assert job["result"]["met"] == 2  # both ran at the same time
        (assigned,) = job["assigned_gpus"]
        assert job["result"]["cuda"] == assigned["uuid"]
        assert job["result"]["nvidia"] == assigned["uuid"]
        seen.append(assigned)
    assert sorted(seen, key=lambda gpu: gpu["index"]) == [
        {"index": index, "uuid": gpu["uuid"]} for index, gpu in enumerate(EXPECTED_GPUS)
    ]


def test_a_two_gpu_job_sees_both_and_a_cpu_job_sees_none(
    gpu_stack: tuple[LiveServer, Node],
) -> None:
    server, _ = gpu_stack
    both = _finished(server, _submit(server, 2))
    uuids = ",".join(gpu["uuid"] for gpu in EXPECTED_GPUS)
    assert [gpu["uuid"] for gpu in both["assigned_gpus"]] == [g["uuid"] for g in EXPECTED_GPUS]
    assert both["result"]["cuda"] == uuids and both["result"]["nvidia"] == uuids

    cpu = _finished(server, _submit(server, 0))
    assert cpu["assigned_gpus"] == []
    assert cpu["result"]["cuda"] == "" and cpu["result"]["nvidia"] == ""
