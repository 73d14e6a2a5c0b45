"""The scheduler's view of the fleet (SC-4): every node as seen at most `MAX_AGE_SECONDS` ago,
by the control plane's clock. The batches read it to skip nodes that can take none of the queued
shapes, the queued jobs' waiting reasons and the provisioner explain from it, and one read a
second serves them all. Reading it is `waiting.read_fleet`'s; this only keeps it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from functools import partial

from anyio import to_thread
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock
from control_plane.db import is_database_unavailable
from control_plane.fleet.liveness import Liveness
from control_plane.jobs.schemas import WaitingReason
from control_plane.models import Job
from control_plane.scheduling.gpu_reasons import read_gpu_notes
from control_plane.scheduling.shapes import Shape
from control_plane.scheduling.waiting import Fleet, explain, read_fleet

log = logging.getLogger(__name__)

#: How old the view behind the waiting reasons and `prefer` may be.
MAX_AGE_SECONDS = 1.0


class FleetView:
    """Thread-safe. The lock only guards the kept view, never a read: on SQLite a transaction
    waits for another's, which may be waiting for this."""

    def __init__(
        self,
        *,
        session_factory: sessionmaker[Session],
        clock: Clock,
        liveness: Callable[[], Liveness],
    ) -> None:
        self._session_factory = session_factory
        self._clock = clock
        self._liveness = liveness
        self._lock = threading.Lock()
        self._fleet: Fleet | None = None
        #: When it was read, on the clock's `monotonic` (never: infinitely long ago).
        self._read_at = -math.inf
        self._reasons: tuple[Fleet | None, dict[Shape, WaitingReason]] = (None, {})

    @property
    def last(self) -> Fleet | None:
        """The view last read, however old (a batch's path never waits for a read)."""
        return self._fleet

    def current(self, session: Session | None = None) -> Fleet:
        """Every node as seen at most `MAX_AGE_SECONDS` ago, read with `session` if one is
        given (on SQLite a second connection would wait for it), else in a session of its own."""
        with self._lock:
            fleet = self._fleet
            if fleet is not None and self._age() <= MAX_AGE_SECONDS:
                return fleet
        now, liveness, previous = self._clock.now(), self._liveness(), self._fleet
        if session is not None:
            fleet = read_fleet(session, now=now, liveness=liveness, previous=previous)
        else:
            with self._session_factory() as own:
                fleet = read_fleet(own, now=now, liveness=liveness, previous=previous)
        with self._lock:
            self._fleet, self._read_at = fleet, self._clock.monotonic()
        return fleet

    def waiting_reason(self, job: Job, session: Session) -> WaitingReason | None:
        """For a queued job: why it waits, from the current view (read with `session` when it
        is too old, as are the reasons of GPUs out of the schedule it names); reasons are kept
        per shape for as long as the view is."""
        if job.state != "queued":
            return None
        shape = Shape.of(
            job.labels, job.worker_policy, job.resources, job.required_labels, job.pinned
        )
        fleet = self.current(session)
        with self._lock:
            if self._reasons[0] is not fleet:
                self._reasons = (fleet, {})
            reason = self._reasons[1].get(shape)
        if reason is None:
            # Outside the lock: naming GPUs out of the schedule reads their reasons.
            reason = explain(fleet, shape, partial(read_gpu_notes, session))
            with self._lock:
                if self._reasons[0] is fleet:
                    self._reasons[1][shape] = reason
        return reason

    async def keep_fresh(self, wanted: Callable[[], bool]) -> None:
        """While `wanted()` (claims wait): keep the view at most about `MAX_AGE_SECONDS` old, off
        the batches' path (a thread of its own). Runs until cancelled."""
        while True:
            await asyncio.sleep(MAX_AGE_SECONDS / 2)
            if not wanted() or self._age() < MAX_AGE_SECONDS:
                continue
            try:
                await to_thread.run_sync(self.current)
            except Exception as exc:  # the batches and the API read it themselves meanwhile
                if not is_database_unavailable(exc):
                    log.warning("reading the fleet view failed (%s)", type(exc).__name__)

    def _age(self) -> float:
        return self._clock.monotonic() - self._read_at
