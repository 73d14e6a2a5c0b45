"""Worker lanes: the threads that run the control plane's blocking routes, one share for each kind
of request, so that no kind of request can take what another needs.

Why: a blocking route's transaction (on SQLite the write lock, on PostgreSQL a pooled connection)
used to stay open while FastAPI waited for a thread of the one shared pool to check the route's
response, and the threads of that pool were all taken by later requests waiting for that very
lock or connection; nothing moved until the 30 s busy or pool timeout failed them as an outage.
Now a blocking route runs on its lane's threads, and its response is checked on the event loop
(`api/routing.LaneRoute`), so an open transaction never waits for a thread; and each lane has its
own threads, so a burst of admin requests queues behind admin requests only, while agents, health
probes and Prometheus keep theirs. An async route's blocking parts run on its lane too
(`ctx.lanes.<lane>.run(...)`), never on the default thread pool that every request's sync
dependencies share.

A request waits for its lane's thread in the event loop, first come first served, holding no
thread, no connection and no lock; after `queue_seconds` (`MODELFORGE_REQUEST_QUEUE_SECONDS`)
it is answered `503 BUSY`, never started, instead of waiting on in silence. This module never
touches the database and imports nothing of FastAPI.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
from anyio import to_thread

from control_plane.errors import Busy

T = TypeVar("T")

#: Agents' requests that the fast path does not answer (inventory, telemetry, events, services).
AGENT = "agent"
#: `/api/v1/health` and `/api/v1/version`: what load balancers and orchestrators poll.
PROBE = "probe"
#: `/metrics`: a scrape reads the database for longer than a probe, so scrapes never hold the
#: probes' threads.
METRICS = "metrics"
#: Everything else: the admin API, the console and the docs.
ADMIN = "admin"

_AGENT_PREFIX = "/api/v1/agent/"
_PROBES = frozenset({"/api/v1/health", "/api/v1/version"})
_METRICS = "/metrics"
#: Threads per lane. Few: on a GIL more runnable threads only contend, and each holds at most one
#: pooled database connection (the pool has room for every lane, see `db.POOL_CONNECTIONS`).
LANE_THREADS = {ADMIN: 4, AGENT: 4, PROBE: 2, METRICS: 2}
#: The most requests one lane lets wait; more are answered `BUSY` at once.
MAX_WAITING = 4096


def lane_of(path: str) -> str:
    """The lane of a route, by its path template."""
    if path.startswith(_AGENT_PREFIX):
        return AGENT
    if path in _PROBES:
        return PROBE
    if path == _METRICS:
        return METRICS
    return ADMIN


class Lane:
    """A few threads for one kind of request and the FIFO queue in front of them."""

    def __init__(self, name: str, threads: int, queue_seconds: float) -> None:
        self.name = name
        self.threads = threads
        self.queue_seconds = queue_seconds
        self._admission = anyio.Semaphore(threads)  # FIFO: waiters are served in order
        # Never waited on: admission lets at most `threads` requests in.
        self._limiter = anyio.CapacityLimiter(threads)
        #: Requests waiting for a thread now (observability and tests).
        self.waiting = 0
        #: Requests refused `BUSY` since the start.
        self.refused = 0

    async def run(self, work: Callable[[], T]) -> T:
        """`work()` on one of this lane's threads, once one is free; `Busy` when none became
        free within `queue_seconds` (or too many wait already): then `work` never ran."""
        if self.waiting >= MAX_WAITING:
            self.refused += 1
            raise Busy.for_lane(self.name, self.queue_seconds)
        self.waiting += 1
        try:
            with anyio.move_on_after(self.queue_seconds) as waited:
                await self._admission.acquire()
        finally:
            self.waiting -= 1
        if waited.cancelled_caught:
            self.refused += 1
            raise Busy.for_lane(self.name, self.queue_seconds)
        try:
            return await to_thread.run_sync(work, limiter=self._limiter)
        finally:
            self._admission.release()


@dataclass
class WorkerLanes:
    """The lanes of one control plane process."""

    admin: Lane
    agent: Lane
    probe: Lane
    metrics: Lane

    @classmethod
    def create(cls, *, queue_seconds: float) -> WorkerLanes:
        return cls(
            **{name: Lane(name, threads, queue_seconds) for name, threads in LANE_THREADS.items()}
        )

    def __getitem__(self, name: str) -> Lane:
        lane: Lane = getattr(self, name)
        return lane
