"""WL-2 across replicas: two control planes on one PostgreSQL. A claim parked on one replica
is woken by a submission on the other (LISTEN/NOTIFY), and a job is handed out exactly once."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from tests.factories import PYTHON_JOB, ControlPlane, two_replicas


def test_claim_on_one_replica_is_woken_by_a_submit_on_the_other(
    tmp_path: Path, pg_database_url: str
) -> None:
    """Both replicas run on one manual clock that never moves here, so the claim's 10 s hold
    cannot run out: only a wake-up carried from A to B (NOTIFY) ends it. No real-time bound:
    under a loaded parallel run A's submit alone took seconds (stop 49's CI)."""
    with two_replicas(tmp_path, pg_database_url) as (a, b):
        node_on_b = b.ready_node().headers
        result: dict[str, Any] = {}

        def park() -> None:
            response = b.client.post(
                "/api/v1/agent/work/claim", headers=node_on_b, json={"hold_seconds": 10}
            )
            result["status"] = response.status_code
            result["job"] = response.json() if response.status_code == 200 else None

        held_at = a.clock.monotonic()
        waiter = threading.Thread(target=park)
        waiter.start()
        deadline = time.monotonic() + 15
        while b.ctx.scheduler.waiting == 0:  # parked in its long poll on replica B
            assert time.monotonic() < deadline, "the claim never parked on replica B"
            time.sleep(0.01)
        assert "status" not in result  # nothing to claim yet: it holds
        submitted = a.client.post("/api/v1/jobs", headers=a.admin, json=PYTHON_JOB).json()
        waiter.join(30)
        assert not waiter.is_alive(), "the claim parked on B was never woken by A's submit"
        assert a.clock.monotonic() == held_at  # no hold ran out: a wake-up ended it
        assert result["status"] == 200
        assert result["job"]["job_id"] == submitted["job_id"]


def test_a_job_is_claimed_once_across_replicas(tmp_path: Path, pg_database_url: str) -> None:
    with two_replicas(tmp_path, pg_database_url) as (a, b):
        node_a, node_b = a.ready_node().headers, b.ready_node().headers
        jobs = [
            a.client.post("/api/v1/jobs", headers=a.admin, json=PYTHON_JOB).json()["job_id"]
            for _ in range(10)
        ]
        claimed: list[str] = []
        lock = threading.Lock()

        def drain(cp: ControlPlane, headers: dict[str, str]) -> None:
            while True:
                response = cp.client.post(
                    "/api/v1/agent/work/claim", headers=headers, json={"hold_seconds": 0}
                )
                if response.status_code != 200:
                    return
                with lock:
                    claimed.append(response.json()["job_id"])

        threads = [
            threading.Thread(target=drain, args=(a, node_a)),
            threading.Thread(target=drain, args=(b, node_b)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(claimed) == sorted(jobs)  # every job once, none twice
