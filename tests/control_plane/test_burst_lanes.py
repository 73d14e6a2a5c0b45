"""What keeps a burst of requests from freezing the control plane (issue 24, HIGH 1): read-only
sessions that wait for no writer, worker lanes that answer `503 BUSY` instead of waiting in
silence, and waits for the database that are saturation, not an outage."""

from __future__ import annotations

import importlib
import pkgutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import pytest
from fastapi import APIRouter
from sqlalchemy import create_engine, text, update
from sqlalchemy.exc import SQLAlchemyError

import control_plane.api as api_package
from control_plane.api.routing import LaneRoute
from control_plane.errors import Busy, InternalError, refusal_for
from control_plane.lanes import Lane
from control_plane.models import Secret
from tests.factories import ControlPlane, control_plane


@pytest.fixture
def cp(tmp_path: Path, database_url: str) -> Iterator[ControlPlane]:
    with control_plane(tmp_path / "data", database_url, request_queue_seconds=1.0) as plane:
        yield plane


def test_a_read_only_session_reads_and_refuses_any_write(cp: ControlPlane) -> None:
    response = cp.client.put(
        "/api/v1/admin/secrets/TOKEN", headers=cp.admin, json={"value": "v", "labels": {}}
    )
    assert response.status_code == 200, response.text
    with pytest.raises(SQLAlchemyError) as refused, cp.ctx.read_session_factory.begin() as session:
        assert session.get(Secret, "TOKEN") is not None
        session.execute(update(Secret).values(labels={"site": "x"}))
    # A read-only session that writes is a bug (500), never an outage or a busy database.
    assert isinstance(refusal_for(refused.value), InternalError)
    with cp.ctx.read_session_factory.begin() as session:
        row = session.get(Secret, "TOKEN")
        assert row is not None and row.labels == {}


def test_a_read_waits_for_no_writer_on_sqlite(tmp_path: Path) -> None:
    """Before, every transaction began IMMEDIATE: a read waited for the writer's commit (up to
    the 30 s busy timeout). A read-only one begins deferred and reads the last commit at once."""
    with control_plane(tmp_path / "data", f"sqlite:///{tmp_path / 'cp.db'}") as plane:
        with plane.ctx.session_factory.begin() as writer:
            now = plane.clock.now()
            writer.add(
                Secret(
                    name="HELD",
                    ciphertext=b"x",
                    key_id="k",
                    labels={},
                    created_at=now,
                    updated_at=now,
                )
            )
            writer.flush()  # the write lock is held until this block commits
            started = time.monotonic()
            with ThreadPoolExecutor(1) as pool:
                read = pool.submit(_count_secrets, plane)
                assert read.result(timeout=20) == 0  # the uncommitted row is not seen
            assert time.monotonic() - started < 5.0


def _count_secrets(plane: ControlPlane) -> int:
    with plane.ctx.read_session_factory.begin() as session:
        return int(session.execute(text("SELECT count(*) FROM secrets")).scalar_one())


def test_a_request_no_worker_takes_in_time_is_answered_busy_and_health_still_answers(
    cp: ControlPlane,
) -> None:
    """Four writes wait on a lock the test holds and take the admin lane's four threads; a job
    list behind them waits one second (`request_queue_seconds`) and is refused BUSY, not
    started; health, on its own lane, answers meanwhile; the writes finish once the lock goes."""
    body = {"value": "v", "labels": {}}
    assert cp.client.put("/api/v1/admin/secrets/HELD", headers=cp.admin, json=body).is_success
    with ThreadPoolExecutor(4) as pool:
        with cp.ctx.session_factory.begin() as holder:
            holder.get(Secret, "HELD", with_for_update=True)  # SQLite: the write lock
            writes = [
                pool.submit(
                    cp.client.put, "/api/v1/admin/secrets/HELD", headers=cp.admin, json=body
                )
                for _ in range(4)
            ]
            _wait_for(lambda: cp.ctx.lanes.admin.waiting == 0 and _lane_full(cp.ctx.lanes.admin))
            busy = cp.client.get("/api/v1/jobs", headers=cp.admin)
            health = cp.client.get("/api/v1/health")
            assert all(not write.done() for write in writes)
        answers = [write.result(timeout=60) for write in writes]
    assert busy.status_code == 503, busy.text
    assert busy.headers["Retry-After"] == "2"
    error = busy.json()["error"]
    assert error["code"] == "BUSY"
    assert "admin requests" in error["message"] and "nothing changed" in error["message"]
    assert "Retry" in error["next_step"]
    assert health.status_code == 200, health.text
    assert [answer.status_code for answer in answers] == [200] * 4


def _lane_full(lane: Lane) -> bool:
    return lane._admission.value == 0  # noqa: SLF001 - the lane's free threads


def _wait_for(predicate: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_lane_serves_in_order_and_refuses_after_its_queue_time() -> None:
    lane = Lane("admin", threads=1, queue_seconds=0.3)
    release = threading.Event()
    order: list[str] = []

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(lane.run, lambda: release.wait(30) and order.append("first"))
            await anyio.sleep(0.05)
            with pytest.raises(Busy) as refused:
                await lane.run(lambda: order.append("never"))
            assert refused.value.code == "BUSY"
            assert refused.value.response_headers() == {"Retry-After": "2"}
            release.set()
        await lane.run(lambda: order.append("after"))

    anyio.run(main)
    assert order == ["first", "after"]
    assert lane.refused == 1 and lane.waiting == 0


def test_a_wait_for_a_pooled_connection_that_runs_out_is_busy_not_an_outage(
    tmp_path: Path,
) -> None:
    engine = create_engine(
        f"sqlite:///{tmp_path / 'pool.db'}", pool_size=1, max_overflow=0, pool_timeout=0.1
    )
    try:
        with engine.connect(), pytest.raises(SQLAlchemyError) as waited, engine.connect():
            pass
    finally:
        engine.dispose()
    refusal = refusal_for(waited.value)
    assert isinstance(refusal, Busy) and refusal.http_status == 503


def test_every_router_runs_its_blocking_endpoints_on_a_lane() -> None:
    """A router without `LaneRoute` would run its sync endpoints on FastAPI's shared pool, where
    an open transaction can wait for a thread again."""
    routers = []
    for module in pkgutil.iter_modules(api_package.__path__):
        loaded = importlib.import_module(f"control_plane.api.{module.name}")
        routers += [v for v in vars(loaded).values() if isinstance(v, APIRouter)]
    assert len(routers) >= 12
    assert all(router.route_class is LaneRoute for router in routers)
