"""Wake-ups for long polls (WL-2): an agent waiting for work, or for a cancellation, is woken
the moment a job changes — in this process directly, across replicas through PostgreSQL
`LISTEN/NOTIFY` (SQLite deployments are one process, so the in-process path is the whole story).

"Jobs changed" is one call: a service that changes jobs calls `jobs_changed(session)`, and the
wake-up fires only once that session's transaction commits (a rolled-back change wakes no one).
The NOTIFY is sent inside the transaction, so PostgreSQL delivers it exactly when it commits.
Routers never touch the dispatcher for this.

Waiters re-read the database when woken; a wake-up carries no data and losing one only costs
the rest of a bounded hold.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import psycopg
from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)
CHANNEL = "modelforge_jobs"
T = TypeVar("T")
#: `Session.info` key: None (no change), False (wake this process), True (wake every replica).
_CHANGED = "modelforge.jobs_changed"


def jobs_changed(session: Session, *, replicas: bool = True) -> None:
    """Wake the waiters once `session` commits: in this process, and with `replicas` (the
    default) on every replica. Progress that only this process's followers await passes
    `replicas=False`."""
    session.info[_CHANGED] = replicas or bool(session.info.get(_CHANGED))


class Dispatcher:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._generation = 0
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._changed = asyncio.Event()

    @property
    def generation(self) -> int:
        return self._generation

    def notify(self) -> None:
        """Thread-safe: wake every waiter of this process."""
        if self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._generation += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def wait(self, seen_generation: int, timeout: float) -> int:
        """Return once the generation moved past `seen_generation`, or after `timeout`."""
        if self._generation != seen_generation or self._changed is None:
            return self._generation
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except TimeoutError:
            pass
        return self._generation

    async def poll(self, hold: float, attempt: Callable[[], Awaitable[T | None]]) -> T | None:
        """Try now; then again on every job change until `hold` seconds have passed."""
        deadline = time.monotonic() + hold
        while True:
            generation = self._generation
            found = await attempt()
            remaining = deadline - time.monotonic()
            if found is not None or remaining <= 0:
                return found
            await self.wait(generation, remaining)

    def attach(self, session_factory: sessionmaker[Session]) -> None:
        """Fire the wake-ups `jobs_changed` registers on sessions of `session_factory`."""
        event.listen(session_factory, "before_commit", _announce)
        event.listen(session_factory, "after_commit", self._after_commit)
        event.listen(session_factory, "after_rollback", _forget)

    def _after_commit(self, session: Session) -> None:
        if session.info.pop(_CHANGED, None) is not None:
            self.notify()

    # -- PostgreSQL listener ------------------------------------------------------------------

    def listen(self, sqlalchemy_url: str) -> None:
        url = make_url(sqlalchemy_url).set(drivername="postgresql")
        conninfo = url.render_as_string(hide_password=False)
        self._listener = threading.Thread(
            target=self._listen, args=(conninfo,), name="job-notify-listener", daemon=True
        )
        self._listener.start()

    def _listen(self, conninfo: str) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                with psycopg.connect(conninfo, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    if failures:
                        log.info("job notification listener reconnected")
                        failures = 0
                    self.notify()  # anything missed while disconnected
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=1.0):
                            self.notify()
            except psycopg.Error as exc:
                # Once per disconnection, not once a second: a database outage is reported
                # by the control plane's outage line; this only says wake-ups wait for it.
                failures += 1
                if failures == 1:
                    log.info(
                        "job notification listener lost its connection (%s); retrying",
                        type(exc).__name__,
                    )
                time.sleep(1.0)

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=5)


def _announce(session: Session) -> None:
    """Inside the committing transaction: tell the other replicas (PostgreSQL only)."""
    if session.info.get(_CHANGED) and session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_notify(:channel, '')"), {"channel": CHANNEL})


def _forget(session: Session) -> None:
    session.info.pop(_CHANGED, None)
