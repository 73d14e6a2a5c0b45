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
    with two_replicas(tmp_path, pg_database_url) as (a, b):
        node_on_b = b.ready_node().headers
        result: dict[str, Any] = {}

        def park() -> None:
            started = time.monotonic()
            response = b.client.post(
                "/api/v1/agent/work/claim", headers=node_on_b, json={"hold_seconds": 10}
            )
            result["status"], result["waited"] = response.status_code, time.monotonic() - started
            result["job"] = response.json() if response.status_code == 200 else None

        waiter = threading.Thread(target=park)
        waiter.start()
        time.sleep(0.5)  # parked in its long poll on replica B
        submitted = a.client.post("/api/v1/jobs", headers=a.admin, json=PYTHON_JOB).json()
        waiter.join(15)
        assert result["status"] == 200
        assert result["job"]["job_id"] == submitted["job_id"]
        assert result["waited"] < 3  # woken by NOTIFY, not by the 10 s hold running out


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
