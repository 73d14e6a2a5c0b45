"""Services, models, secrets, artifact lifetime and the audit log end to end (issue 14), with real
processes: a control plane on Granian, node agents and their runtime workers.

- The seed product's bug never happens here: weights a job saved as an output, named by a model
  and a service, survive the sweep after the job is deleted, and the service starts from them;
  the ONNX service answers a standard Open Inference Protocol client (tritonclient) exactly as
  onnxruntime does on the same inputs.
- A command service killed with SIGKILL is restarted and healthy again; undeployed, no process
  of its group remains.
- A service holding a node's GPUs keeps a GPU job waiting, with a reason naming it.
- A secret scoped to `site=a` reaches only a job on a `site=a` node, and appears in no log,
  event, response, or the agent's environment.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelforge_contracts.ipc import UnixHTTPConnection
from tests.e2e.node import Node, live_stack, wait_ready, wait_until
from tests.e2e.server import LiveServer
from tests.nvml_substitute import build_fake_nvml
from tests.onnx_models import relu_matmul

pytestmark = pytest.mark.e2e

GRACE_SECONDS = 3
FAST = {
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_TELEMETRY_INTERVAL_SECONDS": "2",
    "MODELFORGE_JOB_PROGRESS_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
    "MODELFORGE_ARTIFACT_GRACE_SECONDS": str(GRACE_SECONDS),
    "MODELFORGE_ARTIFACT_SWEEP_INTERVAL_SECONDS": "0",
}
SECRET_VALUE = "mf-e2e-secret-" + hashlib.sha256(os.urandom(16)).hexdigest()[:20]

SAVE_WEIGHTS = """
import base64, pathlib
from runtime_worker.job import save_artifact


def save(model_b64):
    path = pathlib.Path("model.onnx")
    path.write_bytes(base64.b64decode(model_b64))
    return {"digest": save_artifact(path, name="weights")}
"""

READ_SECRET = """
import hashlib, os


def read():
    value = os.environ.get("SITE_A_TOKEN")
    return {"sha256": hashlib.sha256(value.encode()).hexdigest() if value else None}
