"""Jobs: submit, cancel, delete, events; what agents report; the contact sweep.

Every state change is a conditional UPDATE whose row count decides (a job is claimed, finished
or cancelled exactly once, also with several replicas on one PostgreSQL).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.orm import Session

from control_plane.artifacts.store import reference_artifacts
from control_plane.catalog import catalog as models_catalog
from control_plane.clock import Clock
from control_plane.db import rowcount
from control_plane.errors import Conflict, InvalidRequest, ModelForgeError, NotFound
from control_plane.fleet.liveness import ContactGrace, counted_from
from control_plane.metrics import job_finished
from control_plane.models import JOB_EVENTS, JOBS, Job, JobEvent
from control_plane.scheduling.dispatch import CAPACITY, job_key, jobs_changed, node_key, queued_key
from control_plane.schemas import AssignedGpu, JobCreate, JobError, JobPublic, WaitingReason
from control_plane.security import new_id
from control_plane.vault import vault as secrets_vault

FINISHED = ("succeeded", "failed", "cancelled")


def submit_job(*, session: Session, clock: Clock, request: JobCreate) -> Job:
    return submit_jobs(session=session, clock=clock, requests=[request])[0]


class _SubmissionTimes:
    """Submission times that strictly increase within this process, so jobs submitted one
    after another are placed in that order even when the clock reads the same twice."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: datetime | None = None

    def take(self, now: datetime, count: int) -> datetime:
        """The first of `count` consecutive microseconds, none before `now`."""
        with self._lock:
            if self._last is not None and now <= self._last:
                now = self._last + timedelta(microseconds=1)
            self._last = now + timedelta(microseconds=count - 1)
            return now


_submission_times = _SubmissionTimes()


def submit_jobs(*, session: Session, clock: Clock, requests: list[JobCreate]) -> list[Job]:
    """Queue every job of `requests` in `session`'s transaction (all or nothing), in order:
    each is a little younger than the one before it, so they are placed in the order given."""
    now = _submission_times.take(clock.now(), len(requests))
    resolved = _resolve(session, requests)
    jobs = [
        Job(
            id=new_id("job"),
            state="queued",
            entrypoint=resolved[index].entrypoint,
            params=resolved[index].params,
            model=request.model,
            secrets=list(request.secrets) or None,
            required_labels=resolved[index].required_labels or None,
            inputs=dict(request.inputs),
            resources=request.resources.model_dump(),
            labels=dict(request.labels),
            worker_policy=request.worker_policy,
            timeout_seconds=request.timeout_seconds,
            silence_timeout_seconds=request.silence_timeout_seconds,
            created_at=now + timedelta(microseconds=index),
            cancel_requested=False,
            next_event_seq=2,
        )
        for index, request in enumerate(requests)
    ]
    session.add_all(jobs)
    session.flush()
    # The first event of each, written in one statement (`append_events` is per job).
    session.execute(
        insert(JOB_EVENTS),
        [
            {"job_id": job.id, "seq": 1, "at": now, "kind": "state", "data": {"state": "queued"}}
            for job in jobs
        ],
    )
    jobs_changed(session, [key for job in jobs for key in (job_key(job.id), queued_key(job.id))])
    return jobs


@dataclass(frozen=True)
class _Resolved:
    entrypoint: dict[str, Any]
    params: dict[str, Any]
    required_labels: dict[str, Any]


def _resolve(session: Session, requests: list[JobCreate]) -> list[_Resolved]:
    """Each request's entrypoint and params (a model's weights, runner and default params
    under the job's own), and the labels its secrets require. The digests the jobs name are
    referenced: locked against the artifact sweep until this transaction ends. Models and
    secrets are looked up once per batch."""
    models: dict[str, models_catalog.ResolvedModel] = {}
    secret_labels: dict[tuple[str, ...], dict[str, Any]] = {}
    digests: list[str] = []
    resolved = []
    for index, request in enumerate(requests):
        named_by = f"jobs[{index}]" if len(requests) > 1 else "The job"
        params = dict(request.params)
        if request.model is not None:
            model = models.get(request.model)
            if model is None:
                model = models[request.model] = models_catalog.resolve(
                    session, request.model, named_by=named_by
                )
            if model.runner != "onnx":
                raise InvalidRequest(
                    f"{named_by} names model {model.ref}, whose runner ({model.runner}) runs "
                    "as a service only.",
                    "Deploy it as a service (POST /api/v1/services), or name an onnx model.",
                    code="MODEL_NOT_RUNNABLE",
                )
            entrypoint: dict[str, Any] = {"kind": "onnx", "model": model.weights}
            params = {**model.params, **params}
        elif request.entrypoint is not None:  # the schema requires one of the two
            entrypoint = request.entrypoint.model_dump()
        else:
            raise ValueError("a job needs an entrypoint or a model")
        if entrypoint.get("kind") == "onnx":
            digests.append(entrypoint["model"])
        digests += request.inputs.values()
        key = tuple(request.secrets)
        if key not in secret_labels:
            secret_labels[key] = secrets_vault.required_labels(
                session, list(key), named_by=named_by
            )
        resolved.append(_Resolved(entrypoint, params, secret_labels[key]))
    reference_artifacts(session, digests, required=False, named_by="The job")
    return resolved


def get_job(*, session: Session, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(
            "No job with this id.", "List jobs with GET /api/v1/jobs.", code="JOB_NOT_FOUND"
        )
    return job


def list_jobs(
    *,
    session: Session,
    state: str | None,
    node_id: str | None,
    limit: int,
    labels: dict[str, str] | None = None,
) -> list[Job]:
    """Newest first; `labels`: only jobs that carry every one of them."""
    query = select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
    if state:
        query = query.where(Job.state == state)
    if node_id:
        query = query.where(Job.node_id == node_id)
    for key, value in (labels or {}).items():
        query = query.where(Job.labels[key].as_string() == value)
    return list(session.scalars(query))


def job_public(job: Job, waiting_reason: WaitingReason | None = None) -> JobPublic:
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
        waiting_reason=waiting_reason,
        model=job.model,
        secrets=list(job.secrets or []),
    )


def assigned_gpus(job: Job) -> list[AssignedGpu]:
    return [AssignedGpu.model_validate(gpu) for gpu in job.assigned_gpus or []]


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
    conditions = [JOBS.c.id == job.id, JOBS.c.state.in_(from_states)]
    if node_id is not None:
        conditions.append(JOBS.c.node_id == node_id)
    changed = rowcount(
        session.execute(
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
        )
    )
    if changed:
        data: dict[str, Any] = {"state": state}
        if error:
            data["error"] = {"code": error[0], "message": error[1]}
        append_events(session, job, [("state", data)], at=at)
        job_finished(session, state=state, code=error[0] if error else None)
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
        # The node as it is now (a batch may have placed it since `job` was read).
        node_id = session.execute(
            update(JOBS)
            .where(JOBS.c.id == job_id, JOBS.c.state == "running")
            .values(cancel_requested=True)
            .returning(JOBS.c.node_id)
        ).scalar_one_or_none()
        running = RunningJob(job_id, node_id, True)
        append_events(session, running, [("state", {"cancel_requested": True})], at=now)
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


@dataclass(frozen=True)
class RunningJob:
    """What the agent's side needs of a job it runs (read without loading the whole row)."""

    id: str
    node_id: str | None
    cancel_requested: bool


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
    return _finish(
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
        failed += _finish(
            session, job, state="failed", at=now, from_states=("running",), error=error
        )
    return failed
