"""Operators quarantine and re-admit a node's GPU (issue 28): the views, the timeline, the audit
entries, and re-admission of a GPU the rules made unhealthy only through its active check (a
job pinned to that GPU), which re-admits the GPU when it passes and keeps it out when it fails,
however it ends. The GPUs' health comes from the agent's real report route. SQLite and
PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import select

from control_plane.background.loops import sweep_jobs
from control_plane.models import Job
from tests.control_plane.test_jobs import _claim, _node
from tests.factories import ControlPlane, control_plane

XID_79 = "XID 79 (GPU has fallen off the bus)"


def _cp(tmp_path: Path, database_url: str) -> Any:
    """A control plane whose active check runs on the CPU (no GPU on this machine)."""
    return control_plane(tmp_path, database_url, gpu_check_provider="CPUExecutionProvider")


def _uuid(node: dict[str, str], index: int) -> str:
    """The UUID `_node(..., gpus=2)` reports for the node's GPU `index`."""
    return f"GPU-{node['node_id']}-{index}"


def _gpus_url(node: dict[str, str], index: int | None = None, tail: str = "") -> str:
    url = f"/api/v1/admin/nodes/{node['node_id']}/gpus"
    return url if index is None else f"{url}/{_uuid(node, index)}{tail}"


def _report(cp: ControlPlane, node: dict[str, str], gpu1: str) -> None:
    """The agent's snapshot: GPU 0 healthy, GPU 1 `gpu1` (XID 79 while unhealthy)."""
    second: dict[str, Any] = {"index": 1, "uuid": _uuid(node, 1), "state": gpu1, "reason": ""}
    if gpu1 == "unhealthy":
        at = cp.clock.now().isoformat()
        second["reason"] = XID_79
        second["evidence"] = [{"kind": "xid", "at": at, "detail": XID_79, "xid": 79}]
    body = {
        "gpus": [{"index": 0, "uuid": _uuid(node, 0), "state": "healthy", "reason": ""}, second]
    }
    headers = {"Authorization": node["Authorization"]}
    response = cp.client.post("/api/v1/agent/gpu-health", headers=headers, json=body)
    assert response.status_code == 200, response.text


def _gpu(cp: ControlPlane, node: dict[str, str], index: int) -> dict[str, Any]:
    response = cp.client.get(_gpus_url(node), headers=cp.admin)
    assert response.status_code == 200, response.text
    (gpu,) = [gpu for gpu in response.json() if gpu["index"] == index]
    return dict(gpu)


def _timeline(cp: ControlPlane, node: dict[str, str], index: int) -> list[dict[str, Any]]:
    response = cp.client.get(_gpus_url(node, index, "/events"), headers=cp.admin)
    assert response.status_code == 200, response.text
    return list(response.json())


def _post(cp: ControlPlane, url: str, **kw: Any) -> Any:
    return cp.client.post(url, headers=cp.admin, **kw)


def _audit(cp: ControlPlane, action: str) -> list[dict[str, Any]]:
    response = cp.client.get(f"/api/v1/admin/audit?action={action}", headers=cp.admin)
    assert response.status_code == 200, response.text
    return list(response.json())


def _jobs(cp: ControlPlane) -> list[Job]:
    with cp.ctx.session_factory() as session:
        return list(session.scalars(select(Job)))


def _unhealthy_then_clean(cp: ControlPlane, node: dict[str, str]) -> None:
    """GPU 1 turned unhealthy by the rules (sticky), its agent now reporting it clean."""
    _report(cp, node, "unhealthy")
    _report(cp, node, "healthy")
    gpu = _gpu(cp, node, 1)
    assert (gpu["state"], gpu["rules_state"], gpu["reported"]) == (
        "unhealthy",
        "unhealthy",
        "healthy",
    )


def _complete(cp: ControlPlane, node: dict[str, str], job_id: str, **outcome: Any) -> None:
    response = cp.client.post(
        f"/api/v1/agent/jobs/{job_id}/complete",
        headers={"Authorization": node["Authorization"]},
        json=outcome,
    )
    assert response.status_code == 200, response.text


