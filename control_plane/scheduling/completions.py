"""Agents' job outcomes, committed in groups (SC-3): every placement ends with one, so one
transaction per outcome would cost more than the placement itself.

`Completions.record` queues an outcome and waits for the commit of its group; one task takes
everything queued while the previous group was committing (up to `GROUP_LIMIT`) into the next
transaction (`jobs.reports.complete_jobs`). An agent's request is answered only once its outcome
is durable, and a refused outcome (not its job, no longer running) is refused to its own agent
alone; a failed transaction fails its whole group, and the agents retry.
"""

from __future__ import annotations

import asyncio
import logging

from anyio import CapacityLimiter, to_thread
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock
from control_plane.errors import ModelForgeError
from control_plane.jobs.reports import Outcome, complete_jobs

log = logging.getLogger(__name__)
GROUP_LIMIT = 500


class Completions:
    def __init__(self, *, session_factory: sessionmaker[Session], clock: Clock) -> None:
        self._session_factory = session_factory
        self._clock = clock
        self._pending: list[tuple[Outcome, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._limiter: CapacityLimiter | None = None
        self._stopping = False
        #: Transactions run; tests count them.
        self.groups = 0

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._limiter = CapacityLimiter(1)
        self._task = asyncio.create_task(self._run(), name="job completions")

    async def stop(self) -> None:
        """Commit what is queued (the group in progress included), then stop; later outcomes
        are committed by their own request."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        while self._pending:
            await self._commit_group()

    async def record(self, outcome: Outcome) -> None:
        """Return once `outcome` is committed; raise its refusal, or the group's failure."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((outcome, future))
        self._wake.set()
        if self._task is None:  # not started, or stopped: commit it here
            await self._commit_group()
        await future

    async def _run(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._commit_group()

    async def _commit_group(self) -> None:
        group, self._pending = self._pending[:GROUP_LIMIT], self._pending[GROUP_LIMIT:]
        if not group:
            return
        self.groups += 1
        try:
            problems = await to_thread.run_sync(
                self._commit, [outcome for outcome, _ in group], limiter=self._limiter
            )
        except Exception as exc:
            for _, future in group:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), problem in zip(group, problems, strict=True):
            if future.done():
                continue
            if problem is None:
                future.set_result(None)
            else:
                future.set_exception(problem)

    def _commit(self, outcomes: list[Outcome]) -> list[ModelForgeError | None]:
        with self._session_factory.begin() as session:
            return complete_jobs(session=session, clock=self._clock, outcomes=outcomes)
