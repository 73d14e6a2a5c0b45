"""Reads that do not come from a GET's `SessionDep` take no lock either (issue 24): the metrics
scrape, the job-events long poll, the agents' cancellation watch and artifact download read in
read-only sessions, so SQLite's write lock held by a writer delays none of them, and two scrapes
waiting on it can no longer hold the threads `/api/v1/health` needs."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from control_plane.lanes import lane_of
from tests.control_plane.test_jobs import _claim, _node, _submit
from tests.factories import control_plane

#: Loose: each answer takes milliseconds; before, each waited SQLite's 30 s busy timeout.
PROMPT_SECONDS = 5.0


def test_reads_answer_while_a_writer_holds_sqlites_write_lock(tmp_path: Path) -> None:
    database = tmp_path / "cp.db"
    with control_plane(tmp_path / "data", f"sqlite:///{database}") as cp:
        node = _node(cp)
        agent = {"Authorization": node["Authorization"]}
        job = _submit(cp)
        assert _claim(cp, node) is not None
        payload = b"weights made on the node"
        digest = "sha256:" + hashlib.sha256(payload).hexdigest()
        uploaded = cp.client.put(
            f"/api/v1/agent/artifacts/{digest}", headers=agent, content=payload
        )
        assert uploaded.status_code == 201, uploaded.text

        reads: dict[str, Callable[[], Any]] = {
            "metrics 1": lambda: cp.client.get("/metrics", headers=cp.admin),
            "metrics 2": lambda: cp.client.get("/metrics", headers=cp.admin),
            "job events": lambda: cp.client.get(
                f"/api/v1/jobs/{job['job_id']}/events", headers=cp.admin
            ),
            "agent watch": lambda: cp.client.post(
                "/api/v1/agent/jobs/watch",
                headers=agent,
                json={"job_ids": [job["job_id"]], "hold_seconds": 0},
            ),
            "agent download": lambda: cp.client.get(
                f"/api/v1/agent/artifacts/{digest}", headers=agent
            ),
        }
        writer = sqlite3.connect(database, isolation_level=None, timeout=30)
        try:
            writer.execute("BEGIN IMMEDIATE")  # SQLite's one write lock, held by another writer
            with ThreadPoolExecutor(len(reads)) as pool:
                started = time.monotonic()
                answers = {name: pool.submit(read) for name, read in reads.items()}
                # Health comes last, behind the scrapes, on the lane they share.
                time.sleep(0.2)
                asked = time.monotonic()
                health = cp.client.get("/api/v1/health")
                health_seconds = time.monotonic() - asked
                late = [
                    name
                    for name, answer in answers.items()
                    if not _answered(answer, started + PROMPT_SECONDS)
                ]
                elapsed = time.monotonic() - started
                writer.execute("ROLLBACK")  # lets anything still waiting finish
                statuses = {
                    name: answer.result(timeout=60).status_code for name, answer in answers.items()
                }
        finally:
            writer.close()
    assert late == [], f"waited for the write lock: {late}"
    assert health.status_code == 200, health.text
    assert health_seconds < PROMPT_SECONDS
    assert elapsed < PROMPT_SECONDS + 1
    assert statuses == dict.fromkeys(reads, 200)


def _answered(answer: Any, deadline: float) -> bool:
    try:
        answer.result(timeout=max(deadline - time.monotonic(), 0.0))
    except TimeoutError:
        return False
    return True


def test_scrapes_that_take_every_metrics_thread_delay_no_health_probe(tmp_path: Path) -> None:
    """Before, `/metrics` shared the probe lane's two threads with `/api/v1/health`: two slow
    scrapes made health wait (and answer BUSY once its queue time ran out)."""
    with control_plane(
        tmp_path / "data", f"sqlite:///{tmp_path / 'cp.db'}", request_queue_seconds=1.0
    ) as cp:
        portal = cp.client.portal
        assert portal is not None
        release = threading.Event()
        lane = cp.ctx.lanes[lane_of("/metrics")]
        slow = [
            portal.start_task_soon(lane.run, lambda: release.wait(60)) for _ in range(lane.threads)
        ]
        try:
            _wait_for(lambda: lane._admission.value == 0)  # noqa: SLF001 - its free threads
            asked = time.monotonic()
            health = cp.client.get("/api/v1/health")
            health_seconds = time.monotonic() - asked
            scrape = cp.client.get("/metrics", headers=cp.admin)
        finally:
            release.set()
        for scrape_task in slow:
            scrape_task.result(timeout=60)
        assert cp.client.get("/metrics", headers=cp.admin).status_code == 200
    assert health.status_code == 200, health.text
    assert health_seconds < PROMPT_SECONDS
    # The scrape waited for its own lane only, and was told so.
    assert scrape.status_code == 503 and scrape.json()["error"]["code"] == "BUSY"
    assert "metrics requests" in scrape.json()["error"]["message"]


def _wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_agents_async_routes_run_on_the_agent_lane(tmp_path: Path) -> None:
    """The services sync and the cancellation watch are async routes: their blocking work ran
    on the default thread pool that every request's dependencies (health's included) share, so
    agent traffic could exhaust it. It runs on the agent lane: with that lane's threads taken,
    they wait there and are answered BUSY, naming it, while health answers at once."""
    with control_plane(
        tmp_path / "data", f"sqlite:///{tmp_path / 'cp.db'}", request_queue_seconds=1.0
    ) as cp:
        node = _node(cp)
        agent = {"Authorization": node["Authorization"]}
        job = _submit(cp)
        assert _claim(cp, node) is not None

        def sync() -> Any:
            return cp.client.post("/api/v1/agent/services/sync", headers=agent, json={})

        def watch() -> Any:
            return cp.client.post(
                "/api/v1/agent/jobs/watch",
                headers=agent,
                json={"job_ids": [job["job_id"]], "hold_seconds": 0},
            )

        portal = cp.client.portal
        assert portal is not None
        release = threading.Event()
        lane = cp.ctx.lanes.agent
        taken = [
            portal.start_task_soon(lane.run, lambda: release.wait(60)) for _ in range(lane.threads)
        ]
        try:
            _wait_for(lambda: lane._admission.value == 0)  # noqa: SLF001 - its free threads
            waited = [sync(), watch()]
            health = cp.client.get("/api/v1/health")
        finally:
            release.set()
        for task in taken:
            task.result(timeout=60)
        after = [sync(), watch()]
    for refused in waited:
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "BUSY"
        assert "agent requests" in refused.json()["error"]["message"]
    assert health.status_code == 200, health.text
    assert [answer.status_code for answer in after] == [200, 200], [a.text for a in after]
    assert after[1].json() == {"cancel": []}
