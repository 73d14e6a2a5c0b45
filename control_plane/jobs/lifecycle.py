"""Jobs as users see them: submit (one or a batch), get, list, cancel, delete, their events
and their public views."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from control_plane.artifacts.store import reference_artifacts
from control_plane.catalog import catalog
from control_plane.clock import Clock
from control_plane.errors import Conflict, InvalidRequest, NotFound
from control_plane.events import events_after
from control_plane.fleet.schemas import AssignedGpu
from control_plane.jobs._changes import FINISHED, RunningJob, append_events, finish
from control_plane.jobs.schemas import JobCreate, JobError, JobPublic, WaitingReason
from control_plane.models import JOB_EVENTS, JOBS, Job, JobEvent
from control_plane.scheduling.dispatch import job_key, jobs_changed, queued_key
from control_plane.security import new_id
from control_plane.vault import vault


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
            stop_after_disconnect_seconds=request.stop_after_disconnect_seconds,
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
    models: dict[str, catalog.ResolvedModel] = {}
    secret_labels: dict[tuple[str, ...], dict[str, Any]] = {}
    digests: list[str] = []
    resolved = []
    for index, request in enumerate(requests):
        named_by = f"jobs[{index}]" if len(requests) > 1 else "The job"
        params = dict(request.params)
        if request.model is not None:
            model = models.get(request.model)
            if model is None:
                model = models[request.model] = catalog.resolve(
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
            secret_labels[key] = vault.required_labels(session, list(key), named_by=named_by)
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
        stop_after_disconnect_seconds=job.stop_after_disconnect_seconds,
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


def list_events(*, session: Session, job_id: str, after: int, limit: int) -> list[JobEvent]:
    get_job(session=session, job_id=job_id)
    return events_after(session, JobEvent, JobEvent.job_id, job_id, after=after, limit=limit)


def cancel_job(*, session: Session, clock: Clock, job_id: str) -> Job:
    job = get_job(session=session, job_id=job_id)
    now = clock.now()
    if job.state in FINISHED:
        raise Conflict(
            f"This job already ended ({job.state}).",
            "Nothing to cancel; delete it with DELETE /api/v1/jobs/{job_id}.",
            code="JOB_FINISHED",
        )
    if not finish(
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