def test_quarantine_drains_a_gpu_with_its_reason_and_lifting_it_readmits_at_once(
    tmp_path: Path, database_url: str
) -> None:
    with _cp(tmp_path, database_url) as cp:
        node = _node(cp, gpus=2)
        inventory_at = cp.node(node["node_id"])["inventory_at"]
        listed = cp.client.get(_gpus_url(node), headers=cp.admin).json()
        assert [(g["index"], g["uuid"], g["state"], g["since"]) for g in listed] == [
            (0, _uuid(node, 0), "healthy", inventory_at),
            (1, _uuid(node, 1), "healthy", inventory_at),
        ]  # never reported: healthy since the inventory

        response = _post(cp, _gpus_url(node, 1, "/quarantine"), json={"reason": "fans replaced"})
        assert response.status_code == 200, response.text
        view = response.json()
        assert view["state"] == "quarantined" and view["rules_state"] == "healthy"
        assert view["quarantine"]["reason"] == "fans replaced"
        assert _gpu(cp, node, 1) == view
        assert _gpu(cp, node, 0)["state"] == "healthy"
        (event,) = _timeline(cp, node, 1)
        assert (event["kind"], event["to_state"], event["reason"], event["actor"]) == (
            "quarantine",
            "quarantined",
            "fans replaced",
            "admin-token",
        )
        (entry,) = _audit(cp, "gpu.quarantine")
        assert entry["target"] == f"{node['node_id']}/{_uuid(node, 1)}"
        assert (entry["actor"], entry["outcome"]) == ("admin-token", "ok")

        # Quarantined again: a new reason, the quarantine's time kept.
        cp.clock.advance(60)
        again = _post(cp, _gpus_url(node, 1, "/quarantine"), json={"reason": "watch it"}).json()
        assert again["quarantine"] == {"reason": "watch it", "at": view["quarantine"]["at"]}

        readmitted = _post(cp, _gpus_url(node, 1, "/readmit"))
        assert readmitted.status_code == 200, readmitted.text
        gpu = readmitted.json()
        assert (gpu["state"], gpu["quarantine"], gpu["check"]) == ("healthy", None, None)
        assert _gpu(cp, node, 1)["state"] == "healthy"
        newest = _timeline(cp, node, 1)[0]
        assert (newest["kind"], newest["from_state"], newest["to_state"], newest["actor"]) == (
            "readmit",
            "quarantined",
            "healthy",
            "admin-token",
        )
        assert [e["outcome"] for e in _audit(cp, "gpu.readmit")] == ["ok"]
        assert _jobs(cp) == []  # no check for a GPU only a quarantine held

        # Healthy and not quarantined: nothing to re-admit.
        refused = _post(cp, _gpus_url(node, 0, "/readmit"))
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "GPU_IN_SERVICE"


def test_a_gpu_its_agent_still_reports_unhealthy_is_not_readmitted(
    tmp_path: Path, database_url: str
) -> None:
    with _cp(tmp_path, database_url) as cp:
        node = _node(cp, gpus=2)
        _report(cp, node, "unhealthy")
        before, timeline = _gpu(cp, node, 1), _timeline(cp, node, 1)
        assert before["state"] == "unhealthy"

        refused = _post(cp, _gpus_url(node, 1, "/readmit"))
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "GPU_NOT_CLEAN" and XID_79 in error["message"]
        assert "reset" in error["next_step"].lower()
        assert _uuid(node, 1) not in str(error) and node["node_id"] not in str(error)
        assert (_gpu(cp, node, 1), _timeline(cp, node, 1), _jobs(cp)) == (before, timeline, [])
        assert [e["outcome"] for e in _audit(cp, "gpu.readmit")] == ["GPU_NOT_CLEAN"]


