"""What the agents report of the jobs they run, and what is decided for them: progress
(`record_report`), outcomes (`complete_jobs`, in groups), the cancellation watch
(`cancellations`), and the contact sweep (`sweep_jobs`) that fails a job whose agent went
silent or that outlived its timeout."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.errors import Conflict, ModelForgeError, NotFound
from control_plane.fleet.liveness import ContactGrace, counted_from
from control_plane.jobs._changes import RunningJob, append_events, finish, pinned_ended
from control_plane.metrics import job_finished
from control_plane.models import JOB_EVENTS, JOBS, Job
from control_plane.scheduling.dispatch import CAPACITY, job_key, jobs_changed, node_key


def _owned_running(session: Session, job_id: str, node_id: str) -> RunningJob:
    """The job, locked, when it runs on `node_id`; the agent's refusal otherwise."""
    row = session.execute(
        select(JOBS.c.node_id, JOBS.c.state, JOBS.c.cancel_requested)
        .where(JOBS.c.id == job_id)
        .with_for_update()
    ).first()
    problem = _not_owned_running(row, node_id)
    if problem is not None:
        raise problem
    assert row is not None  # noqa: S101 - narrowed by _not_owned_running
    return RunningJob(job_id, row.node_id, bool(row.cancel_requested))


def _not_owned_running(row: Any, node_id: str) -> ModelForgeError | None:
    """The refusal for an agent that reports on a job it does not run (row: node_id, state)."""
    if row is None or row.node_id != node_id:
        return NotFound(
            "This job is not assigned to this node.",
            "Drop it: the control plane does not expect this node to run it.",
            code="JOB_NOT_ASSIGNED",
        )
    if row.state != "running":
        return Conflict(
            f"This job is {row.state}.",
            "Stop running it and kill its processes.",
            code="JOB_NOT_RUNNING",
        )
    return None


def record_report(
    *,
    session: Session,
    clock: Clock,
    job_id: str,
    node_id: str,
    events: list[tuple[str, Any]],
) -> bool:
    """Progress from the agent: appends events, renews contact. Returns cancel-requested."""
    job = _owned_running(session, job_id, node_id)
    now = clock.now()
    session.execute(update(JOBS).where(JOBS.c.id == job_id).values(last_contact_at=now))
    append_events(session, job, events, at=now)
    return job.cancel_requested


@dataclass(frozen=True)
class Outcome:
    """What an agent reports when a job ends."""

    job_id: str
    node_id: str
    state: str
    result: Any
    outputs: dict[str, str]
    error: tuple[str, str] | None


def complete_jobs(
    *, session: Session, clock: Clock, outcomes: list[Outcome]
) -> list[ModelForgeError | None]:
    """Record many agents' outcomes in `session`'s transaction, in four statements whatever
    their number (lock, update, events, and the wake-up): every placement ends here, so the
    control plane commits them in groups. Returns, per outcome, its refusal or None; a refused
    one changes nothing."""
    now = clock.now()
    rows = {
        row.id: row
        for row in session.execute(
            select(
                JOBS.c.id,
                JOBS.c.node_id,
                JOBS.c.state,
                JOBS.c.cancel_requested,
                JOBS.c.next_event_seq,
                JOBS.c.pinned,
            )
            .where(JOBS.c.id.in_(sorted({outcome.job_id for outcome in outcomes})))
            .order_by(JOBS.c.id)
            .with_for_update()
        )
    }
    problems: list[ModelForgeError | None] = []
    changes: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    keys: set[str] = set()
    done: set[str] = set()
    for outcome in outcomes:
        row = rows.get(outcome.job_id)
        problem = _not_owned_running(row, outcome.node_id)
        if problem is None and outcome.job_id in done:  # reported twice in one group
            problem = _not_owned_running(_Finished(outcome.node_id), outcome.node_id)
        problems.append(problem)
        if problem is not None or row is None:
            continue
        done.add(outcome.job_id)
        state, error = outcome.state, outcome.error
        if row.cancel_requested:
            state, error = "cancelled", ("JOB_CANCELLED", "cancelled while running")
        if state == "failed" and error is None:
            error = ("JOB_FAILED", "the job failed without a reason")
        succeeded = state == "succeeded"
        changes.append(
            {
                "b_id": outcome.job_id,
                "b_state": state,
                "b_result": outcome.result if succeeded else None,
                "b_outputs": outcome.outputs if succeeded else None,
                "b_code": error[0] if error else None,
                "b_message": error[1] if error else None,
                "b_next_seq": row.next_event_seq + 1,
            }
        )
        data: dict[str, Any] = {"state": state}
        if error:
            data["error"] = {"code": error[0], "message": error[1]}
        events.append(
            {
                "job_id": outcome.job_id,
                "seq": row.next_event_seq,
                "at": now,
                "kind": "state",
                "data": data,
            }
        )
        keys.update((job_key(outcome.job_id), node_key(outcome.node_id)))
        job_finished(session, state=state, code=error[0] if error else None)
        pinned_ended(session, outcome.job_id, row.pinned, state=state, error=error, at=now)
    if changes:
        session.execute(
            update(JOBS)
            .where(JOBS.c.id == bindparam("b_id"))
            .values(
                state=bindparam("b_state"),
                finished_at=now,
                result=bindparam("b_result", type_=JOBS.c.result.type),
                outputs=bindparam("b_outputs", type_=JOBS.c.outputs.type),
                error_code=bindparam("b_code"),
                error_message=bindparam("b_message"),
                next_event_seq=bindparam("b_next_seq"),
            ),
            changes,
        )
        session.execute(insert(JOB_EVENTS), events)
        jobs_changed(session, [*keys, CAPACITY])
    return problems


