"""Wake-ups for long polls and the scheduler (WL-2, SC-2): a waiter is woken the moment something
it waits for changes — in this process directly, across replicas through PostgreSQL
`LISTEN/NOTIFY` (SQLite deployments are one process, so the in-process path is the whole story).

Every wake-up names what changed, as keys: `job:<id>` (that job: its followers), `node:<id>`
(a node's running work: its cancellation watch), `queued:<id>` (a job entered the queue: the
scheduler) and `capacity` (a running job ended, so a node has room again: the scheduler). A
waiter subscribes to the keys it cares about, so a change wakes only the waiters it can serve,
never all of them (no thundering herd).

"Jobs changed" is one call: a service that changes jobs calls `jobs_changed(session, keys)`, and
the wake-up fires only once that session's transaction commits (a rolled-back change wakes no
one). The NOTIFY is sent inside the transaction, so PostgreSQL delivers it exactly when it
commits; it carries this process's origin, so a replica ignores its own announcements.

Waiters re-read the database when woken; losing a wake-up only costs the rest of a bounded hold.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import psycopg
from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock, wait_until

log = logging.getLogger(__name__)
CHANNEL = "modelforge_jobs"
#: A running job ended: some node has room again.
CAPACITY = "capacity"
T = TypeVar("T")
#: `Session.info` key of the pending `_Change`.
_CHANGED = "modelforge.jobs_changed"
#: PostgreSQL refuses NOTIFY payloads of 8,000 bytes or more; longer key lists are split.
_PAYLOAD_LIMIT = 7_000

#: The keys a listener receives; None when anything may have changed (a listener reconnected).
Keys = frozenset[str] | None


def job_key(job_id: str) -> str:
    return f"job:{job_id}"


def node_key(node_id: str) -> str:
    return f"node:{node_id}"


def queued_key(job_id: str) -> str:
    return f"queued:{job_id}"


@dataclass
class _Change:
    keys: set[str] = field(default_factory=set)
    replicas: bool = False


def jobs_changed(session: Session, keys: Iterable[str], *, replicas: bool = True) -> None:
    """Wake the waiters on `keys` once `session` commits: in this process, and with `replicas`
    (the default) on every replica. Progress that only this process's followers await passes
    `replicas=False`."""
    change = session.info.get(_CHANGED)
    if change is None:
        change = session.info[_CHANGED] = _Change()
    change.keys.update(keys)
    change.replicas = change.replicas or replicas


class Dispatcher:
    def __init__(self, *, clock: Clock) -> None:
        #: What a long poll's hold counts in.
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._listeners: list[Callable[[Keys], None]] = []
        #: Written into every NOTIFY, so this process skips its own.
        self.origin = secrets.token_hex(8)
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def subscribe(self, listener: Callable[[Keys], None]) -> None:
        """Call `listener` on the event loop with the keys of every wake-up."""
        self._listeners.append(listener)

    def notify(self, keys: Iterable[str] | None) -> None:
        """Thread-safe: wake this process's waiters on `keys` (None: every waiter)."""
        if self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._wake, None if keys is None else frozenset(keys))

    def _wake(self, keys: Keys) -> None:
        if keys is None:
            woken = [e for events in self._waiters.values() for e in events]
            self._waiters.clear()
        else:
            woken = [e for key in keys for e in self._waiters.pop(key, ())]
        for waiter in woken:
            if not waiter.done():
                waiter.set_result(None)
        for listener in self._listeners:
            try:
                listener(keys)
            except Exception:
                log.exception("a wake-up listener failed")

    async def poll(
        self, hold: float, attempt: Callable[[], Awaitable[T | None]], keys: Collection[str]
    ) -> T | None:
        """Try now; then again whenever one of `keys` changes, until `hold` seconds have passed on
        the clock. The subscription is in place before each attempt, so no change slips between
        them."""
        deadline = self._clock.monotonic() + hold
        loop = asyncio.get_running_loop()
        while True:
            changed: asyncio.Future[None] = loop.create_future()
            for key in keys:
                self._waiters.setdefault(key, set()).add(changed)
            try:
                found = await attempt()
                if found is not None or deadline - self._clock.monotonic() <= 0:
                    return found
                await wait_until(self._clock, deadline, changed)
            finally:
                for key in keys:
                    waiting = self._waiters.get(key)
                    if waiting is not None:
                        waiting.discard(changed)
                        if not waiting:
                            del self._waiters[key]

    @property
    def waiting(self) -> int:
        """How many (key, waiter) subscriptions are open."""
        return sum(len(events) for events in self._waiters.values())

    def attach(self, session_factory: sessionmaker[Session]) -> None:
        """Fire the wake-ups `jobs_changed` registers on sessions of `session_factory`."""
        event.listen(session_factory, "before_commit", self._announce)
        event.listen(session_factory, "after_commit", self._after_commit)
        event.listen(session_factory, "after_rollback", _forget)

    def _announce(self, session: Session) -> None:
        """Inside the committing transaction: tell the other replicas (PostgreSQL only)."""
        change: _Change | None = session.info.get(_CHANGED)
        if change is None or not change.replicas or not change.keys:
            return
        if session.get_bind().dialect.name != "postgresql":
            return
        for payload in _payloads(self.origin, sorted(change.keys)):
            session.execute(
                text("SELECT pg_notify(:channel, :payload)"),
                {"channel": CHANNEL, "payload": payload},
            )

    def _after_commit(self, session: Session) -> None:
        change: _Change | None = session.info.pop(_CHANGED, None)
        if change is not None and change.keys:
            self.notify(change.keys)

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
                    self.notify(None)  # anything missed while disconnected
                    while not self._stop.is_set():
                        for heard in conn.notifies(timeout=1.0):
                            origin, _, keys = heard.payload.partition(" ")
                            if origin != self.origin:
                                self.notify(keys.split() if keys else None)
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


def _payloads(origin: str, keys: list[str]) -> Iterable[str]:
    """`<origin> <key> <key> ...`, split so each stays under PostgreSQL's payload limit."""
    chunk: list[str] = []
    size = len(origin)
    for key in keys:
        if chunk and size + 1 + len(key) > _PAYLOAD_LIMIT:
            yield " ".join([origin, *chunk])
            chunk, size = [], len(origin)
        chunk.append(key)
        size += 1 + len(key)
    if chunk:
        yield " ".join([origin, *chunk])


def _forget(session: Session) -> None:
    session.info.pop(_CHANGED, None)
