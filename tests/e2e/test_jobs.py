"""Jobs end to end with real processes: control plane on Granian, a
cpu-mode node agent and its runtime worker. The model actually runs."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from tests.e2e.node import Node, wait_until
from tests.e2e.server import LiveServer

pytestmark = pytest.mark.e2e

FAST = {
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_TELEMETRY_INTERVAL_SECONDS": "2",
    "MODELFORGE_NODE_STALE_AFTER_SECONDS": "5",
    "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": "10",
    "MODELFORGE_JOB_PROGRESS_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_JOB_CONTACT_TIMEOUT_SECONDS": "3",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
}

PIPELINE = """
import os, subprocess, sys
from pathlib import Path
from runtime_worker.job import emit, save_artifact

import helpers


def run(n, text):
    for i in range(n):
        emit({"step": i})
    out = Path("out.txt")
    out.write_text(helpers.shout(text))
    digest = save_artifact(out, name="report")
    return {"digest": digest, "env_has_token": any("TOKEN" in k for k in os.environ)}


def linger():
    child = subprocess.Popen(["sleep", "300"])
    emit({"pids": [os.getpid(), child.pid]})
    child.wait()


def too_long():
    import time
    while True:
        emit({"tick": True})
        time.sleep(0.2)


def quiet():
    import time
    time.sleep(300)


def not_a_number():
    return {"loss": float("nan")}


def infinite_event():
    emit({"loss": float("inf")})
    return "not reached"


def raw_nan_event():
    # Past the helpers, straight into the events pipe.
    os.write(int(os.environ["MODELFORGE_JOB_EVENTS_FD"]), b'{"kind":"event","data":NaN}\\n')
    return "done"


def careful():
    try:
        emit({"loss": float("nan")})
    except ValueError as exc:
        emit({"refused": str(exc)})
    return "ok"