def test_the_active_check_passing_readmits_the_gpu(tmp_path: Path, database_url: str) -> None:
    with _cp(tmp_path, database_url) as cp:
        node = _node(cp, gpus=2)
        _unhealthy_then_clean(cp, node)
        # A quarantine on top of the rules' verdict is lifted too when the check passes.
        _post(cp, _gpus_url(node, 1, "/quarantine"), json={"reason": "suspect"})

        started = _post(cp, _gpus_url(node, 1, "/readmit"))
        assert started.status_code == 202, started.text
        view = started.json()
        assert view["state"] == "quarantined" and view["rules_state"] == "unhealthy"
        job_id = view["check"]["job_id"]
        assert view["check"] == {"job_id": job_id, "state": "queued"}
        (job,) = _jobs(cp)
        assert job.id == job_id and job.state == "queued"
        assert job.pinned == {"node_id": node["node_id"], "uuid": _uuid(node, 1)}
        assert job.resources["gpus"] == 1
        assert job.params["provider"] == "CPUExecutionProvider"
        assert _timeline(cp, node, 1)[0]["kind"] == "check"

        again = _post(cp, _gpus_url(node, 1, "/readmit"))
        assert again.status_code == 409 and again.json()["error"]["code"] == "GPU_CHECK_RUNNING"
        assert len(_jobs(cp)) == 1

        # The scheduler places the check on exactly that GPU, out of the schedule as it is.
        assignment = _claim(cp, node)
        assert assignment is not None and assignment["job_id"] == job_id
        assert assignment["assigned_gpus"] == [{"index": 1, "uuid": _uuid(node, 1)}]
        assert _gpu(cp, node, 1)["check"] == {"job_id": job_id, "state": "running"}
        _complete(cp, node, job_id, state="succeeded", result={"ok": True})

        gpu = _gpu(cp, node, 1)
        assert (gpu["state"], gpu["rules_state"], gpu["quarantine"], gpu["check"]) == (
            "healthy",
            "healthy",
            None,
            None,
        )
        passed = _timeline(cp, node, 1)[0]
        assert (passed["kind"], passed["from_state"], passed["to_state"], passed["actor"]) == (
            "readmit",
            "quarantined",
            "healthy",
            "check",
        )
        assert "the active check passed" in passed["reason"]
        assert [e["outcome"] for e in _audit(cp, "gpu.readmit")] == ["GPU_CHECK_RUNNING", "ok"]


def test_a_passing_check_keeps_a_quarantine_placed_after_it_started(
    tmp_path: Path, database_url: str
) -> None:
    with _cp(tmp_path, database_url) as cp:
        node = _node(cp, gpus=2)
        _unhealthy_then_clean(cp, node)
        started = _post(cp, _gpus_url(node, 1, "/readmit"))
        assert started.status_code == 202, started.text
        job_id = started.json()["check"]["job_id"]
        assert (_claim(cp, node) or {}).get("job_id") == job_id
        # While the check runs, an operator quarantines the GPU on a suspicion of their own.
        cp.clock.advance(5)
        held = _post(cp, _gpus_url(node, 1, "/quarantine"), json={"reason": "fan noise"})
        assert held.status_code == 200, held.text
        _complete(cp, node, job_id, state="succeeded", result={"ok": True})

        gpu = _gpu(cp, node, 1)
        assert (gpu["state"], gpu["rules_state"], gpu["check"]) == ("quarantined", "healthy", None)
        assert gpu["quarantine"] == held.json()["quarantine"]
        assert gpu["quarantine"]["reason"] == "fan noise"
        passed = _timeline(cp, node, 1)[0]
        assert (passed["kind"], passed["from_state"], passed["to_state"], passed["actor"]) == (
            "check",
            "unhealthy",
            "healthy",
            "check",
        )
        assert passed["reason"] == (
            f"the active check passed (job {job_id}), but the quarantine placed after it "
            "started holds: re-admit the GPU to lift it"
        )
        # Work still stays off it; the operator's re-admission lifts it at once (no new check).
        assert _claim(cp, node) is None
        lifted = _post(cp, _gpus_url(node, 1, "/readmit"))
        assert lifted.status_code == 200, lifted.text
        assert lifted.json()["state"] == "healthy" and lifted.json()["quarantine"] is None
        assert len(_jobs(cp)) == 1


