"""Agent API for work: the long-poll claim, the cancellation watch, progress reports and
completion — all authenticated by the node credential (artifact transfer: `agent_artifacts.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status

from control_plane.api.deps import ContextDep, NodeDep
from control_plane.api.routing import LaneRoute
from control_plane.context import AppContext
from control_plane.fleet.schemas import AssignedGpu
from control_plane.jobs import reports as job_reports
from control_plane.jobs.schemas import (
    AgentJobCancellations,
    AgentJobComplete,
    AgentJobControl,
    AgentJobReport,
    AgentJobWatch,
)
from control_plane.scheduling.claims import CLOSED, claim_until_closed
from control_plane.scheduling.dispatch import node_key
from control_plane.scheduling.placement import PlacedJob
from control_plane.scheduling.schemas import JobAssignment, WorkClaim
from control_plane.schemas import ResourceId

router = APIRouter(prefix="/api/v1/agent", tags=["agent"], route_class=LaneRoute)


def assignment(ctx: AppContext, job: PlacedJob) -> JobAssignment:
    """What a claim answers with (the route and the agents' fast path)."""
    return JobAssignment(
        job_id=job.id,
        entrypoint=job.entrypoint,
        params=job.params,
        inputs=job.inputs,
        resources=job.resources,
        assigned_gpus=[AssignedGpu.model_validate(gpu) for gpu in job.assigned_gpus],
        timeout_seconds=job.timeout_seconds,
        silence_timeout_seconds=job.silence_timeout_seconds,
        progress_interval_seconds=ctx.settings.job_progress_interval_seconds,
        stop_after_disconnect_seconds=job.stop_after_disconnect_seconds,
        secrets=job.secrets or {},
    )


@router.post(
    "/work/claim",
    response_model=JobAssignment,
    responses={204: {"description": "no work within the hold"}},
)
async def claim_work(
    body: WorkClaim, node: NodeDep, ctx: ContextDep, request: Request
) -> JobAssignment | Response:
    """Long poll: answers with a job as soon as the scheduler places one on this node."""
    placed = await claim_until_closed(
        scheduler=ctx.scheduler,
        authority=ctx.authority,
        completions=ctx.completions,
        node=node,
        hold=body.hold_seconds,
        closed=request.receive,
    )
    if placed is CLOSED:
        return Response(status_code=status.HTTP_204_NO_CONTENT)  # nobody reads it
    if not isinstance(placed, PlacedJob):
        # A credential revoked while the claim waited ends it, and it got nothing.
        ctx.authority.recheck(node)
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return assignment(ctx, placed)


@router.post("/jobs/watch", response_model=AgentJobCancellations)
async def watch_jobs(body: AgentJobWatch, node: NodeDep, ctx: ContextDep) -> AgentJobCancellations:
    """Long poll: which of the node's running jobs it must stop (cancelled, failed by a sweep)."""

    def check() -> list[str] | None:
        # Read-only: every agent reads again at every wake, and on SQLite waits for no writer.
        with ctx.read_session_factory() as session:
            stop = job_reports.cancellations(
                session=session, node_id=node.node_id, job_ids=body.job_ids
            )
        return stop or None

    async def attempt() -> list[str] | None:
        ctx.authority.recheck(node)
        # On the agent lane: agents' traffic never takes the pool every request's dependencies
        # (health's included) share. The wait between attempts holds no thread.
        return await ctx.lanes.agent.run(check)

    stopped = await ctx.dispatcher.poll(body.hold_seconds, attempt, [node_key(node.node_id)])
    return AgentJobCancellations(cancel=stopped or [])


@router.post("/jobs/{job_id}/events", response_model=AgentJobControl)
def report_job(
    job_id: ResourceId, body: AgentJobReport, node: NodeDep, ctx: ContextDep
) -> AgentJobControl:
    with ctx.session_factory.begin() as session:
        cancel = job_reports.record_report(
            session=session,
            clock=ctx.clock,
            job_id=job_id,
            node_id=node.node_id,
            events=[(e.kind, e.data) for e in body.events],
        )
    return AgentJobControl(cancel=cancel)


@router.post("/jobs/{job_id}/complete", response_model=AgentJobControl)
async def complete_job(
    job_id: ResourceId, body: AgentJobComplete, node: NodeDep, ctx: ContextDep
) -> AgentJobControl:
    """Answered once the outcome is committed (in a group with other agents' outcomes)."""
    await ctx.completions.record(outcome(job_id, node.node_id, body))
    return AgentJobControl(cancel=False)


def outcome(job_id: str, node_id: str, body: AgentJobComplete) -> job_reports.Outcome:
    """The outcome an agent's completion reports (the route and the agents' fast path)."""
    return job_reports.Outcome(
        job_id=job_id,
        node_id=node_id,
        state=body.state,
        result=body.result,
        outputs=dict(body.outputs),
        error=(body.error.code, body.error.message) if body.error else None,
    )
