"""Jobs: submit, cancel, delete, events; what agents report; the contact sweep.

Every state change is a conditional UPDATE whose row count decides (a job is claimed, finished
or cancelled exactly once, also with several replicas on one PostgreSQL).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.db import rowcount
from control_plane.dispatch import jobs_changed
from control_plane.errors import Conflict, NotFound
from control_plane.models import Job, JobEvent
from control_plane.schemas import AssignedGpu, JobCreate, JobError, JobPublic
from control_plane.security import new_id

FINISHED = ("succeeded", "failed", "cancelled")


def submit_job(*, session: Session, clock: Clock, request: JobCreate) -> Job:
    now = clock.now()
    job = Job(
        id=new_id("job"),
        state="queued",
        entrypoint=request.entrypoint.model_dump(),
        params=request.params,
        inputs=dict(request.inputs),
        resources=request.resources.model_dump(),
        labels=dict(request.labels),
        worker_policy=request.worker_policy,
        timeout_seconds=request.timeout_seconds,
        silence_timeout_seconds=request.silence_timeout_seconds,
        created_at=now,
        cancel_requested=False,
        next_event_seq=1,
    )
    session.add(job)
    session.flush()
    append_events(session, job, [("state", {"state": "queued"})], at=now)
    return job


def get_job(*, session: Session, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(
            "No job with this id.", "List jobs with GET /api/v1/jobs.", code="JOB_NOT_FOUND"
        )
    return job


def list_jobs(*, session: Session, state: str | None, node_id: str | None, limit: int) -> list[Job]:
    query = select(Job).order_by(Job.created_at.desc()).limit(limit)
    if state:
        query = query.where(Job.state == state)
    if node_id:
        query = query.where(Job.node_id == node_id)
    return list(session.scalars(query))


def job_public(job: Job) -> JobPublic:
    entrypoint = dict(job.entrypoint)
    if "source" in entrypoint:
        entrypoint["source"] = sorted(entrypoint["source"])  # file names; the text stays private
    return JobPublic(
        job_id=job.id,
        state=job.state,
        node_id=job.node_id,
        entrypoint=entrypoint,
        params=job.params,
        inputs=job.inputs,
        resources=job.resources,
        labels=job.labels,
        worker_policy=job.worker_policy,
        timeout_seconds=job.timeout_seconds,
        silence_timeout_seconds=job.silence_timeout_seconds,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        cancel_requested=job.cancel_requested,
        result=job.result,
        outputs=job.outputs,
        error=JobError(code=job.error_code, message=job.error_message or "")
        if job.error_code
        else None,
        assigned_gpus=assigned_gpus(job),
    )


def assigned_gpus(job: Job) -> list[AssignedGpu]:
    return [AssignedGpu.model_validate(gpu) for gpu in job.assigned_gpus or []]


def append_events(
    session: Session, job: Job, events: list[tuple[str, Any]], *, at: datetime
) -> None:
    """Append in order; `next_event_seq` is bumped with the row lock held by this UPDATE.

    Every change of a job passes here, so this registers the wake-up: a state change wakes
    every replica's waiters, progress only this process's followers.
    """
    if not events:
        return
    jobs_changed(session, replicas=any(kind == "state" for kind, _ in events))
    first = session.execute(
        update(Job)
        .where(Job.id == job.id)
        .values(next_event_seq=Job.next_event_seq + len(events))
        .returning(Job.next_event_seq)
    ).scalar_one() - len(events)
    for offset, (kind, data) in enumerate(events):
        session.add(JobEvent(job_id=job.id, seq=first + offset, at=at, kind=kind, data=data))
    session.flush()


def list_events(*, session: Session, job_id: str, after: int, limit: int) -> list[JobEvent]:
    get_job(session=session, job_id=job_id)
    return list(
        session.scalars(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.seq > after)
            .order_by(JobEvent.seq)
            .limit(limit)
        )
    )


def _finish(
    session: Session,
    job: Job,
    *,
    state: str,
    at: datetime,
    from_states: tuple[str, ...],
    error: tuple[str, str] | None = None,
    result: Any = None,
    outputs: dict[str, str] | None = None,
    node_id: str | None = None,
) -> bool:
    conditions = [Job.id == job.id, Job.state.in_(from_states)]
    if node_id is not None:
        conditions.append(Job.node_id == node_id)
    changed = rowcount(
        session.execute(
            update(Job)
            .where(*conditions)
            .values(
                state=state,
                finished_at=at,
                result=result,
                outputs=outputs,
                error_code=error[0] if error else None,
                error_message=error[1] if error else None,
            )
        )
    )
    if changed:
        data: dict[str, Any] = {"state": state}
        if error:
            data["error"] = {"code": error[0], "message": error[1]}
        append_events(session, job, [("state", data)], at=at)
    return changed == 1


def cancel_job(*, session: Session, clock: Clock, job_id: str) -> Job:
    job = get_job(session=session, job_id=job_id)
    now = clock.now()
    if job.state in FINISHED:
        raise Conflict(
            f"This job already ended ({job.state}).",
            "Nothing to cancel; delete it with DELETE /api/v1/jobs/{job_id}.",
            code="JOB_FINISHED",
        )
    if not _finish(
        session,
        job,
        state="cancelled",
        at=now,
        from_states=("queued",),
        error=("JOB_CANCELLED", "cancelled before it started"),
    ):
        # Running: the agent learns it through its watch and kills the job's process group.
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.state == "running")
            .values(cancel_requested=True)
        )
        append_events(session, job, [("state", {"cancel_requested": True})], at=now)
    session.refresh(job)
    return job


def delete_job(*, session: Session, job_id: str) -> None:
    job = get_job(session=session, job_id=job_id)
    if job.state not in FINISHED:
        raise Conflict(
            f"This job is still {job.state}.",
            "Cancel it first: POST /api/v1/jobs/{job_id}/cancel.",
            code="JOB_ACTIVE",
        )
    session.delete(job)


# -- the agent's side ---------------------------------------------------------------------------


def _owned_running(session: Session, job_id: str, node_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None or job.node_id != node_id:
        raise NotFound(
            "This job is not assigned to this node.",
            "Drop it: the control plane does not expect this node to run it.",
            code="JOB_NOT_ASSIGNED",
        )
    if job.state != "running":
        raise Conflict(
            f"This job is {job.state}.",
            "Stop running it and kill its processes.",
            code="JOB_NOT_RUNNING",
        )
    return job


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
    session.execute(update(Job).where(Job.id == job_id).values(last_contact_at=now))
    append_events(session, job, events, at=now)
    return job.cancel_requested


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
) -> Job:
    job = _owned_running(session, job_id, node_id)
    if job.cancel_requested:
        state, error = "cancelled", ("JOB_CANCELLED", "cancelled while running")
    if state == "failed" and error is None:
        error = ("JOB_FAILED", "the job failed without a reason")
    _finish(
        session,
        job,
        state=state,
        at=clock.now(),
        from_states=("running",),
        error=error,
        result=result if state == "succeeded" else None,
        outputs=outputs if state == "succeeded" else None,
        node_id=node_id,
    )
    session.refresh(job)
    return job


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


def sweep_jobs(*, session: Session, clock: Clock, contact_timeout: timedelta) -> int:
    """Fail running jobs whose agent went silent or that outlived their timeout."""
    now = clock.now()
    failed = 0
    for job in session.scalars(select(Job).where(Job.state == "running")):
        contact = job.last_contact_at or job.started_at or now
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
        failed += _finish(
            session, job, state="failed", at=now, from_states=("running",), error=error
        )
    return failed
