"""The scheduler gates on per-GPU health (issue 28): a GPU unhealthy or quarantined is never
handed out, a degraded one last; a job pinned to a GPU (its active check) gets exactly that GPU,
out of the schedule or not, and no other job does; a queued job's waiting reason names the GPUs
out of the schedule that keep it waiting; the resources view shows each GPU's health. Real claims
over the app's HTTP interface, the GPUs' health as rows of `gpu_health` (the agents' reports and
the admin API write them elsewhere). SQLite and PostgreSQL."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, update

from control_plane.background.service_placement import place_services
from control_plane.jobs.lifecycle import submit_job
from control_plane.jobs.schemas import JobCreate
from control_plane.models import GpuHealth, Node
from control_plane.scheduling.dispatch import CAPACITY, jobs_changed, node_key
from control_plane.scheduling.fleet_view import MAX_AGE_SECONDS
from control_plane.scheduling.shapes import Capacity, Request, Shape
from tests.control_plane.test_gpu_assignment import _complete
from tests.control_plane.test_jobs import _claim, _job, _node, _submit
from tests.control_plane.test_scheduler import _long_claim, _reason
from tests.factories import ControlPlane, control_plane

ONE_GPU = {"cpus": 1, "gpus": 1}


def _uuid(node: dict[str, str], index: int) -> str:
    """The UUID `_node(..., gpus=n)` reports for its GPU `index`."""
    return f"GPU-{node['node_id']}-{index}"


def _named(cp: ControlPlane, node: dict[str, str], name: str) -> None:
    with cp.ctx.session_factory.begin() as session:
        session.execute(update(Node).where(Node.id == node["node_id"]).values(display_name=name))


def _set_health(
    cp: ControlPlane, node: dict[str, str], index: int, state: str, reason: str = ""
) -> None:
    """GPU `index` of `node` in `state` (`healthy` removes its row), and the wake-up the health
    domain sends with a change: `capacity` and the node's key."""
    uuid, now = _uuid(node, index), cp.clock.now()
    with cp.ctx.session_factory.begin() as session:
        session.execute(
            delete(GpuHealth).where(GpuHealth.node_id == node["node_id"], GpuHealth.uuid == uuid)
        )
        if state != "healthy":
            quarantined = state == "quarantined"
            session.add(
                GpuHealth(
                    node_id=node["node_id"],
                    uuid=uuid,
                    index=index,
                    state=state,
                    rules_state="healthy" if quarantined else state,
                    reported="healthy" if quarantined else state,
                    reason="" if quarantined else reason,
                    evidence=[],
                    since=now,
                    reported_at=now,
                    quarantine_reason=reason if quarantined else None,
                    quarantined_at=now if quarantined else None,
                )
            )
        jobs_changed(session, [CAPACITY, node_key(node["node_id"])])


def _submit_pinned(cp: ControlPlane, node: dict[str, str], index: int) -> str:
    """A job pinned to GPU `index` of `node`, queued as the re-admission queues its active
    check: the job's row with `pinned`, in the transaction that queues it."""
    with cp.ctx.session_factory.begin() as session:
        job = submit_job(
            session=session,
            clock=cp.clock,
            request=JobCreate.model_validate(_job(resources=ONE_GPU)),
        )
        job.pinned = {"node_id": node["node_id"], "uuid": _uuid(node, index)}
        return job.id


def _fresh_reason(cp: ControlPlane, job_id: str) -> dict[str, Any]:
    """The waiting reason from a fleet view read after everything before this call."""
    cp.clock.advance(MAX_AGE_SECONDS + 0.1)
    reason = _reason(cp, job_id)
    assert reason is not None
    return reason


