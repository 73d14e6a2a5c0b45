"""Agent API for work: the long-poll claim, the cancellation watch, progress
reports, completion, and artifact transfer — all authenticated by the node credential."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse

from control_plane.api.deps import ContextDep, NodeDep
from control_plane.api.ranges import artifact_response
from control_plane.context import AppContext
from control_plane.models import Job
from control_plane.schemas import (
    AgentJobCancellations,
    AgentJobComplete,
    AgentJobControl,
    AgentJobReport,
    AgentJobWatch,
    ArtifactPublic,
    Digest,
    JobAssignment,
    ResourceId,
    WorkClaim,
)
from control_plane.services import artifacts, jobs
from control_plane.services.scheduling import claim_next_job

router = APIRouter(prefix="/api/v1/agent", tags=["agent"])


def _assignment(ctx: AppContext, job: Job) -> JobAssignment:
    return JobAssignment(
        job_id=job.id,
        entrypoint=job.entrypoint,
        params=job.params,
        inputs=job.inputs,
        resources=job.resources,
        assigned_gpus=jobs.assigned_gpus(job),
        timeout_seconds=job.timeout_seconds,
        silence_timeout_seconds=job.silence_timeout_seconds,
        progress_interval_seconds=ctx.settings.job_progress_interval_seconds,
    )


def _claim(ctx: AppContext, node_id: str) -> JobAssignment | None:
    with ctx.session_factory.begin() as session:
        job = claim_next_job(
            session=session,
            clock=ctx.clock,
            node_id=node_id,
            liveness=ctx.liveness,
        )
        return None if job is None else _assignment(ctx, job)


@router.post(
    "/work/claim",
    response_model=JobAssignment,
    responses={204: {"description": "no work within the hold"}},
)
async def claim_work(body: WorkClaim, node: NodeDep, ctx: ContextDep) -> JobAssignment | Response:
    """Long poll: answers with a job as soon as one this node may run is queued."""

    async def attempt() -> JobAssignment | None:
        # A credential revoked while the claim waits ends it, and hands it nothing.
        ctx.authority.recheck(node)
        return await run_in_threadpool(_claim, ctx, node.node_id)

    found = await ctx.dispatcher.poll(body.hold_seconds, attempt)
    return found if found is not None else Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/jobs/watch", response_model=AgentJobCancellations)
async def watch_jobs(body: AgentJobWatch, node: NodeDep, ctx: ContextDep) -> AgentJobCancellations:
    """Long poll: which of the node's running jobs it must stop (cancelled, failed by a sweep)."""

    def check() -> list[str] | None:
        with ctx.session_factory() as session:
            stop = jobs.cancellations(session=session, node_id=node.node_id, job_ids=body.job_ids)
        return stop or None

    async def attempt() -> list[str] | None:
        ctx.authority.recheck(node)
        return await run_in_threadpool(check)

    return AgentJobCancellations(cancel=await ctx.dispatcher.poll(body.hold_seconds, attempt) or [])


@router.post("/jobs/{job_id}/events", response_model=AgentJobControl)
def report_job(
    job_id: ResourceId, body: AgentJobReport, node: NodeDep, ctx: ContextDep
) -> AgentJobControl:
    with ctx.session_factory.begin() as session:
        cancel = jobs.record_report(
            session=session,
            clock=ctx.clock,
            job_id=job_id,
            node_id=node.node_id,
            events=[(e.kind, e.data) for e in body.events],
        )
    return AgentJobControl(cancel=cancel)


@router.post("/jobs/{job_id}/complete", response_model=AgentJobControl)
def complete_job(
    job_id: ResourceId, body: AgentJobComplete, node: NodeDep, ctx: ContextDep
) -> AgentJobControl:
    with ctx.session_factory.begin() as session:
        jobs.complete_job(
            session=session,
            clock=ctx.clock,
            job_id=job_id,
            node_id=node.node_id,
            state=body.state,
            result=body.result,
            outputs=dict(body.outputs),
            error=(body.error.code, body.error.message) if body.error else None,
        )
    return AgentJobControl(cancel=False)


@router.put(
    "/artifacts/{digest}", status_code=status.HTTP_201_CREATED, response_model=ArtifactPublic
)
async def upload_artifact(
    digest: Digest, request: Request, node: NodeDep, ctx: ContextDep
) -> ArtifactPublic:
    """Streaming upload; refused unless the content hashes to `digest`."""
    stored, size = await ctx.artifacts.receive(request.stream(), expected=digest)

    def record() -> ArtifactPublic:
        with ctx.session_factory.begin() as session:
            row = artifacts.record_upload(
                session=session, clock=ctx.clock, digest=stored, size=size, node_id=node.node_id
            )
            return ArtifactPublic(
                digest=row.digest, size_bytes=row.size_bytes, created_at=row.created_at
            )

    return await run_in_threadpool(record)


@router.get("/artifacts/{digest}", response_class=FileResponse)
def download_artifact(
    digest: Digest, request: Request, node: NodeDep, ctx: ContextDep
) -> FileResponse:
    """Streaming download with HTTP range requests, so an interrupted transfer resumes. Only
    what this node's jobs name, or what it uploaded; anything else is 404 ARTIFACT_NOT_FOUND."""
    with ctx.session_factory() as session:
        artifacts.get_artifact_for_node(
            session=session,
            store=ctx.artifacts,
            clock=ctx.clock,
            digest=digest,
            node_id=node.node_id,
        )
    return artifact_response(ctx.artifacts.path_for(digest), digest=digest, headers=request.headers)
