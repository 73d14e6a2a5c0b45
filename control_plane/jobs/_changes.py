"""How a job changes once queued: its event log (`append_events`, which registers the
wake-ups of every change but a placement) and `finish`, the one conditional UPDATE that ends
a job: its row count decides, so a job ends exactly once, also with several replicas on one
PostgreSQL."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from control_plane.fleet.gpu_admin import check_ended
from control_plane.metrics import job_finished
from control_plane.models import JOB_EVENTS, JOBS
from control_plane.scheduling.dispatch import CAPACITY, job_key, jobs_changed, node_key

FINISHED = ("succeeded", "failed", "cancelled")


class JobRef(Protocol):
    """A job as the event log needs it: a `Job`, or a `RunningJob` read without the row."""

    @property
    def id(self) -> str: ...

    @property
    def node_id(self) -> str | None: ...


def append_events(
    session: Session, job: JobRef, events: list[tuple[str, Any]], *, at: datetime
) -> None:
    """Append in order; `next_event_seq` is bumped with the row lock held by this UPDATE.

    Every change of a job but its placement (`scheduling.place_batch`, in bulk) passes here,
    so this registers the wake-ups: the job's followers; for a state change of a job on a node,
    that node's cancellation watch, and the scheduler when it ended (the node has room again).
    A state change wakes every replica's waiters, progress only this process's followers.
    """
    if not events:
        return
    keys = {job_key(job.id)}
    states = [data.get("state") for kind, data in events if kind == "state"]
    if states and job.node_id is not None:
        keys.add(node_key(job.node_id))
        if any(state in FINISHED for state in states):
            keys.add(CAPACITY)
    jobs_changed(session, keys, replicas=bool(states))
    first = session.execute(
        update(JOBS)
        .where(JOBS.c.id == job.id)
        .values(next_event_seq=JOBS.c.next_event_seq + len(events))
        .returning(JOBS.c.next_event_seq)
    ).scalar_one() - len(events)
    session.execute(
        insert(JOB_EVENTS),
        [
            {"job_id": job.id, "seq": first + offset, "at": at, "kind": kind, "data": data}
            for offset, (kind, data) in enumerate(events)
        ],
    )


def finish(
    session: Session,
    job: JobRef,
    *,
    state: str,
    at: datetime,
    from_states: tuple[str, ...],
    error: tuple[str, str] | None = None,
    result: Any = None,
    outputs: dict[str, str] | None = None,
    node_id: str | None = None,
) -> bool:
    """End `job` as `state` when it is still in one of `from_states` (and on `node_id`, when
    given); True when this call ended it."""
    conditions = [JOBS.c.id == job.id, JOBS.c.state.in_(from_states)]
    if node_id is not None:
        conditions.append(JOBS.c.node_id == node_id)
    ended = session.execute(
        update(JOBS)
        .where(*conditions)
        .values(
            state=state,
            finished_at=at,
            result=result,
            outputs=outputs,
            error_code=error[0] if error else None,
            error_message=error[1] if error else None,
        )
        .returning(JOBS.c.pinned)
    ).all()
    if ended:
        data: dict[str, Any] = {"state": state}
        if error:
            data["error"] = {"code": error[0], "message": error[1]}
        append_events(session, job, [("state", data)], at=at)
        job_finished(session, state=state, code=error[0] if error else None)
        pinned_ended(session, job.id, ended[0].pinned, state=state, error=error, at=at)
    return len(ended) == 1


def pinned_ended(
    session: Session,
    job_id: str,
    pinned: dict[str, Any] | None,
    *,
    state: str,
    error: tuple[str, str] | None,
    at: datetime,
) -> None:
    """A job that ended, pinned to a GPU (its active check), tells the GPU: every way a job
    ends passes here (`finish`, and the agents' outcomes in `reports.complete_jobs`)."""
    if pinned:
        check_ended(session, job_id=job_id, pinned=pinned, state=state, error=error, at=at)


@dataclass(frozen=True)
class RunningJob:
    """What the agent's side needs of a job it runs (read without loading the whole row)."""

    id: str
    node_id: str | None
    cancel_requested: bool
