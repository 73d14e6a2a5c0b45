"""The queued jobs, kept in memory by the scheduler and grouped by *shape* (labels, policy,
resources): a batch walks the shapes' oldest jobs in age order, so a job that fits a waiting node
is placed however many jobs that fit none were queued before it (no head-of-line blocking), and
among the jobs that fit a node the oldest goes first (`placement.match`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from control_plane.models import Job
from control_plane.scheduling.shapes import Shape


@dataclass(frozen=True)
class QueuedJob:
    id: str
    created_at: datetime
    shape: Shape

    @property
    def order(self) -> tuple[datetime, str]:
        return (self.created_at, self.id)


QUEUED_COLUMNS = (
    Job.id,
    Job.created_at,
    Job.labels,
    Job.worker_policy,
    Job.resources,
    Job.required_labels,
    Job.pinned,
)


def queued_job(row: Any) -> QueuedJob:
    return QueuedJob(
        row.id,
        row.created_at,
        Shape.of(row.labels, row.worker_policy, row.resources, row.required_labels, row.pinned),
    )


class JobQueue:
    """The queued jobs, per shape in age order. Removal is lazy: a shape's list keeps dead
    entries until they outnumber the live ones, and iteration skips them."""

    def __init__(self) -> None:
        self._jobs: dict[str, QueuedJob] = {}
        self._by_shape: dict[Shape, list[QueuedJob]] = {}
        self._dead: dict[Shape, int] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def get(self, job_id: str) -> QueuedJob | None:
        return self._jobs.get(job_id)

    def add(self, job: QueuedJob) -> None:
        if job.id in self._jobs:
            return
        self._jobs[job.id] = job
        jobs = self._by_shape.setdefault(job.shape, [])
        if not jobs or jobs[-1].order <= job.order:
            jobs.append(job)
        else:  # another replica's submission that committed late
            bisect.insort(jobs, job, key=lambda queued: queued.order)

    def discard(self, job_id: str) -> None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return
        dead = self._dead[job.shape] = self._dead.get(job.shape, 0) + 1
        jobs = self._by_shape[job.shape]
        if dead * 2 > len(jobs):
            live = [queued for queued in jobs if self._jobs.get(queued.id) is queued]
            if live:
                self._by_shape[job.shape] = live
            else:
                del self._by_shape[job.shape]
            self._dead.pop(job.shape, None)

    def ids(self) -> set[str]:
        return set(self._jobs)

    def shapes(self) -> Iterator[tuple[Shape, Iterator[QueuedJob]]]:
        """Each shape with its live jobs, oldest first."""
        for shape, jobs in self._by_shape.items():
            yield shape, (job for job in jobs if self._jobs.get(job.id) is job)

    def live_shapes(self) -> list[Shape]:
        """The shapes that have queued jobs."""
        return [s for s, jobs in self._by_shape.items() if len(jobs) > self._dead.get(s, 0)]
