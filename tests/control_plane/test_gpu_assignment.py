"""GPU assignment: each running job holds specific GPUs of its node, never shared; a job asking
for more GPUs than are free waits; the assignment is in the job view and in what the agent
is handed. SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from control_plane.models import Job
from control_plane.scheduling.placement import PlacedJob, place_batch
from control_plane.scheduling.queue import QUEUED_COLUMNS, JobQueue, queued_job
from tests.control_plane.test_jobs import _claim, _node, _submit
from tests.factories import ControlPlane, control_plane


def _gpus(node: dict[str, str]) -> list[dict[str, Any]]:
    """The GPUs `_node(..., gpus=2)` reports for `node`, as an assignment names them."""
    return [{"index": i, "uuid": f"GPU-{node['node_id']}-{i}"} for i in range(2)]


def _view(cp: ControlPlane, job_id: str) -> dict[str, Any]:
    response = cp.client.get(f"/api/v1/jobs/{job_id}", headers=cp.admin)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _complete(cp: ControlPlane, node: dict[str, str], job_id: str) -> None:
    response = cp.client.post(
        f"/api/v1/agent/jobs/{job_id}/complete",
        headers={"Authorization": node["Authorization"]},
        json={"state": "succeeded", "result": 1},
    )
    assert response.status_code == 200, response.text


def test_running_jobs_hold_distinct_gpus_and_a_bigger_job_waits(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, cpus=16, gpus=2)
        gpu0, gpu1 = _gpus(node)
        one_a = _submit(cp, resources={"cpus": 1, "gpus": 1})
        one_b = _submit(cp, resources={"cpus": 1, "gpus": 1})
        both = _submit(cp, resources={"cpus": 1, "gpus": 2})
        cpu_only = _submit(cp, resources={"cpus": 1, "gpus": 0})
        assert _view(cp, both["job_id"])["assigned_gpus"] == []  # queued: holds nothing

        first, second = _claim(cp, node), _claim(cp, node)
        assert first is not None and second is not None
        assert [first["job_id"], second["job_id"]] == [one_a["job_id"], one_b["job_id"]]
        assert first["assigned_gpus"] == [gpu0] and second["assigned_gpus"] == [gpu1]
        assert _view(cp, one_a["job_id"])["assigned_gpus"] == [gpu0]
        assert _view(cp, one_b["job_id"])["assigned_gpus"] == [gpu1]

        # No GPU is free: the 2-GPU job waits, the CPU job goes past it and gets no GPU.
        third = _claim(cp, node)
        assert third is not None and third["job_id"] == cpu_only["job_id"]
        assert third["assigned_gpus"] == []
        assert _view(cp, cpu_only["job_id"])["assigned_gpus"] == []
        assert _claim(cp, node) is None

        # One GPU free is not enough for it.
        _complete(cp, node, one_a["job_id"])
        assert _claim(cp, node) is None
        assert _view(cp, both["job_id"])["state"] == "queued"

        _complete(cp, node, one_b["job_id"])
        fourth = _claim(cp, node)
        assert fourth is not None and fourth["job_id"] == both["job_id"]
        assert fourth["assigned_gpus"] == [gpu0, gpu1]
        view = _view(cp, both["job_id"])
        assert view["state"] == "running" and view["assigned_gpus"] == [gpu0, gpu1]
        running_event = [
            e
            for e in cp.client.get(f"/api/v1/jobs/{both['job_id']}/events", headers=cp.admin).json()
            if e["kind"] == "state" and e["data"].get("state") == "running"
        ]
        assert running_event[0]["data"]["assigned_gpus"] == [gpu0, gpu1]

        # A finished job keeps what it held on record; the GPUs are free again.
        assert _view(cp, one_a["job_id"])["assigned_gpus"] == [gpu0]
        _complete(cp, node, both["job_id"])
        again = _submit(cp, resources={"cpus": 1, "gpus": 1})
        got = _claim(cp, node)
        assert got is not None and got["job_id"] == again["job_id"]
        assert got["assigned_gpus"] == [gpu0]


def test_batches_at_the_same_moment_never_share_a_gpu(tmp_path: Path, database_url: str) -> None:
    """Three schedulers (as three replicas would) each place a claim of the same node at the
    same moment, each with its own copy of the queue: the node's row lock and the conditional
    update hand out both GPUs, each once, and the third batch places nothing."""
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, cpus=16, gpus=2)
        for _ in range(3):
            _submit(cp, resources={"cpus": 1, "gpus": 1})
        ctx = cp.ctx
        start = threading.Barrier(3)
        placed: list[list[PlacedJob]] = []
        errors: list[BaseException] = []

        def batch() -> None:
            try:
                queue = JobQueue()
                with ctx.session_factory() as session:
                    for row in session.execute(
                        select(*QUEUED_COLUMNS).where(Job.state == "queued")
                    ):
                        queue.add(queued_job(row))
                start.wait(10)
                with ctx.session_factory.begin() as session:
                    result = place_batch(
                        session=session,
                        clock=ctx.clock,
                        liveness=ctx.liveness,
                        waiting={node["node_id"]: 1},
                        queue=queue,
                        room_elsewhere=lambda shape: False,
                    )
                placed.append(result.placed)
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=batch) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == []
        holding = sorted(
            (job.assigned_gpus for jobs in placed for job in jobs),
            key=lambda gpus: gpus[0]["index"],
        )
        assert holding == [[gpu] for gpu in _gpus(node)]  # both GPUs, each once
        assert sorted(len(jobs) for jobs in placed) == [0, 1, 1]  # the third waits
        assert len({job.id for jobs in placed for job in jobs}) == 2


def test_a_job_running_from_before_assignment_still_counts_its_gpus(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, cpus=16, gpus=2)
        old = _submit(cp, resources={"cpus": 1, "gpus": 1})
        assert _claim(cp, node) is not None
        # As a job claimed before GPUs were recorded looks: running, holding one, unnamed.
        with cp.ctx.session_factory.begin() as session:
            session.execute(update(Job).where(Job.id == old["job_id"]).values(assigned_gpus=None))
        _submit(cp, resources={"cpus": 1, "gpus": 2})
        assert _claim(cp, node) is None
        single = _submit(cp, resources={"cpus": 1, "gpus": 1})
        got = _claim(cp, node)
        assert got is not None and got["job_id"] == single["job_id"]
        assert len(got["assigned_gpus"]) == 1
        assert _claim(cp, node) is None