@dataclass(frozen=True)
class _Finished:
    """A job an earlier outcome of the same group just ended, as `_not_owned_running` reads it."""

    node_id: str
    state: str = "finished"


def cancel_unstarted(*, session: Session, clock: Clock, job_id: str, node_id: str) -> bool:
    """End as cancelled a job placed on `node_id` that the node never received, when its
    cancellation was asked for meanwhile (it must not go back to the queue)."""
    return finish(
        session,
        RunningJob(job_id, node_id, True),
        state="cancelled",
        at=clock.now(),
        from_states=("running",),
        error=("JOB_CANCELLED", "cancelled before it started"),
        node_id=node_id,
    )


def complete_job(
    *,
    session: Session,
    clock: Clock,
    job_id: str,
    node_id: str,
    state: str,
    result: Any,
    outputs: dict[str, str],
    error: tuple[str, str] | None,
) -> None:
    """One agent's outcome (`complete_jobs` with one); raises its refusal."""
    outcome = Outcome(job_id, node_id, state, result, outputs, error)
    (problem,) = complete_jobs(session=session, clock=clock, outcomes=[outcome])
    if problem is not None:
        raise problem


def cancellations(*, session: Session, node_id: str, job_ids: list[str]) -> list[str]:
    """Which of `job_ids` this node must stop: cancelled, finished, or not its own any more."""
    if not job_ids:
        return []
    rows = session.execute(
        select(Job.id, Job.state, Job.cancel_requested, Job.node_id).where(Job.id.in_(job_ids))
    ).all()
    keep = {
        r.id
        for r in rows
        if r.state == "running" and not r.cancel_requested and r.node_id == node_id
    }
    return [job_id for job_id in job_ids if job_id not in keep]


def sweep_jobs(
    *,
    session: Session,
    clock: Clock,
    contact_timeout: timedelta,
    grace: ContactGrace | None = None,
) -> int:
    """Fail running jobs whose agent went silent or that outlived their timeout.

    The silence is counted from the job's last contact, or from the end of the control plane's
    own downtime (`grace`: its start, the end of a database outage) when the contact had not yet
    expired as that downtime began: an agent that could not reach it has one full contact
    timeout after it returns, and a job whose contact was already lost is failed at once."""
    now = clock.now()
    failed = 0
    for job in session.scalars(select(Job).where(Job.state == "running")):
        last = job.last_contact_at or job.started_at or now
        contact = counted_from(last, now, grace, timeout=contact_timeout)
        if now - contact >= contact_timeout:
            error = (
                "JOB_CONTACT_LOST",
                f"no progress from node {job.node_id} for {contact_timeout.total_seconds():g} s",
            )
        elif job.started_at and now - job.started_at >= timedelta(
            seconds=job.timeout_seconds + contact_timeout.total_seconds()
        ):
            error = ("JOB_TIMEOUT", f"ran longer than its timeout of {job.timeout_seconds:g} s")
        else:
            continue
        failed += finish(
            session, job, state="failed", at=now, from_states=("running",), error=error
        )
    return failed
