"""One call says "jobs changed": `jobs_changed(session, keys)` wakes this process's waiters on
those keys, and every replica's through PostgreSQL NOTIFY, only once the session's transaction
commits (WL-2); a waiter on other keys sleeps on (SC-2)."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from control_plane.clock import ManualClock, SystemClock
from control_plane.db import make_engine, make_session_factory
from control_plane.scheduling.dispatch import CHANNEL, Dispatcher, Keys, jobs_changed


class _Boom(Exception):
    pass


def test_wakes_after_commit_and_never_after_rollback(database_url: str) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    dispatcher = Dispatcher(clock=SystemClock())
    dispatcher.attach(factory)
    heard: list[Keys] = []
    dispatcher.subscribe(heard.append)

    async def scenario() -> list[list[Keys]]:
        dispatcher.bind(asyncio.get_running_loop())
        seen: list[list[Keys]] = []

        async def settle() -> None:
            await asyncio.sleep(0.01)  # let call_soon_threadsafe run
            seen.append(list(heard))
            heard.clear()

        with factory.begin() as session:
            jobs_changed(session, ["job:a"])
            session.execute(text("SELECT 1"))
            await asyncio.sleep(0.01)
            seen.append(list(heard))  # not yet: the transaction is still open
        await settle()
        with pytest.raises(_Boom), factory.begin() as session:
            jobs_changed(session, ["job:b"])
            raise _Boom
        await settle()
        with factory.begin() as session:
            session.execute(text("SELECT 1"))  # a commit that changed no job
        await settle()
        with factory() as session:
            jobs_changed(session, ["job:c"], replicas=False)
            jobs_changed(session, ["node:n"], replicas=False)
            session.commit()
        await settle()
        return seen

    try:
        during, committed, rolled_back, unrelated, local = asyncio.run(scenario())
    finally:
        engine.dispose()
    assert during == []
    assert committed == [frozenset({"job:a"})]
    assert rolled_back == []
    assert unrelated == []
    assert local == [frozenset({"job:c", "node:n"})]


def test_a_change_wakes_only_the_waiters_on_its_keys(database_url: str) -> None:
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    dispatcher = Dispatcher(clock=SystemClock())
    dispatcher.attach(factory)
    attempts: dict[str, list[float]] = {"job:a": [], "job:b": []}

    async def scenario() -> tuple[str | None, str | None]:
        dispatcher.bind(asyncio.get_running_loop())
        loop = asyncio.get_running_loop()
        started = loop.time()

        def waiter(key: str) -> asyncio.Task[str | None]:
            async def attempt() -> str | None:
                attempts[key].append(loop.time() - started)
                return key if len(attempts[key]) > 1 and key == "job:a" else None

            return asyncio.create_task(dispatcher.poll(1.0, attempt, [key]))

        a, b = waiter("job:a"), waiter("job:b")
        await asyncio.sleep(0.05)
        with factory.begin() as session:
            jobs_changed(session, ["job:a"])
        return await a, await b

    try:
        woke_a, woke_b = asyncio.run(scenario())
    finally:
        engine.dispose()
    assert woke_a == "job:a" and len(attempts["job:a"]) == 2 and attempts["job:a"][1] < 0.5
    # Never woken by the other key's change: tried at the start and once more as its hold ended.
    assert woke_b is None and len(attempts["job:b"]) == 2 and attempts["job:b"][1] >= 0.9
    assert dispatcher.waiting == 0


def test_a_hold_is_counted_on_the_injected_clock() -> None:
    """A long poll's hold ends when the clock passes it, at once when a ManualClock is moved
    (here from another thread, as a test does), and never by real time alone."""
    clock = ManualClock()
    dispatcher = Dispatcher(clock=clock)
    attempts: list[float] = []

    async def scenario() -> tuple[bool, bool, str | None, int]:
        dispatcher.bind(asyncio.get_running_loop())

        async def attempt() -> str | None:
            attempts.append(clock.monotonic())
            return None

        poll = asyncio.create_task(dispatcher.poll(5.0, attempt, ["job:a"]))
        await asyncio.sleep(0.3)  # real time passes; the clock does not
        waited_real_time = not poll.done()
        await asyncio.to_thread(clock.advance, 4.9)
        await asyncio.sleep(0.05)
        waited_short_of_the_hold = not poll.done()
        await asyncio.to_thread(clock.advance, 0.2)
        found = await asyncio.wait_for(poll, 1.0)
        return waited_real_time, waited_short_of_the_hold, found, dispatcher.waiting

    waited_real_time, waited_short_of_the_hold, found, still_waiting = asyncio.run(scenario())
    assert waited_real_time and waited_short_of_the_hold
    assert found is None and still_waiting == 0
    # Tried at the start and once more as its hold ended on the clock: nothing else woke it.
    assert len(attempts) == 2 and attempts[0] == 0.0 and attempts[1] >= 5.0


def test_other_replicas_hear_only_committed_changes_and_their_keys(pg_database_url: str) -> None:
    engine = make_engine(pg_database_url)
    factory = make_session_factory(engine)
    dispatcher = Dispatcher(clock=SystemClock())
    dispatcher.attach(factory)
    conninfo = make_url(pg_database_url).set(drivername="postgresql").render_as_string(False)
    many = [f"queued:job_{i:024d}" for i in range(1000)]  # ~35 KB: more than one NOTIFY
    try:
        with psycopg.connect(conninfo, autocommit=True) as listener:
            listener.execute(f"LISTEN {CHANNEL}")
            with pytest.raises(_Boom), factory.begin() as session:
                jobs_changed(session, ["job:x"])
                raise _Boom
            with factory.begin() as session:
                jobs_changed(session, ["job:y"], replicas=False)  # progress: this process only
            with factory.begin() as session:
                jobs_changed(session, ["job:z"])
                jobs_changed(session, ["job:w"], replicas=False)  # never downgrades the first
            with factory.begin() as session:
                jobs_changed(session, many)
            heard = list(listener.notifies(timeout=1.0))
    finally:
        engine.dispose()
    assert {n.channel for n in heard} == {CHANNEL}
    payloads = [n.payload.split(" ") for n in heard]
    assert all(origin == dispatcher.origin for origin, *_ in payloads)
    assert payloads[0][1:] == ["job:w", "job:z"]
    assert len(payloads) > 2 and all(len(n.payload) < 8000 for n in heard)
    assert sorted(key for _, *keys in payloads[1:] for key in keys) == sorted(many)