def test_a_capacity_keeps_gpus_out_of_the_schedule_apart_and_degraded_ones_last() -> None:
    inventory = {
        "cpu_count": 8,
        "memory_mb": 1000,
        "gpus": [{"index": i, "uuid": f"G{i}"} for i in range(5)],
    }
    health = {"G0": "degraded", "G1": "quarantined", "G3": "unhealthy", "G4": "retired?"}
    capacity = Capacity.of_inventory(inventory, health)
    # Healthy first, then degraded; unhealthy, quarantined and a state it does not know: apart.
    assert [gpu["uuid"] for gpu in capacity.gpus] == ["G2", "G0"]
    assert [gpu["uuid"] for gpu in capacity.blocked] == ["G1", "G3", "G4"]
    assert capacity.pick_gpus(Request(1, 1, 0)) == [{"index": 2, "uuid": "G2"}]
    assert capacity.pick_gpus(Request(1, 2, 0)) == [
        {"index": 2, "uuid": "G2"},
        {"index": 0, "uuid": "G0"},
    ]
    assert capacity.fits(Request(1, 2, 0)) and not capacity.fits(Request(1, 3, 0))
    # Whole, it has five: big enough for five at all.
    assert capacity.counting_blocked().fits(Request(1, 5, 0))

    # A job pinned to a GPU out of the schedule fits while that GPU is free, and gets it.
    pinned = Shape.of({}, "require", {"gpus": 1}, pinned={"node_id": "n", "uuid": "G3"})
    assert pinned.fits(capacity) and capacity.pick_gpus(pinned.request, "G3") == [
        {"index": 3, "uuid": "G3"}
    ]
    assert pinned.admits({}, "n") and not pinned.admits({}, "other") and not pinned.admits({})
    held = capacity.minus(pinned.request, [{"index": 3, "uuid": "G3"}])
    assert not pinned.fits(held) and [gpu["uuid"] for gpu in held.blocked] == ["G1", "G4"]
    # No health known: as before, every GPU by index.
    assert Capacity.of_inventory(inventory) == Capacity(
        8.0, tuple({"index": i, "uuid": f"G{i}"} for i in range(5)), 1000
    )


def test_a_batch_never_hands_out_a_gpu_out_of_the_schedule_and_degraded_ones_last(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, cpus=16, gpus=4)
        _named(cp, node, "gpu-a")
        _set_health(cp, node, 0, "quarantined", "fan replaced")
        _set_health(cp, node, 1, "degraded", "corrected ECC errors growing")
        _set_health(cp, node, 2, "unhealthy", "XID 79 (GPU has fallen off the bus)")
        jobs = [_submit(cp, resources=ONE_GPU)["job_id"] for _ in range(3)]

        first, second = _claim(cp, node), _claim(cp, node)
        assert first is not None and first["job_id"] == jobs[0]
        assert [gpu["index"] for gpu in first["assigned_gpus"]] == [3]  # healthy first
        assert second is not None and second["job_id"] == jobs[1]
        assert [gpu["index"] for gpu in second["assigned_gpus"]] == [1]  # then degraded
        assert _claim(cp, node) is None  # GPUs 0 and 2 are free, and out of the schedule

        reason = _fresh_reason(cp, jobs[2])
        assert reason["code"] == "NO_ROOM"
        assert reason["message"] == (
            "needs 1 GPU; the most free on any online node is 0 (node gpu-a: GPU 0 "
            "quarantined: fan replaced; GPU 2 unhealthy: XID 79 (GPU has fallen off the bus))"
        )
        assert "back in the schedule" in reason["next_step"]

        # Nor does a service get one.
        response = cp.client.post(
            "/api/v1/services",
            headers=cp.admin,
            json={
                "name": "web",
                "command": ["python3", "-m", "http.server", "{port}"],
                "resources": ONE_GPU,
            },
        )
        assert response.status_code == 201, response.text
        assert place_services(cp.ctx) == 0

        # The healthy GPU's job ends: the waiting job gets that one, never 0 or 2.
        _complete(cp, node, jobs[0])
        third = _claim(cp, node)
        assert third is not None and third["job_id"] == jobs[2]
        assert [gpu["index"] for gpu in third["assigned_gpus"]] == [3]


