"""Agents' outcomes are committed in groups (SC-3): many completions at once cost a few
transactions, each agent's refusal stays its own, and nothing is answered before its commit.
SQLite and PostgreSQL."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from control_plane.jobs.reports import Outcome, complete_jobs
from tests.control_plane.test_jobs import _claim, _job, _node
from tests.factories import ControlPlane, control_plane


def _complete(cp: ControlPlane, node: dict[str, str], job_id: str, **body: Any) -> Any:
    return cp.client.post(
        f"/api/v1/agent/jobs/{job_id}/complete",
        headers={"Authorization": node["Authorization"]},
        json={"state": "succeeded", "result": {"job": job_id}, **body},
    )


def test_many_completions_at_once_share_transactions(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, cpus=64)
        cp.client.post("/api/v1/jobs:batch", headers=cp.admin, json={"jobs": [_job()] * 40})
        claimed = [_claim(cp, node) for _ in range(40)]
        job_ids = [c["job_id"] for c in claimed if c]
        assert len(job_ids) == 40
        before = cp.ctx.completions.groups
        with ThreadPoolExecutor(max_workers=40) as pool:
            answers = list(pool.map(lambda job_id: _complete(cp, node, job_id), job_ids))
        assert [a.status_code for a in answers] == [200] * 40
        groups = cp.ctx.completions.groups - before
        assert groups < 40, groups
        for job_id in job_ids:  # answered means committed
            view = cp.client.get(f"/api/v1/jobs/{job_id}", headers=cp.admin).json()
            assert view["state"] == "succeeded" and view["result"] == {"job": job_id}
        events = cp.client.get(f"/api/v1/jobs/{job_ids[0]}/events", headers=cp.admin).json()
        assert [e["data"].get("state") for e in events] == ["queued", "running", "succeeded"]


def test_a_refused_outcome_refuses_only_its_own_agent(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        mine, other = _node(cp), _node(cp)
        cp.client.post("/api/v1/jobs:batch", headers=cp.admin, json={"jobs": [_job()] * 3})
        first, second, third = (_claim(cp, mine)["job_id"] for _ in range(3))  # type: ignore[index]
        cancel = cp.client.post(f"/api/v1/jobs/{third}/cancel", headers=cp.admin)
        assert cancel.json()["cancel_requested"] is True
        outcomes = [
            Outcome(first, other["node_id"], "succeeded", 1, {}, None),  # not its job
            Outcome(first, mine["node_id"], "succeeded", 1, {}, None),
            Outcome(first, mine["node_id"], "succeeded", 2, {}, None),  # twice in one group
            Outcome(second, mine["node_id"], "failed", None, {}, None),
            Outcome(third, mine["node_id"], "succeeded", 3, {}, None),  # cancel was requested
            Outcome("job_unknown", mine["node_id"], "succeeded", 1, {}, None),
        ]
        with cp.ctx.session_factory.begin() as session:
            problems = complete_jobs(session=session, clock=cp.clock, outcomes=outcomes)
        codes = [None if p is None else p.code for p in problems]
        assert codes == [
            "JOB_NOT_ASSIGNED",
            None,
            "JOB_NOT_RUNNING",
            None,
            None,
            "JOB_NOT_ASSIGNED",
        ]
        views = {
            job_id: cp.client.get(f"/api/v1/jobs/{job_id}", headers=cp.admin).json()
            for job_id in (first, second, third)
        }
        assert views[first]["state"] == "succeeded" and views[first]["result"] == 1
        assert views[second]["error"]["code"] == "JOB_FAILED"
        assert views[third]["state"] == "cancelled" and views[third]["result"] is None
        # Through the API: a completion for a job that ended is refused to that agent.
        again = _complete(cp, mine, first)
        assert again.status_code == 409 and again.json()["error"]["code"] == "JOB_NOT_RUNNING"
