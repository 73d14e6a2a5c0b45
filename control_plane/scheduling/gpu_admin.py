"""Re-admitting a GPU to the schedule (issue 28), the one call of its admin route.

A GPU only an operator's quarantine holds comes back at once. A GPU the rules made unhealthy
comes back only through its active check: a job pinned to that GPU of that node
(`Job.pinned`), queued here through `jobs.lifecycle` as any submitted job is (its events, the
scheduler's wake-up), in the same transaction as the GPU's `check_job_id`. How the check's end
re-admits the GPU or keeps it out is `fleet/gpu_admin.check_ended`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.errors import GpuCheckRunning, GpuInService, GpuNotClean
from control_plane.fleet import gpu_admin
from control_plane.fleet.gpu_check import check_job
from control_plane.fleet.schemas import GpuHealthPublic
from control_plane.jobs.lifecycle import submit_jobs
from control_plane.jobs.schemas import JobCreate


@dataclass(frozen=True)
class Readmission:
    """The GPU's view after a re-admission, and whether it waits for its active check."""

    gpu: GpuHealthPublic
    check_started: bool


def readmit(
    *, session: Session, clock: Clock, node_id: str, uuid: str, provider: str, actor: str
) -> Readmission:
    """Re-admit the node's GPU `uuid`: at once when only a quarantine holds it; through its
    active check (on `provider`) when the rules made it unhealthy; refused otherwise
    (GPU_IN_SERVICE, GPU_NOT_CLEAN, GPU_CHECK_RUNNING), changing nothing."""
    gpu = gpu_admin.find_gpu(session, node_id=node_id, uuid=uuid, lock=True)
    row = gpu.row
    now = clock.now()
    if row is None or (row.rules_state != "unhealthy" and row.quarantine_reason is None):
        raise GpuInService(gpu=gpu.label, state=row.state if row else "healthy")
    if row.rules_state != "unhealthy":
        gpu_admin.lift_quarantine(session, gpu, actor=actor, now=now)
        return Readmission(gpu_admin.gpu_public(session, gpu), check_started=False)
    if row.reported == "unhealthy":
        raise GpuNotClean(gpu=gpu.label, evidence=_evidence(row.reason, row.evidence))
    if row.check_job_id is not None and gpu_admin.check_running(session, row):
        raise GpuCheckRunning(gpu=gpu.label, job_id=row.check_job_id)
    fields = check_job(node_id=node_id, uuid=uuid, index=gpu.index, provider=provider)
    (job,) = submit_jobs(session=session, clock=clock, requests=[JobCreate.model_validate(fields)])
    # The pin is no field a user may submit; set in the submission's own transaction, so the
    # scheduler, woken when it commits, reads the job with its pin.
    job.pinned = {"node_id": node_id, "uuid": uuid}
    session.flush()
    gpu_admin.check_started(session, gpu, job_id=job.id, actor=actor, now=now)
    return Readmission(gpu_admin.gpu_public(session, gpu), check_started=True)


def _evidence(reason: str, evidence: list[dict[str, object]] | None) -> str:
    """What the agent still sees, for the refusal: the newest evidence, else the reason."""
    details = [str(item.get("detail", "")) for item in (evidence or [])[-3:] if item.get("detail")]
    return "; ".join(details) or reason or "no detail reported"