"""


def _call(server: LiveServer, method: str, path: str, **kw: Any) -> Any:
    with server.client() as client:
        response = client.request(method, path, headers=server.admin, **kw)
    assert response.is_success, f"{method} {path}: {response.status_code} {response.text}"
    return response.json() if response.content else None


def _job(server: LiveServer, module: str, function: str, source: str, **body: Any) -> str:
    payload = {
        "entrypoint": {
            "kind": "python",
            "module": module,
            "function": function,
            "source": {f"{module}.py": source},
        },
        "resources": {"cpus": 0.5},
        **body,
    }
    return str(_call(server, "POST", "/api/v1/jobs", json=payload)["job_id"])


def _finished(server: LiveServer, job_id: str, timeout: float = 60) -> dict[str, Any]:
    wait_until(
        lambda: server.get(f"/api/v1/jobs/{job_id}")["state"] not in ("queued", "running"),
        timeout,
        f"job {job_id} to end",
    )
    done = dict(server.get(f"/api/v1/jobs/{job_id}"))
    assert done["state"] == "succeeded", done
    return done


def _service_state(server: LiveServer, service_id: str, state: str, timeout: float) -> dict:
    wait_until(
        lambda: server.get(f"/api/v1/services/{service_id}")["state"] == state,
        timeout,
        f"service {service_id} to be {state}",
    )
    return dict(server.get(f"/api/v1/services/{service_id}"))


def _worker_services(node: Node) -> dict[str, dict[str, Any]]:
    connection = UnixHTTPConnection(node.socket, timeout=10)
    try:
        connection.request("GET", "/v1/services")
        body = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    return {service["service_id"]: service for service in body["services"]}


def _group_members(pgid: int) -> list[int]:
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(name))
    return members


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Node]]:
    nvml = build_fake_nvml(tmp_path_factory.mktemp("nvml"))
    root = tmp_path_factory.mktemp("services")
    with live_stack(root, FAST, mode="nvidia", nvml_dir=nvml) as (server, node):
        node_id = node.start_worker().start_agent("--parallel", "2").node_id()
        wait_ready(server, node_id, 30)
        yield server, node


def test_weights_named_by_a_model_and_a_service_survive_the_sweep_and_serve(
    stack: tuple[LiveServer, Node], tmp_path: Path
) -> None:
    import onnxruntime as ort
    import tritonclient.http as triton

    server, node = stack
    weights = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.0
    model_bytes = relu_matmul(weights)
    # A job produces the weights as an output.
    job_id = _job(
        server,
        "save",
        "save",
        SAVE_WEIGHTS,
        params={"model_b64": base64.b64encode(model_bytes).decode()},
    )
    digest = _finished(server, job_id)["outputs"]["weights"]
    assert digest == "sha256:" + hashlib.sha256(model_bytes).hexdigest()
    # A model and a service name that digest; an unrelated upload names nothing.
    _call(
        server,
        "POST",
        "/api/v1/models",
        json={"name": "relu", "version": "1", "runner": "onnx", "weights": digest},
    )
    orphan = _call(server, "POST", "/api/v1/artifacts", content=b"nobody names me")["digest"]
    service = _call(
        server,
        "POST",
        "/api/v1/services",
        # A health check tuned but naming no path: the model server's readiness path, not `/`
        # (which it answers 404, restarting the service for ever).
        json={
            "name": "relu",
            "model": "relu@1",
            "resources": {"cpus": 0.5},
            "health": {"interval_seconds": 1, "failure_threshold": 2},
        },
    )
    _service_state(server, service["service_id"], "healthy", 60)
    assert server.get(f"/api/v1/services/{service['service_id']}")["restarts"] == 0
    # The job that produced the weights is deleted; both artifacts are past the grace period.
    _call(server, "DELETE", f"/api/v1/jobs/{job_id}")
    time.sleep(GRACE_SECONDS + 0.5)

    dry = _call(server, "POST", "/api/v1/admin/artifacts/sweep", json={"dry_run": True})
    assert [item["digest"] for item in dry["deleted"]] == [orphan]
    kept = {item["digest"]: item for item in dry["kept"]}
    assert digest in kept and any("relu@1" in reason for reason in kept[digest]["reasons"])
    listed = [item["digest"] for item in _call(server, "GET", "/api/v1/artifacts")]
    assert orphan in listed  # the dry run changed nothing

    swept = _call(server, "POST", "/api/v1/admin/artifacts/sweep", json={"dry_run": False})
    assert [item["digest"] for item in swept["deleted"]] == [orphan]
    listed = [item["digest"] for item in _call(server, "GET", "/api/v1/artifacts")]
    assert digest in listed and orphan not in listed

    # The control plane still holds the bytes, and the node must fetch them again: the job
    # saved them into this node's cache, which would otherwise serve the restart by itself.
    with server.client() as client:
        assert client.get(f"/api/v1/artifacts/{digest}", headers=server.admin).content == (
            model_bytes
        )
        assert client.get(f"/api/v1/artifacts/{orphan}", headers=server.admin).status_code == 404
    cached = node.root / "cache" / digest.removeprefix("sha256:")
    assert cached.is_file()
    cached.unlink()

    # The service still starts from the weights: restart it, and call it.
    _call(server, "POST", f"/api/v1/services/{service['service_id']}/restart")
    wait_until(
        lambda: server.get(f"/api/v1/services/{service['service_id']}")["restarts"] >= 1,
        30,
        "the restart",
    )
    running = _service_state(server, service["service_id"], "healthy", 60)
    assert cached.read_bytes() == model_bytes  # downloaded again from the control plane
    host_port = running["url"].removeprefix("http://")
    client = triton.InferenceServerClient(url=host_port)
    assert client.is_model_ready("relu")
    x = np.array([[1.0, -2.0, 3.0], [0.5, 0.5, 0.5]], dtype=np.float32)
    inputs = [triton.InferInput("x", list(x.shape), "FP32")]
    inputs[0].set_data_from_numpy(x)
    answer = client.infer("relu", inputs).as_numpy("y")
    expected = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]
    np.testing.assert_allclose(answer, expected, rtol=1e-6)
    _call(server, "DELETE", f"/api/v1/services/{service['service_id']}")


def test_a_killed_command_service_is_restarted_and_undeploy_ends_its_group(
    stack: tuple[LiveServer, Node],
) -> None:
    server, node = stack
    service = _call(
        server,
        "POST",
        "/api/v1/services",
        json={
            "name": "files",
            "command": [sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"],
            "health": {"path": "/", "interval_seconds": 0.5, "failure_threshold": 2},
            "restart": {"initial_backoff_seconds": 0.5, "max_backoff_seconds": 2},
            "resources": {"cpus": 0.5},
        },
    )
    service_id = service["service_id"]
    healthy = _service_state(server, service_id, "healthy", 30)
    assert healthy["url"].startswith("http://127.0.0.1:")
    # The worker runs it by its replica's id (issue 27), the one the control plane sent.
    (replica,) = healthy["replicas"]
    run_as = replica["id"]
    pid = _worker_services(node)[run_as]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: server.get(f"/api/v1/services/{service_id}")["restarts"] == 1,
        15,
        "the restart to be counted",
    )
    again = _service_state(server, service_id, "healthy", 15)
    assert again["last_exit"]["signal"] == signal.SIGKILL
    new_pid = _worker_services(node)[run_as]["pid"]
    assert new_pid != pid and _group_members(new_pid)

    _call(server, "DELETE", f"/api/v1/services/{service_id}")
    wait_until(lambda: not _group_members(new_pid), 15, "the service's group to end")
    wait_until(lambda: run_as not in _worker_services(node), 15, "the worker to forget it")


def test_a_service_holding_the_gpus_keeps_a_gpu_job_waiting(
    stack: tuple[LiveServer, Node],
) -> None:
    server, _ = stack
    service = _call(
        server,
        "POST",
        "/api/v1/services",
        json={
            "name": "gpu-holder",
            "command": [sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"],
            "resources": {"cpus": 0.5, "gpus": 2},
        },
    )
    running = _service_state(server, service["service_id"], "healthy", 30)
    assert len(running["gpus"]) == 2
    job_id = _job(server, "m", "f", "def f():\n    return 1\n", resources={"cpus": 0.5, "gpus": 1})
    wait_until(
        lambda: (
            (server.get(f"/api/v1/jobs/{job_id}")["waiting_reason"] or {}).get("code") == "NO_ROOM"
        ),
        10,
        "the NO_ROOM reason",
    )
    reason = server.get(f"/api/v1/jobs/{job_id}")["waiting_reason"]
    assert "gpu-holder" in reason["message"]
    assert server.get(f"/api/v1/jobs/{job_id}")["state"] == "queued"
    _call(server, "DELETE", f"/api/v1/services/{service['service_id']}")
    _finished(server, job_id)  # the GPUs are free again


def test_a_secret_reaches_only_its_sites_jobs_and_leaks_nowhere(
    stack: tuple[LiveServer, Node], tmp_path: Path
) -> None:
    server, node = stack
    _call(
        server,
        "PUT",
        "/api/v1/admin/secrets/SITE_A_TOKEN",
        json={"value": SECRET_VALUE, "labels": {"site": "a"}},
    )
    job_id = _job(server, "read", "read", READ_SECRET, secrets=["SITE_A_TOKEN"])
    # The running node carries no site label: the job is never placed there.
    wait_until(
        lambda: (
            (server.get(f"/api/v1/jobs/{job_id}")["waiting_reason"] or {}).get("code")
            == "NO_MATCHING_NODE"
        ),
        10,
        "the NO_MATCHING_NODE reason",
    )
    time.sleep(1.5)
    assert server.get(f"/api/v1/jobs/{job_id}")["state"] == "queued"

    token = server.mint(labels={"site": "a"})["token"]
    with Node(tmp_path / "site-a", server.url, token=token) as site_a:
        site_id = site_a.start_worker().start_agent().node_id()
        done = _finished(server, job_id)
        assert done["node_id"] == site_id
        assert done["result"]["sha256"] == hashlib.sha256(SECRET_VALUE.encode()).hexdigest()
        assert site_a.agent is not None
        environ = Path(f"/proc/{site_a.agent.pid}/environ").read_bytes()
        assert SECRET_VALUE.encode() not in environ
        logs = site_a.log() + site_a.worker_log() + node.log() + node.worker_log()

    answers = json.dumps(
        [
            server.get(f"/api/v1/jobs/{job_id}"),
            server.get(f"/api/v1/jobs/{job_id}/events"),
            server.get("/api/v1/admin/secrets"),
            server.get("/api/v1/admin/audit"),
        ]
    )
    assert SECRET_VALUE not in answers
    assert SECRET_VALUE not in logs + server.log()


def test_every_admin_action_is_audited_without_secret_values(
    stack: tuple[LiveServer, Node],
) -> None:
    server, _ = stack
    entries = server.get("/api/v1/admin/audit?limit=1000")
    actions = {entry["action"] for entry in entries}
    for action in (
        "enrollment.mint",
        "job.submit",
        "job.delete",
        "artifact.upload",
        "model.create",
        "service.deploy",
        "service.restart",
        "service.undeploy",
        "artifact.sweep",
        "secret.set",
    ):
        assert action in actions, (action, sorted(actions))
    assert all(entry["actor"] == "admin-token" for entry in entries)
    assert SECRET_VALUE not in json.dumps(entries)
