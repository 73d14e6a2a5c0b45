"""Jobs in the control plane: submission, scheduling by labels and free
resources, claims, reports, cancellation, the contact sweep, artifacts. SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from tests.factories import ControlPlane, control_plane, heartbeat_body, inventory_body

SOURCE = {"m.py": "def f(x):\n    return x * 2\n"}


def _job(**extra: Any) -> dict[str, Any]:
    return {
        "entrypoint": {"kind": "python", "module": "m", "function": "f", "source": SOURCE},
        "params": {"x": 21},
        **extra,
    }


def _node(
    cp: ControlPlane, labels: dict[str, str] | None = None, cpus: int = 4, gpus: int = 0
) -> dict[str, str]:
    minted = cp.mint(labels=labels or {})
    enrolled = cp.enroll_raw(minted["token"]).json()
    headers = cp.agent(enrolled["credential"])
    inventory = inventory_body(cpu_count=cpus)
    inventory["gpus"] = [
        {"index": i, "uuid": f"GPU-{minted['node_id']}-{i}", "name": "G"} for i in range(gpus)
    ]
    cp.client.put("/api/v1/agent/inventory", headers=headers, json=inventory)
    cp.client.post("/api/v1/agent/heartbeat", headers=headers, json=heartbeat_body())
    return {"node_id": enrolled["node_id"], **headers}


def _submit(cp: ControlPlane, **extra: Any) -> dict[str, Any]:
    response = cp.client.post("/api/v1/jobs", headers=cp.admin, json=_job(**extra))
    assert response.status_code == 201, response.text
    return dict(response.json())


def _claim(cp: ControlPlane, node: dict[str, str]) -> dict[str, Any] | None:
    headers = {"Authorization": node["Authorization"]}
    response = cp.client.post("/api/v1/agent/work/claim", headers=headers, json={"hold_seconds": 0})
    if response.status_code == 204:
        return None
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_submit_claim_report_complete(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        job = _submit(cp)
        assert job["state"] == "queued" and job["entrypoint"]["source"] == ["m.py"]
        assignment = _claim(cp, node)
        assert assignment is not None and assignment["job_id"] == job["job_id"]
        assert assignment["entrypoint"]["source"] == SOURCE  # the text travels to the node
        assert assignment["progress_interval_seconds"] == 10
        assert assignment["stop_after_disconnect_seconds"] is None  # unset: runs on when cut off
        assert _claim(cp, node) is None  # claimed once
        headers = {"Authorization": node["Authorization"]}
        for i in range(3):
            response = cp.client.post(
                f"/api/v1/agent/jobs/{job['job_id']}/events",
                headers=headers,
                json={"events": [{"kind": "event", "data": {"step": i}}]},
            )
            assert response.json() == {"cancel": False}
        done = cp.client.post(
            f"/api/v1/agent/jobs/{job['job_id']}/complete",
            headers=headers,
            json={"state": "succeeded", "result": 42},
        )
        assert done.status_code == 200, done.text
        got = cp.client.get(f"/api/v1/jobs/{job['job_id']}", headers=cp.admin).json()
        assert got["state"] == "succeeded" and got["result"] == 42
        assert got["node_id"] == node["node_id"]
        events = cp.client.get(f"/api/v1/jobs/{job['job_id']}/events", headers=cp.admin).json()
        emitted = [e["data"]["step"] for e in events if e["kind"] == "event"]
        assert emitted == [0, 1, 2]
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        assert [
            e["data"]["state"] for e in events if e["kind"] == "state" and "state" in e["data"]
        ] == ["queued", "running", "succeeded"]
        again = cp.client.post(
            f"/api/v1/agent/jobs/{job['job_id']}/complete",
            headers=headers,
            json={"state": "succeeded", "result": 1},
        )
        assert again.status_code == 409 and again.json()["error"]["code"] == "JOB_NOT_RUNNING"


def test_labels_and_free_resources_decide(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        plain = _node(cp, cpus=4)
        gpu = _node(cp, labels={"accel": "gpu"}, cpus=8, gpus=1)
        needs_gpu = _submit(cp, labels={"accel": "gpu"}, resources={"cpus": 2, "gpus": 1})
        assert _claim(cp, plain) is None  # require: labels missing
        assert _claim(cp, gpu)["job_id"] == needs_gpu["job_id"]  # type: ignore[index]
        second = _submit(cp, labels={"accel": "gpu"}, resources={"cpus": 1, "gpus": 1})
        assert _claim(cp, gpu) is None  # its only GPU is held by the running job
        big = _submit(cp, resources={"cpus": 5})
        assert _claim(cp, plain) is None  # 5 CPUs do not fit in 4
        assert _claim(cp, gpu)["job_id"] == big["job_id"]  # type: ignore[index]
        states = {
            j["job_id"]: j["state"] for j in cp.client.get("/api/v1/jobs", headers=cp.admin).json()
        }
        assert states[second["job_id"]] == "queued"


def test_prefer_falls_back_only_when_no_labelled_node_has_room(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        plain = _node(cp, cpus=4)
        fast = _node(cp, labels={"tier": "fast"}, cpus=1)
        first = _submit(cp, labels={"tier": "fast"}, worker_policy="prefer")
        assert _claim(cp, plain) is None  # the fast node has room: leave it there
        assert _claim(cp, fast)["job_id"] == first["job_id"]  # type: ignore[index]
        second = _submit(cp, labels={"tier": "fast"}, worker_policy="prefer")
        assert _claim(cp, plain)["job_id"] == second["job_id"]  # type: ignore[index]


def test_offline_or_incompatible_nodes_get_no_work(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        _submit(cp)
        cp.clock.advance(31)
        assert _claim(cp, node) is None  # stale: no work for it
        headers = {"Authorization": node["Authorization"]}
        cp.client.post("/api/v1/agent/heartbeat", headers=headers, json=heartbeat_body(protocol=2))
        assert _claim(cp, node) is None  # needs upgrade
        cp.clock.advance(1)
        cp.client.post("/api/v1/agent/heartbeat", headers=headers, json=heartbeat_body())
        cp.flush()
        assert _claim(cp, node) is not None


def test_cancel_queued_and_running(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        queued = _submit(cp)
        cancelled = cp.client.post(f"/api/v1/jobs/{queued['job_id']}/cancel", headers=cp.admin)
        assert cancelled.json()["state"] == "cancelled"
        assert cancelled.json()["error"]["code"] == "JOB_CANCELLED"
        running = _submit(cp)
        assert _claim(cp, node)["job_id"] == running["job_id"]  # type: ignore[index]
        headers = {"Authorization": node["Authorization"]}
        watch = cp.client.post(
            "/api/v1/agent/jobs/watch",
            headers=headers,
            json={"job_ids": [running["job_id"]], "hold_seconds": 0},
        )
        assert watch.json() == {"cancel": []}
        cp.client.post(f"/api/v1/jobs/{running['job_id']}/cancel", headers=cp.admin)
        watch = cp.client.post(
            "/api/v1/agent/jobs/watch",
            headers=headers,
            json={"job_ids": [running["job_id"]], "hold_seconds": 0},
        )
        assert watch.json() == {"cancel": [running["job_id"]]}
        report = cp.client.post(
            f"/api/v1/agent/jobs/{running['job_id']}/events", headers=headers, json={"events": []}
        )
        assert report.json() == {"cancel": True}
        done = cp.client.post(
            f"/api/v1/agent/jobs/{running['job_id']}/complete",
            headers=headers,
            json={"state": "failed", "error": {"code": "JOB_KILLED", "message": "killed"}},
        )
        assert done.status_code == 200
        final = cp.client.get(f"/api/v1/jobs/{running['job_id']}", headers=cp.admin).json()
        assert final["state"] == "cancelled"
        assert (
            cp.client.delete(f"/api/v1/jobs/{running['job_id']}", headers=cp.admin).status_code
            == 204
        )


def test_contact_loss_fails_the_job_heartbeats_do_not_help(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        job = _submit(cp)
        _claim(cp, node)
        headers = {"Authorization": node["Authorization"]}
        for _ in range(9):
            cp.clock.advance(10)
            cp.client.post("/api/v1/agent/heartbeat", headers=headers, json=heartbeat_body())
        from control_plane.background.loops import sweep_jobs

        assert sweep_jobs(cp.ctx) == 1
        final = cp.client.get(f"/api/v1/jobs/{job['job_id']}", headers=cp.admin).json()
        assert final["state"] == "failed" and final["error"]["code"] == "JOB_CONTACT_LOST"
        late = cp.client.post(
            f"/api/v1/agent/jobs/{job['job_id']}/events", headers=headers, json={"events": []}
        )
        assert late.json()["error"]["code"] == "JOB_NOT_RUNNING"


def test_a_jobs_stop_after_disconnect_reaches_its_agent(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        job = _submit(cp, stop_after_disconnect_seconds=30)
        assert job["stop_after_disconnect_seconds"] == 30
        assignment = _claim(cp, node)
        assert assignment is not None and assignment["stop_after_disconnect_seconds"] == 30


@pytest.mark.parametrize(
    "body",
    [
        {
            "entrypoint": {
                "kind": "python",
                "module": "m",
                "function": "f",
                "source": {"../evil.py": "x"},
            }
        },
        {"entrypoint": {"kind": "python", "module": "m;rm", "function": "f"}},
        {"entrypoint": {"kind": "onnx", "model": "md5:abc"}},
        {"entrypoint": {"kind": "shell", "command": "ls"}},
        {**_job(), "worker_policy": "sometimes"},
        {**_job(), "resources": {"gpus": -1}},
        {**_job(), "timeout_seconds": 0},
        {**_job(), "stop_after_disconnect_seconds": 0},
        {**_job(), "stop_after_disconnect_seconds": "30"},
        {**_job(), "stop_after_disconnect_seconds": 86401},
        {**_job(), "inputs": {"model": "sha256:xyz"}},
    ],
)
def test_bad_job_is_refused_and_changes_nothing(
    tmp_path: Path, database_url: str, body: dict[str, Any]
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        response = cp.client.post("/api/v1/jobs", headers=cp.admin, json=body)
        assert response.status_code == 422
        assert response.json()["error"]["code"] == "INVALID_REQUEST"
        assert cp.client.get("/api/v1/jobs", headers=cp.admin).json() == []


def test_artifacts_are_content_addressed(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        headers = {"Authorization": node["Authorization"]}
        payload = b"model weights " * 5000
        digest = "sha256:" + hashlib.sha256(payload).hexdigest()
        uploaded = cp.client.post("/api/v1/artifacts", headers=cp.admin, content=payload)
        assert uploaded.status_code == 201 and uploaded.json()["digest"] == digest
        # A node downloads what its jobs name: this node runs a job with it as an input.
        _submit(cp, inputs={"weights": digest})
        assert _claim(cp, node) is not None
        got = cp.client.get(f"/api/v1/agent/artifacts/{digest}", headers=headers)
        assert got.content == payload and got.headers["X-ModelForge-Digest"] == digest
        ranged = cp.client.get(
            f"/api/v1/agent/artifacts/{digest}", headers={**headers, "Range": "bytes=100-"}
        )
        assert ranged.status_code == 206 and ranged.content == payload[100:]
        wrong = cp.client.put(
            f"/api/v1/agent/artifacts/sha256:{'0' * 64}", headers=headers, content=b"not that"
        )
        assert wrong.status_code == 422
        assert wrong.json()["error"]["code"] == "ARTIFACT_DIGEST_MISMATCH"
        missing = cp.client.get(f"/api/v1/agent/artifacts/sha256:{'0' * 64}", headers=headers)
        assert missing.status_code == 404
        cp.client.post(f"/api/v1/admin/nodes/{node['node_id']}/credential/revoke", headers=cp.admin)
        refused = cp.client.get(f"/api/v1/agent/artifacts/{digest}", headers=headers)
        assert refused.status_code == 403
