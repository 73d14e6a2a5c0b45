"""One call says "jobs changed": `jobs_changed(session)` wakes this process's waiters, and every
replica's through PostgreSQL NOTIFY, only once the session's transaction commits (WL-2)."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from control_plane.db import make_engine, make_session_factory
from control_plane.dispatch import CHANNEL, Dispatcher, jobs_changed


class _Boom(Exception):
    pass


def test_wakes_after_commit_and_never_after_rollback(database_url: str) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    dispatcher = Dispatcher()
    dispatcher.attach(factory)

    async def scenario() -> list[int]:
        dispatcher.bind(asyncio.get_running_loop())
        seen = [dispatcher.generation]

        async def settle() -> None:
            await asyncio.sleep(0.01)  # let call_soon_threadsafe run
            seen.append(dispatcher.generation)

        with factory.begin() as session:
            jobs_changed(session)
            session.execute(text("SELECT 1"))
            await asyncio.sleep(0.01)
            seen.append(dispatcher.generation)  # not yet: the transaction is still open
        await settle()
        with pytest.raises(_Boom), factory.begin() as session:
            jobs_changed(session)
            raise _Boom
        await settle()
        with factory.begin() as session:
            session.execute(text("SELECT 1"))  # a commit that changed no job
        await settle()
        with factory() as session:
            jobs_changed(session, replicas=False)
            session.commit()
        await settle()
        return seen

    try:
        first, during, committed, rolled_back, unrelated, local = asyncio.run(scenario())
    finally:
        engine.dispose()
    assert during == first
    assert committed == first + 1
    assert rolled_back == committed
    assert unrelated == committed
    assert local == committed + 1


def test_other_replicas_hear_only_committed_changes(pg_database_url: str) -> None:
    engine = make_engine(pg_database_url)
    factory = make_session_factory(engine)
    Dispatcher().attach(factory)
    conninfo = make_url(pg_database_url).set(drivername="postgresql").render_as_string(False)
    try:
        with psycopg.connect(conninfo, autocommit=True) as listener:
            listener.execute(f"LISTEN {CHANNEL}")
            with pytest.raises(_Boom), factory.begin() as session:
                jobs_changed(session)
                raise _Boom
            with factory.begin() as session:
                jobs_changed(session, replicas=False)  # progress: this process only
            with factory.begin() as session:
                jobs_changed(session)
                jobs_changed(session, replicas=False)  # never downgrades the first
            heard = list(listener.notifies(timeout=1.0))
    finally:
        engine.dispose()
    assert [n.channel for n in heard] == [CHANNEL]