def test_a_failing_active_check_keeps_the_gpu_out_with_its_error(
    tmp_path: Path, database_url: str
) -> None:
    with _cp(tmp_path, database_url) as cp:
        node = _node(cp, gpus=2)
        _unhealthy_then_clean(cp, node)
        job_id = _post(cp, _gpus_url(node, 1, "/readmit")).json()["check"]["job_id"]
        assert _claim(cp, node) is not None
        error = {"code": "JOB_FAILED", "message": "RuntimeError: CUDA results differ by 3.5"}
        _complete(cp, node, job_id, state="failed", error=error)

        gpu = _gpu(cp, node, 1)
        assert (gpu["state"], gpu["rules_state"], gpu["check"]) == ("unhealthy", "unhealthy", None)
        failed = _timeline(cp, node, 1)[0]
        assert (failed["kind"], failed["to_state"], failed["actor"]) == (
            "check",
            "unhealthy",
            "check",
        )
        assert "JOB_FAILED: RuntimeError: CUDA results differ by 3.5" in failed["reason"]

        # Cancelled before it ran: the same, and a new check may start after it.
        retry = _post(cp, _gpus_url(node, 1, "/readmit"))
        assert retry.status_code == 202, retry.text
        second = retry.json()["check"]["job_id"]
        cancelled = _post(cp, f"/api/v1/jobs/{second}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert _gpu(cp, node, 1)["check"] is None
        assert "cancelled" in _timeline(cp, node, 1)[0]["reason"]

        # Its node gone silent while it ran: failed by the contact sweep, the same again.
        third = _post(cp, _gpus_url(node, 1, "/readmit")).json()["check"]["job_id"]
        assert (_claim(cp, node) or {}).get("job_id") == third
        cp.clock.advance(cp.ctx.settings.job_contact_timeout_seconds + 1)
        assert sweep_jobs(cp.ctx) == 1
        gpu = _gpu(cp, node, 1)
        assert (gpu["state"], gpu["check"]) == ("unhealthy", None)
        assert "JOB_CONTACT_LOST" in _timeline(cp, node, 1)[0]["reason"]


def test_unknown_nodes_and_gpus_bad_reasons_and_no_admin_token_are_refused(
    tmp_path: Path, database_url: str
) -> None:
    with _cp(tmp_path, database_url) as cp:
        node = _node(cp, gpus=1)
        ghost = {"node_id": "node_nosuchnode", "Authorization": ""}
        for url, method in [
            (_gpus_url(ghost), "get"),
            (_gpus_url(ghost, 0, "/events"), "get"),
            (_gpus_url(ghost, 0, "/quarantine"), "post"),
            (_gpus_url(ghost, 0, "/readmit"), "post"),
        ]:
            response = cp.client.request(
                method, url, headers=cp.admin, json={"reason": "x"} if "quar" in url else None
            )
            assert response.status_code == 404, (url, response.text)
            assert response.json()["error"]["code"] == "NODE_NOT_FOUND"
        stranger = f"{_gpus_url(node)}/GPU-not-in-the-inventory"
        for url, method in [
            (f"{stranger}/events", "get"),
            (f"{stranger}/quarantine", "post"),
            (f"{stranger}/readmit", "post"),
        ]:
            response = cp.client.request(
                method, url, headers=cp.admin, json={"reason": "x"} if "quar" in url else None
            )
            assert response.status_code == 404, (url, response.text)
            assert response.json()["error"]["code"] == "GPU_NOT_FOUND"
            assert "GPU-not-in-the-inventory" not in response.text

        for reason in ["", "   ", "x" * 501, "bell\x07"]:
            bad = _post(cp, _gpus_url(node, 0, "/quarantine"), json={"reason": reason})
            assert bad.status_code == 422, reason
            assert bad.json()["error"]["code"] == "INVALID_REQUEST"
        assert _post(cp, _gpus_url(node, 0, "/quarantine"), json={}).status_code == 422
        assert _gpu(cp, node, 0)["state"] == "healthy" and _timeline(cp, node, 0) == []

        for url, method in [
            (_gpus_url(node), "get"),
            (_gpus_url(node, 0, "/events"), "get"),
            (_gpus_url(node, 0, "/quarantine"), "post"),
            (_gpus_url(node, 0, "/readmit"), "post"),
        ]:
            response = cp.client.request(method, url, json={"reason": "x"})
            assert response.status_code == 401, url
            assert response.json()["error"]["code"] == "ADMIN_TOKEN_MISSING"
        assert _gpu(cp, node, 0)["state"] == "healthy"