def test_one_job_runs_on_the_other_gpu_and_the_second_waits_naming_the_quarantine(
    tmp_path: Path, database_url: str
) -> None:
    """Issue 28's acceptance: two 1-GPU jobs on a two-GPU node with one GPU quarantined."""
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, cpus=8, gpus=2)
        _named(cp, node, "gpu-a")
        _set_health(cp, node, 1, "quarantined", "suspect memory, RMA #4411")
        one, two = (_submit(cp, resources=ONE_GPU)["job_id"] for _ in range(2))

        got = _claim(cp, node)
        assert got is not None and got["job_id"] == one
        assert got["assigned_gpus"] == [{"index": 0, "uuid": _uuid(node, 0)}]
        assert _claim(cp, node) is None
        reason = _fresh_reason(cp, two)
        assert reason["code"] == "NO_ROOM"
        assert reason["message"] == (
            "needs 1 GPU; the most free on any online node is 0 "
            "(node gpu-a: GPU 1 quarantined: suspect memory, RMA #4411)"
        )

        # The quarantine is lifted while the node's claim waits: the wake-up (`capacity`,
        # `node:<id>`) places the second job on GPU 1, and its reason is gone.
        with ThreadPoolExecutor(max_workers=1) as pool:
            claim = pool.submit(_long_claim, cp, node, 30.0)
            while cp.ctx.scheduler.waiting == 0:
                time.sleep(0.01)
            _set_health(cp, node, 1, "healthy")
            placed = claim.result(timeout=15)
        assert placed is not None and placed["job_id"] == two
        assert placed["assigned_gpus"] == [{"index": 1, "uuid": _uuid(node, 1)}]
        assert _reason(cp, two) is None


@pytest.mark.parametrize("state", ["quarantined", "unhealthy"])
def test_a_pinned_job_gets_its_gpu_out_of_the_schedule_and_no_other_job_does(
    tmp_path: Path, database_url: str, state: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        a = _node(cp, cpus=8, gpus=2)
        b = _node(cp, cpus=8, gpus=1)
        _named(cp, a, "gpu-a")
        _named(cp, b, "gpu-b")
        _set_health(cp, a, 0, state, "XID 79 (GPU has fallen off the bus)")
        check = _submit_pinned(cp, a, 0)
        other = _submit(cp, resources=ONE_GPU)["job_id"]

        reason = _fresh_reason(cp, check)
        assert reason["code"] == "WAITING_FOR_CLAIM"
        assert reason["message"].startswith("pinned to GPU 0 of node gpu-a, which is free")

        # Another node never gets it, though it is older and that node has a free GPU.
        got_b = _claim(cp, b)
        assert got_b is not None and got_b["job_id"] == other
        assert _claim(cp, b) is None

        got = _claim(cp, a)
        assert got is not None and got["job_id"] == check
        assert got["assigned_gpus"] == [{"index": 0, "uuid": _uuid(a, 0)}]

        # A second job pinned to that GPU waits while the first holds it; an ordinary job gets
        # the healthy GPU 1, never GPU 0.
        second_check = _submit_pinned(cp, a, 0)
        ordinary = _submit(cp, resources=ONE_GPU)["job_id"]
        got = _claim(cp, a)
        assert got is not None and got["job_id"] == ordinary
        assert [gpu["index"] for gpu in got["assigned_gpus"]] == [1]
        assert _claim(cp, a) is None
        reason = _fresh_reason(cp, second_check)
        assert reason["code"] == "NO_ROOM"
        assert reason["message"] == "pinned to GPU 0 of node gpu-a, which running work holds"

        # The check ends: GPU 0 is free for the second check, still for no one else.
        _complete(cp, a, check)
        late = _submit(cp, resources=ONE_GPU)["job_id"]
        got = _claim(cp, a)
        assert got is not None and got["job_id"] == second_check
        assert _claim(cp, a) is None
        assert _fresh_reason(cp, late)["code"] == "NO_ROOM"

        # Its node offline: the pinned job's reason says so.
        third_check = _submit_pinned(cp, a, 0)
        cp.clock.advance(cp.ctx.settings.node_offline_after_seconds + 1)
        reason = _fresh_reason(cp, third_check)
        assert reason["code"] == "NODES_OFFLINE"
        assert reason["message"] == "pinned to GPU 0 of node gpu-a, which is offline"


def test_the_resources_view_shows_each_gpus_health_and_counts_those_out_as_not_free(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, cpus=8, gpus=3)
        _set_health(cp, node, 0, "quarantined", "maintenance")
        _set_health(cp, node, 2, "degraded", "throttled")
        response = cp.client.get("/api/v1/admin/resources", headers=cp.admin)
        assert response.status_code == 200, response.text
        (view,) = response.json()["nodes"]
        assert [(gpu["index"], gpu["health"]) for gpu in view["gpus"]] == [
            (0, "quarantined"),
            (1, "healthy"),
            (2, "degraded"),
        ]
        assert view["capacity"]["total"]["gpus"] == 3
        assert view["capacity"]["held"]["gpus"] == 0
        assert view["capacity"]["free"]["gpus"] == 2  # the quarantined one is not free