"""
HELPERS = "def shout(text):\n    return text.upper() + '!'\n"
SOURCE = {"pipeline.py": PIPELINE, "helpers.py": HELPERS}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Node]]:
    root = tmp_path_factory.mktemp("jobs")
    with LiveServer(root / "cp", f"sqlite:///{root / 'cp.db'}", env_overrides=FAST) as server:
        node = Node(root / "node", server.url, token=server.mint()["token"])
        with node:
            node.start_worker().start_agent("--parallel", "2")
            node_id = node.node_id()
            wait_until(
                lambda: server.get(f"/api/v1/admin/nodes/{node_id}/readiness")["ready"],
                30,
                "node readiness",
            )
            yield server, node


def _submit(server: LiveServer, function: str, **extra: Any) -> dict[str, Any]:
    body = {
        "entrypoint": {
            "kind": "python",
            "module": "pipeline",
            "function": function,
            "source": SOURCE,
        },
        **extra,
    }
    with server.client() as client:
        response = client.post("/api/v1/jobs", headers=server.admin, json=body)
    assert response.status_code == 201, response.text
    return dict(response.json())


def _job(server: LiveServer, job_id: str) -> dict[str, Any]:
    return dict(server.get(f"/api/v1/jobs/{job_id}"))


def _wait_state(
    server: LiveServer, job_id: str, states: set[str], timeout: float
) -> dict[str, Any]:
    wait_until(lambda: _job(server, job_id)["state"] in states, timeout, f"job {states}")
    return _job(server, job_id)


def _events(server: LiveServer, job_id: str) -> list[dict[str, Any]]:
    return list(server.get(f"/api/v1/jobs/{job_id}/events"))


def test_python_job_from_submitted_source(stack: tuple[LiveServer, Node]) -> None:
    server, _ = stack
    job = _submit(server, "run", params={"n": 5, "text": "hello"})
    done = _wait_state(server, job["job_id"], {"succeeded", "failed"}, 30)
    assert done["state"] == "succeeded", done
    steps = [
        e["data"]["step"]
        for e in _events(server, job["job_id"])
        if e["kind"] == "event" and "step" in (e["data"] or {})
    ]
    assert steps == [0, 1, 2, 3, 4]
    digest = done["result"]["digest"]
    assert done["outputs"] == {"report": digest}
    assert done["result"]["env_has_token"] is False  # credential-like variables filtered
    with server.client() as client:
        content = client.get(f"/api/v1/artifacts/{digest}", headers=server.admin).content
    assert content == b"HELLO!"
    assert "sha256:" + hashlib.sha256(content).hexdigest() == digest


def test_onnx_model_runs_on_the_node(stack: tuple[LiveServer, Node], tmp_path: Path) -> None:
    server, _ = stack
    weights = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Relu", ["xw"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor("w", TensorProto.FLOAT, [4, 3], weights.flatten().tolist())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    model_bytes = model.SerializeToString()
    x = np.random.default_rng(7).standard_normal((5, 4)).astype(np.float32)
    feed = io.BytesIO()
    np.savez(feed, x=x)
    with server.client() as client:
        model_digest = client.post(
            "/api/v1/artifacts", headers=server.admin, content=model_bytes
        ).json()["digest"]
        tensors = client.post(
            "/api/v1/artifacts", headers=server.admin, content=feed.getvalue()
        ).json()["digest"]
        job = client.post(
            "/api/v1/jobs",
            headers=server.admin,
            json={
                "entrypoint": {"kind": "onnx", "model": model_digest},
                "inputs": {"tensors": tensors},
            },
        ).json()
    done = _wait_state(server, job["job_id"], {"succeeded", "failed"}, 60)
    assert done["state"] == "succeeded", done
    assert done["result"]["provider"] == "CPUExecutionProvider"
    with server.client() as client:
        outputs = client.get(
            f"/api/v1/artifacts/{done['outputs']['outputs']}", headers=server.admin
        ).content
    expected = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]
    with np.load(io.BytesIO(outputs)) as result:
        np.testing.assert_allclose(result["y"], expected, rtol=1e-6)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes; read its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _pids(server: LiveServer, job_id: str) -> list[int]:
    for event in _events(server, job_id):
        if event["kind"] == "event" and "pids" in (event["data"] or {}):
            return list(event["data"]["pids"])
    return []


def test_cancel_kills_the_whole_group(stack: tuple[LiveServer, Node]) -> None:
    server, _ = stack
    job = _submit(server, "linger")
    wait_until(lambda: len(_pids(server, job["job_id"])) == 2, 30, "the job's pids")
    pids = _pids(server, job["job_id"])
    assert all(_alive(pid) for pid in pids)
    with server.client() as client:
        client.post(f"/api/v1/jobs/{job['job_id']}/cancel", headers=server.admin)
    started = time.monotonic()
    wait_until(lambda: not any(_alive(pid) for pid in pids), 2, "job and grandchild gone")
    assert time.monotonic() - started <= 2
    final = _wait_state(server, job["job_id"], {"cancelled"}, 10)
    assert final["error"]["code"] == "JOB_CANCELLED"


def test_timeout_and_silence_have_distinct_codes(stack: tuple[LiveServer, Node]) -> None:
    server, _ = stack
    timed = _submit(server, "too_long", timeout_seconds=2, silence_timeout_seconds=60)
    silent = _submit(server, "quiet", timeout_seconds=60, silence_timeout_seconds=2)
    timed_out = _wait_state(server, timed["job_id"], {"failed", "succeeded"}, 20)
    went_silent = _wait_state(server, silent["job_id"], {"failed", "succeeded"}, 20)
    assert timed_out["error"]["code"] == "JOB_TIMEOUT"
    assert went_silent["error"]["code"] == "JOB_SILENT"


def test_agent_killed_mid_job_fails_it_and_leaves_nothing(tmp_path: Path) -> None:
    with LiveServer(
        tmp_path / "cp", f"sqlite:///{tmp_path / 'cp.db'}", env_overrides=FAST
    ) as server:
        with Node(tmp_path / "node", server.url, token=server.mint()["token"]) as node:
            node.start_worker().start_agent()
            node_id = node.node_id()
            wait_until(
                lambda: server.get(f"/api/v1/admin/nodes/{node_id}/readiness")["ready"],
                30,
                "node readiness",
            )
            job = _submit(server, "linger")
            wait_until(lambda: len(_pids(server, job["job_id"])) == 2, 30, "the job's pids")
            pids = _pids(server, job["job_id"])
            assert node.stop_agent(signal.SIGKILL) == -signal.SIGKILL
            # The worker notices its agent is gone and kills the group.
            wait_until(lambda: not any(_alive(pid) for pid in pids), 5, "job processes gone")
            failed = _wait_state(server, job["job_id"], {"failed"}, 15)
            assert failed["error"]["code"] == "JOB_CONTACT_LOST"
            assert node.worker is not None and node.worker.poll() is None  # the worker lives on


def test_values_that_are_not_json_fail_their_job_and_the_agent_serves_on(
    stack: tuple[LiveServer, Node],
) -> None:
    """NaN or Infinity in a result or an event fails that job with JOB_RESULT_NOT_JSON; the
    agent stays up and runs the next job."""
    server, node = stack
    for function in ("not_a_number", "infinite_event", "raw_nan_event"):
        job = _submit(server, function)
        done = _wait_state(server, job["job_id"], {"succeeded", "failed"}, 30)
        assert done["state"] == "failed", (function, done)
        assert done["error"]["code"] == "JOB_RESULT_NOT_JSON", (function, done["error"])
        assert node.agent is not None and node.agent.poll() is None, node.log()
    refused = _wait_state(server, _submit(server, "infinite_event")["job_id"], {"failed"}, 30)
    assert "emit()" in refused["error"]["message"]

    # emit() refuses at the call: a job that handles it carries on.
    careful = _submit(server, "careful")
    done = _wait_state(server, careful["job_id"], {"succeeded", "failed"}, 30)
    assert done["state"] == "succeeded" and done["result"] == "ok", done
    data = [e["data"] for e in _events(server, careful["job_id"]) if e["kind"] == "event"]
    assert any("not strict JSON" in str((d or {}).get("refused")) for d in data), data

    after = _submit(server, "run", params={"n": 1, "text": "still here"})
    done = _wait_state(server, after["job_id"], {"succeeded", "failed"}, 30)
    assert done["state"] == "succeeded", done
    assert "Traceback" not in node.log()
