"""The scheduler of one control plane process (SC-1..SC-4): claims wait here, not in a race.

A node's long-poll claim registers as a waiter and sleeps. One task matches the waiters to the
queued jobs in batches (`placement.place_batch`, one transaction each) and answers only
the claims that got a job. It runs when something can change the answer: a claim arrives, a job
is queued (`queued:<id>` wake-ups, from this replica or another), a running job ends
(`capacity`), or once a second while claims and jobs are both waiting (a node that just came
online). A submission therefore costs one batch, not one attempt per waiting claim.

Each replica schedules the claims it holds; the queue it keeps in memory is filled from the
wake-ups and re-read in full every `RESYNC_SECONDS`, and a job another replica took is dropped
when the batch finds it no longer queued. See docs/jobs.md#scheduling.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from anyio import CapacityLimiter, to_thread
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock, wait_until
from control_plane.db import is_database_unavailable
from control_plane.fleet.liveness import Liveness
from control_plane.jobs.schemas import WaitingReason
from control_plane.models import Job
from control_plane.scheduling.dispatch import CAPACITY, Dispatcher, Keys
from control_plane.scheduling.fleet_view import FleetView
from control_plane.scheduling.placement import (
    BatchResult,
    PlacedJob,
    free_capacity,
    place_batch,
    return_unanswered,
)
from control_plane.scheduling.queue import QUEUED_COLUMNS, JobQueue, queued_job
from control_plane.scheduling.shapes import Shape
from control_plane.scheduling.waiting import Fleet
from control_plane.vault.vault import Vault

log = logging.getLogger(__name__)

#: How often the whole queue is re-read (wake-ups lost while the listener reconnected, jobs
#: another replica took or cancelled).
RESYNC_SECONDS = 30.0
#: While claims and jobs both wait, a batch runs at least this often (nodes come online).
TICK_SECONDS = 1.0
_CHUNK = 1000
#: A batch locks at most max(this, 2 x queued jobs) waiting nodes: one submitted job with a
#: thousand claims waiting costs a batch over a few nodes, not over all of them.
MIN_BATCH_NODES = 32


def _holds_job(future: asyncio.Future[PlacedJob | None]) -> bool:
    return future.done() and not future.cancelled() and future.result() is not None


@dataclass(eq=False)
class _Waiter:
    node_id: str
    future: asyncio.Future[PlacedJob | None]
    since: datetime
    still_valid: Callable[[], bool]
    in_batch: bool = False
    #: The claim's hold ended while its batch ran: answer None unless the batch placed a job.
    expired: bool = False
    #: The claim is gone (its client left): a job placed for it must go back to the queue.
    gone: bool = False


class Scheduler:
    def __init__(
        self,
        *,
        session_factory: sessionmaker[Session],
        clock: Clock,
        liveness: Callable[[], Liveness],
        dispatcher: Dispatcher,
        on_placed: Callable[[Sequence[float]], None] | None = None,
        vault: Vault | None = None,
    ) -> None:
        self._session_factory = session_factory
        #: Decrypts the secrets of the jobs a batch places (WL-6a).
        self._vault = vault
        self._clock = clock
        self._liveness = liveness
        self._dispatcher = dispatcher
        self._on_placed = on_placed
        self._queue = JobQueue()
        self._waiting: dict[str, list[_Waiter]] = {}
        self._arrived: set[str] = set()
        self._left: set[str] = set()
        #: Jobs placed for claims that closed before their answer: to go back to the queue.
        self._unanswered: list[PlacedJob] = []
        self._stopping = False
        #: Nodes that took part in a batch and got nothing, since the queue or room last
        #: changed: considered last when a batch takes only some of the waiting nodes.
        self._fruitless: set[str] = set()
        self._fresh = False
        #: The last batch lost jobs to other replicas or to closed claims: run another before
        #: answering claims whose hold ended.
        self._retry = False
        self._resync = True
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._limiter: CapacityLimiter | None = None
        self._view = FleetView(session_factory=session_factory, clock=clock, liveness=liveness)
        #: Batches run (committed or not); tests count them.
        self.batches = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """On the event loop: subscribe to wake-ups and start the batch task."""
        self._wake = asyncio.Event()
        # Its own thread: never queued behind the request handlers' blocking work.
        self._limiter = CapacityLimiter(1)
        self._dispatcher.subscribe(self._heard)
        self._task = asyncio.create_task(self._run(), name="scheduler")
        self._refresher = asyncio.create_task(
            self._view.keep_fresh(lambda: bool(self._waiting)), name="fleet view"
        )

    async def stop(self) -> None:
        """Let the round in progress finish (its claims are answered, what it committed is
        delivered), then answer every claim still waiting None; later claims get None."""
        self._stopping = True
        self._wake.set()
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
            self._refresher = None
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for waiters in self._waiting.values():
            for waiter in waiters:
                if not waiter.future.done():
                    waiter.future.set_result(None)
        self._waiting.clear()

    # -- claims ------------------------------------------------------------------------------

    async def claim(
        self, node_id: str, hold: float, still_valid: Callable[[], bool]
    ) -> PlacedJob | None:
        """Wait up to `hold` seconds for a job for `node_id`. `still_valid` is asked before each
        batch (a revoked credential gets nothing). Cancelled (the client left), the claim is
        withdrawn, and a job already placed for it goes back to the queue."""
        if self._stopping:
            return None
        loop = asyncio.get_running_loop()
        waiter = _Waiter(node_id, loop.create_future(), self._clock.now(), still_valid)
        self._waiting.setdefault(node_id, []).append(waiter)
        self._wake.set()
        deadline = self._clock.monotonic() + hold
        try:
            if not await wait_until(self._clock, deadline, waiter.future):
                # The scheduler answers: None unless the batch now running (or, for a claim
                # that never waited through one, the next) places a job for it.
                waiter.expired = True
                self._wake.set()
            return await waiter.future
        except asyncio.CancelledError:
            placed = waiter.future.result() if _holds_job(waiter.future) else None
            if placed is not None:
                self.give_back(placed)
            raise
        finally:
            if not waiter.future.done():
                waiter.gone = True
            self._forget(waiter)

    def give_back(self, placed: PlacedJob) -> None:
        """A job placed for a claim that could not be answered: back to the queue (the node
        never saw it). On the loop."""
        self._unanswered.append(placed)
        self._wake.set()

    def _forget(self, waiter: _Waiter) -> None:
        waiters = self._waiting.get(waiter.node_id)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiting[waiter.node_id]

    @property
    def waiting(self) -> int:
        return sum(len(waiters) for waiters in self._waiting.values())

    @property
    def queued(self) -> int:
        return len(self._queue)

    # -- why a job waits ---------------------------------------------------------------------

    def waiting_reason(self, job: Job, session: Session) -> WaitingReason | None:
        """For a queued job: why it waits, from a fleet view at most a second old (read with
        `session` when it is older). Thread-safe."""
        return self._view.waiting_reason(job, session)

    def fleet(self, session: Session | None = None) -> Fleet:
        """Every node as seen at most a second ago (`FleetView.current`). Thread-safe."""
        return self._view.current(session)

    # -- the batch task ----------------------------------------------------------------------

    def _heard(self, keys: Keys) -> None:
        """On the loop: note what changed; the batch task applies it between batches."""
        if keys is None:
            self._resync = True
            self._wake.set()
            return
        for key in keys:
            kind, _, job_id = key.partition(":")
            if kind == "queued":
                self._fresh = True
                self._arrived.add(job_id)
                self._left.discard(job_id)  # queued again since it left
            elif kind == "job" and job_id in self._queue and f"queued:{job_id}" not in keys:
                self._left.add(job_id)  # taken by another replica, or cancelled
                continue
            elif kind == "node" and job_id in self._waiting:
                pass  # its credential may have been revoked: the round re-checks its claims
            elif key != CAPACITY:
                continue
            else:
                self._fresh = True
            self._wake.set()

    async def _run(self) -> None:
        last_resync = -math.inf
        failures = 0
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), TICK_SECONDS)
            except TimeoutError:
                pass
            self._wake.clear()
            if self._stopping:
                if self._unanswered:
                    await self._return_unanswered()
                return
            present = {id(w) for waiters in self._waiting.values() for w in waiters}
            self._retry = False
            if self._fresh:  # new jobs or room: every node deserves a look again
                self._fresh = False
                self._fruitless.clear()
            try:
                if self._unanswered:
                    await self._return_unanswered()
                left, self._left = self._left, set()
                for job_id in left:
                    self._queue.discard(job_id)
                if self._resync or self._clock.monotonic() - last_resync > RESYNC_SECONDS:
                    self._resync = False
                    self._arrived.clear()
                    await to_thread.run_sync(self._read_queue, limiter=self._limiter)
                    last_resync = self._clock.monotonic()
                elif self._arrived:
                    arrived, self._arrived = self._arrived, set()
                    await to_thread.run_sync(self._read_arrived, arrived, limiter=self._limiter)
                self._answer_revoked()
                if self._waiting and len(self._queue):
                    await self._batch()
                self._answer_expired(present)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                self._resync = True
                self._answer_expired(present)
                if not is_database_unavailable(exc) and failures in (1, 10, 100, 1000):
                    log.warning(
                        "scheduling failed (%s, %d in a row); retrying",
                        type(exc).__name__,
                        failures,
                        exc_info=failures == 1,
                    )
                await asyncio.sleep(min(1.0, 0.05 * failures))

    def _answer_revoked(self) -> None:
        """None for claims whose credential was revoked meanwhile (the route refuses them)."""
        for waiters in self._waiting.values():
            for waiter in waiters:
                if not waiter.future.done() and not waiter.still_valid():
                    waiter.future.set_result(None)

    def _answer_expired(self, present: set[int]) -> None:
        """None for the claims whose hold ended and that were waiting when this round began
        (so they took part in its batch, or there was nothing to place)."""
        if self._retry:
            return
        for waiters in self._waiting.values():
            for waiter in waiters:
                if (
                    waiter.expired
                    and id(waiter) in present
                    and not waiter.in_batch
                    and not waiter.future.done()
                ):
                    waiter.future.set_result(None)

    def _read_queue(self) -> None:
        with self._session_factory() as session:
            ids = set(session.scalars(select(Job.id).where(Job.state == "queued")))
            for gone in self._queue.ids() - ids:
                self._queue.discard(gone)
            self._load(session, [job_id for job_id in ids if job_id not in self._queue])

    def _read_arrived(self, arrived: set[str]) -> None:
        with self._session_factory() as session:
            self._load(session, [job_id for job_id in arrived if job_id not in self._queue])

    def _load(self, session: Session, ids: list[str]) -> None:
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            rows = session.execute(
                select(*QUEUED_COLUMNS).where(Job.id.in_(chunk), Job.state == "queued")
            )
            for row in rows:
                self._queue.add(queued_job(row))

    async def _batch(self) -> None:
        """One batch: every valid waiting claim takes part; all of it on the loop except the
        transaction, so waiters never change under it."""
        batch: dict[str, list[_Waiter]] = {}
        for node_id, waiters in self._waiting.items():
            for waiter in waiters:
                if waiter.future.done():
                    continue
                if waiter.still_valid():
                    waiter.in_batch = True
                    batch.setdefault(node_id, []).append(waiter)
                else:
                    waiter.future.set_result(None)  # the route re-checks and refuses
        if not batch:
            return
        result = BatchResult()
        try:
            result = await to_thread.run_sync(
                self._place,
                {node_id: len(waiters) for node_id, waiters in batch.items()},
                limiter=self._limiter,
            )
        finally:
            unanswered = self._deliver(batch, result)
        if unanswered:
            self._unanswered += unanswered
            await self._return_unanswered()
        placed_on = {placed.node_id for placed in result.placed}
        self._fruitless.update(result.considered - placed_on)
        self._fruitless.difference_update(placed_on)
        if unanswered or result.contended or result.gone or (result.more and len(self._queue)):
            self._retry = True
            self._wake.set()  # the claims that got nothing try again at once

    def _place(self, waiting: dict[str, int]) -> BatchResult:
        """In a worker thread: skip the nodes the fleet view says can take none of the queued
        shapes (offline, incompatible, too small, other labels), then one transaction."""
        # The view kept fresh by `FleetView.keep_fresh`, never read on a batch's path (a thousand
        # nodes take a while); labels and sizes are all `may_take` needs of it.
        fleet = self._view.last or self._view.current()
        shapes = self._queue.live_shapes()
        waiting = {
            node_id: slots for node_id, slots in waiting.items() if fleet.may_take(node_id, shapes)
        }
        more = False
        limit = max(MIN_BATCH_NODES, 2 * len(self._queue))
        if len(waiting) > limit:
            # A few jobs, many waiting nodes: lock only as many nodes as could take them,
            # those that got nothing in an earlier batch last (arrival order otherwise).
            ordered = sorted(waiting, key=lambda node_id: node_id in self._fruitless)
            more = any(node_id not in self._fruitless for node_id in ordered[limit:])
            waiting = {node_id: waiting[node_id] for node_id in ordered[:limit]}
        if not waiting:
            return BatchResult()
        self.batches += 1
        with self._session_factory.begin() as session:

            def room_elsewhere(shape: Shape) -> bool:
                # Exact, not from the fleet view: this batch's own placements count.
                free = free_capacity(session, fleet.carrying(shape))
                return any(shape.fits(capacity) for capacity in free.values())

            result = place_batch(
                session=session,
                clock=self._clock,
                liveness=self._liveness(),
                waiting=waiting,
                queue=self._queue,
                room_elsewhere=room_elsewhere,
                vault=self._vault,
            )
        for job_id in result.gone:
            self._queue.discard(job_id)
        for placed in result.placed:
            self._queue.discard(placed.id)
        result.considered = set(waiting)
        result.more = more
        return result

    def _deliver(self, batch: dict[str, list[_Waiter]], result: BatchResult) -> list[PlacedJob]:
        """Answer the claims that got a job, and those whose hold ended meanwhile; returns the
        jobs placed for claims that closed meanwhile."""
        now = self._clock.now()
        latencies: list[float] = []
        unanswered: list[PlacedJob] = []
        by_node: dict[str, list[PlacedJob]] = {}
        for placed in result.placed:
            by_node.setdefault(placed.node_id, []).append(placed)
        for node_id, waiters in batch.items():
            jobs = by_node.get(node_id, [])
            for waiter in waiters:
                waiter.in_batch = False
                if waiter.gone or waiter.future.done():
                    continue
                if jobs:
                    placed = jobs.pop(0)
                    waiter.future.set_result(placed)
                    waited_from = max(waiter.since, placed.created_at)
                    latencies.append(max(0.0, (now - waited_from).total_seconds()))
                elif waiter.expired:
                    waiter.future.set_result(None)
            unanswered.extend(jobs)
        if latencies and self._on_placed is not None:
            self._on_placed(latencies)
        return unanswered

    async def _return_unanswered(self) -> None:
        unanswered, self._unanswered = self._unanswered, []
        await to_thread.run_sync(self._return, unanswered, limiter=self._limiter)

    def _return(self, unanswered: list[PlacedJob]) -> None:
        try:
            with self._session_factory.begin() as session:
                returned = return_unanswered(
                    session=session,
                    clock=self._clock,
                    placed=unanswered,
                    reason="the claim it was placed for closed before it was answered",
                )
        except Exception as exc:
            # The job contact sweep fails them later (JOB_CONTACT_LOST): nothing is lost.
            log.warning(
                "%d jobs placed for closed claims could not be re-queued (%s)",
                len(unanswered),
                type(exc).__name__,
            )
            return
        if returned:
            log.info("re-queued %d jobs whose claims closed before they were answered", returned)
