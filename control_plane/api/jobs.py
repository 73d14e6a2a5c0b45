"""Jobs and artifacts for users (admin token): submit, list, get, cancel, delete, events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, status
from fastapi.responses import FileResponse
from pydantic import StringConstraints
from sqlalchemy.orm import Session

from control_plane.access.roles import Area
from control_plane.api.deps import AuditDep, ContextDep, SessionDep, needs
from control_plane.api.ranges import artifact_response
from control_plane.api.routing import LaneRoute
from control_plane.artifacts import store
from control_plane.artifacts.schemas import ArtifactPublic
from control_plane.audit import ADMIN_TOKEN_ACTOR, Audit
from control_plane.context import AppContext
from control_plane.jobs import lifecycle
from control_plane.jobs.schemas import (
    JobBatchCreate,
    JobBatchPublic,
    JobCreate,
    JobEventPublic,
    JobPublic,
)
from control_plane.models import Job
from control_plane.scheduling.dispatch import job_key
from control_plane.schemas import DB_INT_MAX, Digest, ResourceId

#: `key=value`: a job list keeps the jobs that carry it.
LabelFilter = Annotated[str, StringConstraints(pattern=r"^[^=]{1,100}=.{0,200}$")]
#: Each filter is one more condition in the query (SQLite refuses a deep expression tree).
MAX_LABEL_FILTERS = 32

router = APIRouter(
    prefix="/api/v1", tags=["jobs"], dependencies=[needs(Area.WORK)], route_class=LaneRoute
)


def _public(ctx: AppContext, job: Job, session: Session) -> JobPublic:
    return lifecycle.job_public(job, ctx.scheduler.waiting_reason(job, session))


@router.post("/jobs", status_code=status.HTTP_201_CREATED, response_model=JobPublic)
def submit_job(body: JobCreate, ctx: ContextDep, session: SessionDep, audit: AuditDep) -> JobPublic:
    audit("job.submit", body.model or "", secrets=body.secrets)
    job = lifecycle.submit_job(session=session, clock=ctx.clock, request=body)
    audit.target = job.id
    view = _public(ctx, job, session)
    audit.succeeded(session)
    session.commit()
    return view


@router.post("/jobs:batch", status_code=status.HTTP_201_CREATED, response_model=JobBatchPublic)
def submit_jobs(
    body: JobBatchCreate, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> JobBatchPublic:
    """Up to 1,000 jobs in one transaction: all are queued, in the order given, or none (a bad
    one is named by its index, `jobs[<i>]`, and nothing is queued)."""
    audit("job.submit", f"batch of {len(body.jobs)}")
    queued = lifecycle.submit_jobs(session=session, clock=ctx.clock, requests=body.jobs)
    audit.detail = {"jobs": len(queued), "first": queued[0].id, "last": queued[-1].id}
    views = JobBatchPublic(jobs=[_public(ctx, job, session) for job in queued])
    audit.succeeded(session)
    session.commit()
    return views


@router.get("/jobs", response_model=list[JobPublic])
def list_jobs(
    ctx: ContextDep,
    session: SessionDep,
    state: Annotated[
        str | None, Query(pattern="^(queued|running|succeeded|failed|cancelled)$")
    ] = None,
    node_id: Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] = None,
    label: Annotated[
        list[LabelFilter] | None,
        Query(description="key=value", max_length=MAX_LABEL_FILTERS),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[JobPublic]:
    """Newest first. Each `label=key=value` (repeatable) keeps the jobs that carry it."""
    wanted = dict(item.split("=", 1) for item in label or [])
    rows = lifecycle.list_jobs(
        session=session, state=state, node_id=node_id, limit=limit, labels=wanted
    )
    return [_public(ctx, job, session) for job in rows]


@router.get("/jobs/{job_id}", response_model=JobPublic)
def get_job(job_id: ResourceId, ctx: ContextDep, session: SessionDep) -> JobPublic:
    return _public(ctx, lifecycle.get_job(session=session, job_id=job_id), session)


@router.post("/jobs/{job_id}/cancel", response_model=JobPublic)
def cancel_job(
    job_id: ResourceId, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> JobPublic:
    audit("job.cancel", job_id)
    job = lifecycle.cancel_job(session=session, clock=ctx.clock, job_id=job_id)
    view = _public(ctx, job, session)
    audit.succeeded(session)
    session.commit()
    return view


@router.delete("/jobs/{job_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_job(job_id: ResourceId, session: SessionDep, audit: AuditDep) -> None:
    audit("job.delete", job_id)
    lifecycle.delete_job(session=session, job_id=job_id)


def _events(ctx: AppContext, job_id: str, after: int, limit: int) -> list[JobEventPublic]:
    # Read-only: a long poll reads again at every wake, and on SQLite waits for no writer.
    with ctx.read_session_factory() as session:
        rows = lifecycle.list_events(session=session, job_id=job_id, after=after, limit=limit)
        return [JobEventPublic(seq=r.seq, at=r.at, kind=r.kind, data=r.data) for r in rows]


@router.get("/jobs/{job_id}/events", response_model=list[JobEventPublic])
async def job_events(
    job_id: ResourceId,
    ctx: ContextDep,
    after: Annotated[int, Query(ge=0, le=DB_INT_MAX)] = 0,
    wait: Annotated[float, Query(ge=0, le=60)] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 1000,
) -> list[JobEventPublic]:
    """Events after `after`, in order. With `wait`, a long poll: returns as soon as there are
    new ones (follow a job by passing the last `seq` seen back as `after`)."""

    async def attempt() -> list[JobEventPublic] | None:
        # On the admin lane, as the sync routes: not on the pool every request's dependencies
        # share. The wait between attempts holds no thread.
        return await ctx.lanes.admin.run(lambda: _events(ctx, job_id, after, limit)) or None

    return await ctx.dispatcher.poll(wait, attempt, [job_key(job_id)]) or []


@router.post("/artifacts", status_code=status.HTTP_201_CREATED, response_model=ArtifactPublic)
async def upload_artifact(request: Request, ctx: ContextDep) -> ArtifactPublic:
    digest, size = await ctx.artifacts.receive(request.stream(), expected=None)
    actor = getattr(request.state, "actor", ADMIN_TOKEN_ACTOR)
    # On the admin lane: a write that waits for the lock never holds a thread of the pool every
    # request's dependencies (health's included) share.
    return await ctx.lanes.admin.run(lambda: _record(ctx, digest, size, actor))


def _record(ctx: AppContext, digest: str, size: int, actor: str) -> ArtifactPublic:
    with ctx.session_factory.begin() as session:
        row = store.record_artifact(session=session, clock=ctx.clock, digest=digest, size=size)
        audit = Audit(actor=actor, clock=ctx.clock)
        audit("artifact.upload", digest, size_bytes=size)
        audit.succeeded(session)
        return ArtifactPublic(
            digest=row.digest, size_bytes=row.size_bytes, created_at=row.created_at
        )


@router.get("/artifacts/{digest}", response_class=FileResponse)
def download_artifact(
    digest: Digest, request: Request, ctx: ContextDep, session: SessionDep
) -> FileResponse:
    """Streaming download with HTTP range requests (`Range: bytes=<first>-<last>`)."""
    store.get_artifact(session=session, store=ctx.artifacts, digest=digest)
    return artifact_response(ctx.artifacts.path_for(digest), digest=digest, headers=request.headers)
