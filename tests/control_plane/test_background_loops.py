"""The background loops judge a failure as a request's would be (`loops.every`): only a
database outage is counted as one. A wait for a saturated database that ran out (SQLite's write
lock held past the busy timeout, no pooled connection free) is retried quietly, and a write
refused for want of room is logged as the loop's failure, without a traceback: neither begins an
"outage" (which would log "database unavailable" and reset every node's contact grace).

Real SQLite databases: a lock held by another connection, a pool with its one connection taken,
a full tmpfs (mounting needs root, as test_storage_full)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from control_plane.background import loops
from control_plane.db import DatabaseAvailability, is_database_busy, make_engine
from control_plane.storage import is_storage_full
from tests.control_plane.test_storage_full import MIB, _fill, small_disk

#: Long enough for many rounds of a loop running every 10 ms, on a loaded machine too.
RUN_SECONDS = 1.0


def _run(work: Callable[[], object], database: DatabaseAvailability) -> int:
    """Run `work` in a background loop for `RUN_SECONDS`; how many rounds it ran."""
    rounds = 0

    def counted() -> object:
        nonlocal rounds
        rounds += 1
        return work()

    async def main() -> None:
        task = asyncio.create_task(loops.every("test loop", 0.01, counted, database))
        await asyncio.sleep(RUN_SECONDS)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    return rounds


def _no_outage(database: DatabaseAvailability, caplog: pytest.LogCaptureFixture) -> None:
    assert database.available
    assert not [r for r in caplog.records if "database unavailable" in r.getMessage()]


def test_a_write_lock_held_past_the_busy_timeout_is_not_an_outage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    engine = create_engine(url, connect_args={"timeout": 0.01})  # a 10 ms busy timeout
    holder = create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(text("CREATE TABLE t (x INTEGER)"))
        errors: list[BaseException] = []

        def write() -> None:
            try:
                with engine.begin() as connection:
                    connection.execute(text("INSERT INTO t VALUES (1)"))
            except Exception as exc:
                errors.append(exc)
                raise

        database = DatabaseAvailability()
        with holder.connect() as held:
            held.exec_driver_sql("BEGIN IMMEDIATE")  # another writer holds the lock throughout
            with caplog.at_level(logging.DEBUG, logger="control_plane"):
                rounds = _run(write, database)
            held.rollback()
        assert rounds > 1 and errors and all(is_database_busy(e) for e in errors), errors
        _no_outage(database, caplog)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        assert "waited too long for the database" in caplog.text
    finally:
        engine.dispose()
        holder.dispose()


def test_a_pool_with_no_free_connection_is_not_an_outage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = create_engine(
        f"sqlite:///{tmp_path / 'cp.db'}", pool_size=1, max_overflow=0, pool_timeout=0.01
    )
    errors: list[BaseException] = []

    def connect() -> None:
        try:
            with engine.connect():
                pass
        except Exception as exc:
            errors.append(exc)
            raise

    database = DatabaseAvailability()
    try:
        with engine.connect(), caplog.at_level(logging.DEBUG, logger="control_plane"):
            rounds = _run(connect, database)  # the pool's only connection is taken meanwhile
        assert rounds > 1 and errors and all(is_database_busy(e) for e in errors), errors
        _no_outage(database, caplog)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    finally:
        engine.dispose()


def test_a_full_disk_is_the_loops_failure_not_an_outage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = tmp_path / "disk"
    with small_disk(disk, 2 * MIB):
        engine = make_engine(f"sqlite:///{disk / 'cp.db'}")
        try:
            with engine.begin() as connection:
                connection.execute(text("CREATE TABLE t (x BLOB)"))
            _fill(disk)
            errors: list[BaseException] = []

            def write() -> None:
                try:
                    with engine.begin() as connection:
                        connection.execute(text("INSERT INTO t VALUES (randomblob(262144))"))
                except Exception as exc:
                    errors.append(exc)
                    raise

            database = DatabaseAvailability()
            with caplog.at_level(logging.WARNING, logger="control_plane"):
                rounds = _run(write, database)
        finally:
            engine.dispose()
    assert rounds > 1 and errors and all(is_storage_full(e) for e in errors), errors
    _no_outage(database, caplog)
    failed = [r for r in caplog.records if "test loop failed" in r.getMessage()]
    assert failed, caplog.text
    assert "the storage is full, 1 in a row" in failed[0].getMessage()
    assert not any(r.exc_info for r in failed), "a full disk is logged without a traceback"
