"""The agents' GPU health reports (issue 28): `POST /api/v1/agent/gpu-health` recorded by the
rules (unhealthy is sticky, degraded and healthy follow the reports), the jobs on a GPU turned
unhealthy failed with GPU_FAILED at once (the agent's cancellation watch wakes), the services
on it placed again, the per-GPU metric, and the refusals. The real app over HTTP on SQLite and
PostgreSQL; the agent's side is driven by its HTTP calls."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text

from control_plane.background.service_placement import place_services
from control_plane.jobs.reports import Outcome, complete_jobs
from control_plane.models import GpuHealth, GpuHealthEvent, Job, Service
from tests.control_plane.test_gpu_assignment import _view
from tests.control_plane.test_jobs import _claim, _node, _submit
from tests.control_plane.test_metrics import _parse, _value
from tests.control_plane.test_workloads import _deploy, _service, _sync
from tests.factories import ControlPlane, control_plane

XID_AT = "2026-03-01T10:00:00+00:00"


def _gpu(node: dict[str, str], index: int, state: str = "healthy", **extra: Any) -> dict[str, Any]:
    """GPU `index` of `node` (as `_node(..., gpus=n)` names it) judged `state`."""
    return {"index": index, "uuid": f"GPU-{node['node_id']}-{index}", "state": state, **extra}


def _xid79(node: dict[str, str], index: int) -> dict[str, Any]:
    return _gpu(
        node,
        index,
        "unhealthy",
        reason="XID 79 (GPU has fallen off the bus)",
        # The agent's detail of an XID (node_agent._gpu_faults): the catalogue's words already.
        evidence=[
            {
                "kind": "xid",
                "at": XID_AT,
                "detail": "XID 79 (GPU has fallen off the bus)",
                "xid": 79,
            }
        ],
        xid_counts={"79": 1, "13": 4},
    )


def _report(cp: ControlPlane, node: dict[str, str], *gpus: dict[str, Any]) -> Any:
    headers = {"Authorization": node["Authorization"]}
    return cp.client.post("/api/v1/agent/gpu-health", headers=headers, json={"gpus": list(gpus)})


def _accepted(cp: ControlPlane, node: dict[str, str], *gpus: dict[str, Any]) -> None:
    response = _report(cp, node, *gpus)
    assert response.status_code == 200, response.text
    assert response.json()["accepted"] is True


def _row(cp: ControlPlane, node: dict[str, str], index: int) -> GpuHealth | None:
    with cp.ctx.session_factory() as session:
        return session.get(GpuHealth, (node["node_id"], f"GPU-{node['node_id']}-{index}"))


def _events(cp: ControlPlane, node: dict[str, str], index: int) -> list[GpuHealthEvent]:
    with cp.ctx.session_factory() as session:
        return list(
            session.scalars(
                select(GpuHealthEvent)
                .where(GpuHealthEvent.uuid == f"GPU-{node['node_id']}-{index}")
                .order_by(GpuHealthEvent.id)
            )
        )


def _watch(cp: ControlPlane, node: dict[str, str], job_ids: list[str], hold: float) -> Any:
    response = cp.client.post(
        "/api/v1/agent/jobs/watch",
        headers={"Authorization": node["Authorization"]},
        json={"job_ids": job_ids, "hold_seconds": hold},
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_an_unhealthy_gpu_fails_the_job_on_it_and_no_other(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, cpus=16, gpus=2)
        on_0 = _submit(cp, resources={"cpus": 1, "gpus": 1})["job_id"]
        on_1 = _submit(cp, resources={"cpus": 1, "gpus": 1})["job_id"]
        assert _claim(cp, node) is not None and _claim(cp, node) is not None
        assert _view(cp, on_0)["assigned_gpus"][0]["index"] == 0
        _accepted(cp, node, _gpu(node, 0), _gpu(node, 1))  # all clean: nothing happens
        assert _view(cp, on_0)["state"] == _view(cp, on_1)["state"] == "running"

        with ThreadPoolExecutor(max_workers=1) as pool:
            # The agent's cancellation watch, held on the control plane's clock, which nothing
            # moves: only the wake-up of the job's end can answer it.
            watch = pool.submit(_watch, cp, node, [on_0, on_1], 30.0)
            deadline = time.monotonic() + 10
            while cp.ctx.dispatcher.waiting == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert cp.ctx.dispatcher.waiting > 0
            _accepted(cp, node, _xid79(node, 0), _gpu(node, 1))
            assert watch.result(timeout=10) == {"cancel": [on_0]}

        failed = _view(cp, on_0)
        assert failed["state"] == "failed" and failed["error"]["code"] == "GPU_FAILED"
        message = failed["error"]["message"]
        # The GPU, its node and the fault, said once (not "XID 79 (XID 79 (...))").
        assert message == (
            f"GPU 0 (GPU-{node['node_id']}-0) of node {node['node_id']} failed: "
            f"XID 79 (GPU has fallen off the bus) at {XID_AT}"
        ), message
        assert _view(cp, on_1)["state"] == "running"

        row = _row(cp, node, 0)
        assert row is not None
        assert (row.state, row.rules_state, row.reported) == ("unhealthy",) * 3
        assert row.evidence == [
            {
                "kind": "xid",
                "at": XID_AT,
                "detail": "XID 79 (GPU has fallen off the bus)",
                "xid": 79,
            }
        ]
        (turned,) = _events(cp, node, 0)
        assert (turned.kind, turned.from_state, turned.to_state, turned.actor) == (
            "state",
            "healthy",
            "unhealthy",
            "agent",
        )
        other = _row(cp, node, 1)
        assert other is not None and other.state == "healthy" and _events(cp, node, 1) == []

        # The same snapshot again (the agent's 60 s refresh): nothing new.
        _accepted(cp, node, _xid79(node, 0), _gpu(node, 1))
        assert len(_events(cp, node, 0)) == 1
        row = _row(cp, node, 0)
        assert row is not None and len(row.evidence) == 1

        # Sticky: clean again by the agent's counters, it stays out until re-admitted.
        reported_before = row.reported_at
        cp.clock.advance(60)
        _accepted(cp, node, _gpu(node, 0), _gpu(node, 1))
        row = _row(cp, node, 0)
        assert row is not None
        assert (row.state, row.rules_state, row.reported) == ("unhealthy", "unhealthy", "healthy")
        assert row.reported_at > reported_before
        assert "XID 79" in row.reason and len(row.evidence) == 1
        assert len(_events(cp, node, 0)) == 1
        assert _view(cp, on_1)["state"] == "running"


def test_a_fault_reported_anew_fails_the_active_check_on_the_gpu(
    tmp_path: Path, database_url: str
) -> None:
    """Unhealthy, then clean by its agent, re-admitted: its active check runs on it. The agent
    reports a fault again: the check fails with GPU_FAILED and the GPU stays out."""
    with control_plane(tmp_path, database_url, gpu_check_provider="CPUExecutionProvider") as cp:
        node = _node(cp, cpus=16, gpus=2)
        _accepted(cp, node, _gpu(node, 0), _xid79(node, 1))
        _accepted(cp, node, _gpu(node, 0), _gpu(node, 1))
        readmit = cp.client.post(
            f"/api/v1/admin/nodes/{node['node_id']}/gpus/GPU-{node['node_id']}-1/readmit",
            headers=cp.admin,
        )
        assert readmit.status_code == 202, readmit.text
        check = readmit.json()["check"]["job_id"]
        assignment = _claim(cp, node)
        assert assignment is not None and assignment["job_id"] == check

        again = _xid79(node, 1)
        again["evidence"][0]["at"] = "2026-03-01T11:00:00+00:00"
        _accepted(cp, node, _gpu(node, 0), again)
        failed = _view(cp, check)
        assert failed["state"] == "failed" and failed["error"]["code"] == "GPU_FAILED"
        assert "2026-03-01T11:00:00+00:00" in failed["error"]["message"]
        row = _row(cp, node, 1)
        assert row is not None
        assert (row.state, row.rules_state, row.reported) == ("unhealthy",) * 3
        assert row.check_job_id is None and len(row.evidence) == 2
        kinds = [(e.kind, e.from_state, e.to_state) for e in _events(cp, node, 1)]
        assert ("state", "unhealthy", "unhealthy") in kinds and kinds[-1][0] == "check"

        _accepted(cp, node, _gpu(node, 0), again)  # the refresh: nothing more
        assert len(_events(cp, node, 1)) == len(kinds)


def test_a_degraded_gpu_and_back(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, cpus=16, gpus=2)
        job = _submit(cp, resources={"cpus": 1, "gpus": 2})["job_id"]
        assert _claim(cp, node) is not None
        throttle = {
            "kind": "throttle",
            "at": "2026-03-01T09:00:00Z",
            "detail": "hardware slowdown in every sample for 300 s",
            "value": 8,
        }
        slow = _gpu(node, 1, "degraded", reason="persistent hw slowdown", evidence=[throttle])
        _accepted(cp, node, _gpu(node, 0), slow)
        row = _row(cp, node, 1)
        assert row is not None
        assert (row.state, row.rules_state, row.reported) == ("degraded",) * 3
        assert row.reason == "persistent hw slowdown"
        assert row.evidence == [{**throttle, "at": "2026-03-01T09:00:00+00:00"}]
        assert _view(cp, job)["state"] == "running"  # degraded only orders placements

        cp.clock.advance(30)
        _accepted(cp, node, _gpu(node, 0), _gpu(node, 1))
        row = _row(cp, node, 1)
        assert row is not None and (row.state, row.rules_state) == ("healthy", "healthy")
        assert len(row.evidence) == 1  # the history stays
        assert [(e.from_state, e.to_state) for e in _events(cp, node, 1)] == [
            ("healthy", "degraded"),
            ("degraded", "healthy"),
        ]
        assert _view(cp, job)["state"] == "running"


def test_a_service_on_a_failed_gpu_goes_back_to_pending(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, gpus=2)
        service = _deploy(cp, resources={"cpus": 1, "gpus": 1})
        assert place_services(cp.ctx) == 1
        placed = _service(cp, service["service_id"])
        assert placed["node_id"] == node["node_id"] and placed["gpus"][0]["index"] == 0
        assert [s["service_id"] for s in _sync(cp, node)["services"]] == [service["service_id"]]

        _accepted(cp, node, _xid79(node, 0), _gpu(node, 1))
        moved = _service(cp, service["service_id"])
        assert moved["state"] == "pending" and moved["node_id"] is None
        assert _sync(cp, node)["services"] == []  # its agent stops it
        events = cp.client.get(
            f"/api/v1/services/{service['service_id']}/events", headers=cp.admin
        ).json()
        last = events[-1]["data"]
        assert last["state"] == "pending" and last["gpu"] == f"GPU-{node['node_id']}-0"
        assert "GPU 0" in last["reason"] and "XID 79" in last["reason"]


def test_the_metric_has_every_gpu_in_its_state(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, gpus=3)
        lagging = {"index": 3, "uuid": "GPU-not-in-the-inventory-yet", "state": "degraded"}
        _accepted(cp, node, _xid79(node, 0), _gpu(node, 1), lagging)
        response = cp.client.get("/metrics", headers=cp.admin)
        assert response.status_code == 200, response.text
        samples = _parse(response.text)
        expected = {
            f"GPU-{node['node_id']}-0": "unhealthy",
            f"GPU-{node['node_id']}-1": "healthy",
            f"GPU-{node['node_id']}-2": "healthy",  # never reported: healthy
            "GPU-not-in-the-inventory-yet": "degraded",
        }
        for uuid, current in expected.items():
            for state in ("healthy", "degraded", "unhealthy", "quarantined"):
                value = _value(
                    samples, "modelforge_gpu_health", node=node["node_id"], gpu=uuid, state=state
                )
                assert value == (1.0 if state == current else 0.0), (uuid, state)
        series = [key for key in samples if key[0] == "modelforge_gpu_health"]
        assert len(series) == 4 * len(expected)


def test_reports_need_the_node_credential_and_bad_ones_change_nothing(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, gpus=1)
        body = {"gpus": [_xid79(node, 0)]}
        unauthenticated = cp.client.post("/api/v1/agent/gpu-health", json=body)
        assert unauthenticated.status_code == 401, unauthenticated.text
        assert unauthenticated.json()["error"]["code"] == "CREDENTIAL_MISSING"
        for headers in (cp.admin, {"Authorization": "Bearer not-a-node-credential"}):
            refused = cp.client.post("/api/v1/agent/gpu-health", headers=headers, json=body)
            assert refused.status_code == 401, refused.text

        xid = {"kind": "xid", "at": XID_AT, "detail": "x", "xid": 79}
        bad = [
            [{**_gpu(node, i), "uuid": f"GPU-{i}"} for i in range(65)],  # more than 64
            [_gpu(node, 0), _gpu(node, 0)],  # the same GPU twice
            [_gpu(node, 0, "broken")],
            [_gpu(node, 0, "unhealthy", evidence=[{**xid, "xid": None}])],
            [_gpu(node, 0, "unhealthy", evidence=[{**xid, "kind": "ecc"}])],
            [_gpu(node, 0, "unhealthy", evidence=[{**xid, "at": "2026-03-01T10:00:00"}])],
            [_gpu(node, 0, "unhealthy", evidence=[xid] * 17)],
            [_gpu(node, 0, "unhealthy", reason="x" * 501)],
            [_gpu(node, 0, "unhealthy", reason="line\nbreak")],
            [_gpu(node, 0, xid_counts={"thirteen": 1})],
            [_gpu(node, 0, xid_counts={"13": -1})],
            [_gpu(node, 0, surprise=True)],
        ]
        for gpus in bad:
            response = _report(cp, node, *gpus)
            assert response.status_code == 422, (gpus[0], response.text)
            error = response.json()["error"]
            assert error["code"] and error["message"] and error["next_step"]
        with cp.ctx.session_factory() as session:
            assert session.scalar(select(func.count()).select_from(GpuHealth)) == 0
            assert session.scalar(select(func.count()).select_from(GpuHealthEvent)) == 0


def test_a_report_and_the_check_s_completion_take_their_locks_in_one_order(
    tmp_path: Path, pg_database_url: str
) -> None:
    """PostgreSQL. A completion group locks its jobs and then, for an active check, the check's
    GPU; a report failing that GPU's work locks the node's running jobs before its GPUs. So a
    completion holding the check's row while the report arrives never waits on the report:
    both commit (in the other order the two waited on each other and one was aborted)."""
    with control_plane(tmp_path, pg_database_url, gpu_check_provider="CPUExecutionProvider") as cp:
        node = _node(cp, cpus=16, gpus=2)
        _accepted(cp, node, _gpu(node, 0), _xid79(node, 1))
        _accepted(cp, node, _gpu(node, 0), _gpu(node, 1))
        readmit = cp.client.post(
            f"/api/v1/admin/nodes/{node['node_id']}/gpus/GPU-{node['node_id']}-1/readmit",
            headers=cp.admin,
        )
        assert readmit.status_code == 202, readmit.text
        check = readmit.json()["check"]["job_id"]
        assignment = _claim(cp, node)
        assert assignment is not None and assignment["job_id"] == check
        again = _xid79(node, 1)
        again["evidence"][0]["at"] = "2026-03-01T11:00:00+00:00"

        with cp.ctx.session_factory() as completion, ThreadPoolExecutor(1) as pool:
            completion.execute(text("SET LOCAL lock_timeout = '10s'"))
            completion.execute(select(Job.id).where(Job.id == check).with_for_update()).all()
            report = pool.submit(_report, cp, node, _gpu(node, 0), again)
            _until_backends_wait_on_locks(cp, 1)
            outcome = Outcome(check, node["node_id"], "succeeded", {"ok": True}, {}, None)
            (problem,) = complete_jobs(session=completion, clock=cp.clock, outcomes=[outcome])
            assert problem is None
            completion.commit()
            answered = report.result(timeout=30)
        assert answered.status_code == 200, answered.text

        assert _view(cp, check)["state"] == "succeeded"
        row = _row(cp, node, 1)
        assert row is not None and row.check_job_id is None
        # The check passed on a GPU reported clean; the report that came next failed it again.
        assert (row.state, row.rules_state, row.reported) == ("unhealthy",) * 3
        kinds = [(e.kind, e.to_state) for e in _events(cp, node, 1)]
        assert kinds[-2:] == [("readmit", "healthy"), ("state", "unhealthy")]


def test_a_report_and_a_replica_s_placement_take_their_locks_in_one_order(
    tmp_path: Path, pg_database_url: str
) -> None:
    """PostgreSQL. A report failing a GPU locks the node, then the services on that GPU; the
    placement of a service's pending replica locks the node it tries, then the service. So a
    placement and a report on one node, both held up behind a service's row (a sync, a
    rollout step) while one of the service's replicas sits on the failing GPU and another
    waits to be placed, never wait on each other: both commit. (Placement used to lock the
    service first: once the row was free it waited for the node the report held, the report
    for the service, and PostgreSQL aborted one.)"""
    with control_plane(tmp_path, pg_database_url) as cp:
        node = _node(cp, cpus=16, gpus=2)
        sid = _deploy(cp, resources={"cpus": 1, "gpus": 1})["service_id"]
        assert place_services(cp.ctx) == 1
        (on_0,) = _service(cp, sid)["replicas"]
        assert on_0["assigned_gpus"][0]["index"] == 0
        scaled = cp.client.patch(f"/api/v1/services/{sid}", headers=cp.admin, json={"replicas": 2})
        assert scaled.status_code == 200, scaled.text
        assert [r["state"] for r in _service(cp, sid)["replicas"]] == ["starting", "pending"]

        with cp.ctx.session_factory() as holder, ThreadPoolExecutor(2) as pool:
            holder.execute(select(Service.id).where(Service.id == sid).with_for_update()).all()
            placing = pool.submit(place_services, cp.ctx)
            _until_backends_wait_on_locks(cp, 1)
            report = pool.submit(_report, cp, node, _xid79(node, 0), _gpu(node, 1))
            _until_backends_wait_on_locks(cp, 2)
            holder.rollback()
            assert placing.result(timeout=30) == 1
            answered = report.result(timeout=30)
        assert answered.status_code == 200, answered.text

        # The pending replica went to GPU 1; the one on GPU 0 is pending again, off GPU 0.
        by_ordinal = {r["ordinal"]: r for r in _service(cp, sid)["replicas"]}
        assert by_ordinal[0]["state"] == "pending" and by_ordinal[0]["node_id"] is None
        assert by_ordinal[1]["state"] == "starting"
        assert [g["index"] for g in by_ordinal[1]["assigned_gpus"]] == [1]
        row = _row(cp, node, 0)
        assert row is not None and row.state == "unhealthy"


def _until_backends_wait_on_locks(cp: ControlPlane, count: int) -> None:
    deadline = time.monotonic() + 10
    with cp.ctx.session_factory() as session:
        while time.monotonic() < deadline:
            waiting = session.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()"
                )
            )
            session.rollback()
            if waiting is not None and waiting >= count:
                return
            time.sleep(0.02)
    raise AssertionError(f"{count} transactions never waited on a lock")
