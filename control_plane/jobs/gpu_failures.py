"""Jobs on a GPU that failed (issue 28): each running job holding it ends `failed` with
`GPU_FAILED`. Deciding that a GPU failed is the fleet's (`fleet.gpu_health`); the caller,
`scheduling.gpu_health`, calls this in the transaction that records it."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.jobs._changes import RunningJob, finish
from control_plane.models import Job

GPU_FAILED = "GPU_FAILED"


def lock_running(session: Session, *, node_id: str) -> None:
    """Lock the rows of the jobs running on `node_id` (in id order, as a completion group takes
    them), before a GPU's row: a job's end locks its row, then its active check's GPU's."""
    session.execute(
        select(Job.id)
        .where(Job.node_id == node_id, Job.state == "running")
        .order_by(Job.id)
        .with_for_update()
    ).all()


def fail_on_gpu(
    session: Session, *, node_id: str, uuid: str, message: str, now: datetime
) -> list[str]:
    """Fail every job running on `node_id` that holds the GPU `uuid`, with `GPU_FAILED` and
    `message`; returns their ids. Each end wakes its followers, the node's cancellation watch
    (its agent stops the job at once) and the scheduler (`_changes.finish`)."""
    failed: list[str] = []
    running = session.execute(
        select(Job.id, Job.assigned_gpus).where(Job.node_id == node_id, Job.state == "running")
    ).all()
    for job_id, gpus in running:
        if not any(isinstance(gpu, dict) and gpu.get("uuid") == uuid for gpu in gpus or []):
            continue
        if finish(
            session,
            RunningJob(job_id, node_id, False),
            state="failed",
            at=now,
            from_states=("running",),
            error=(GPU_FAILED, message),
            node_id=node_id,
        ):
            failed.append(job_id)
    return failed
