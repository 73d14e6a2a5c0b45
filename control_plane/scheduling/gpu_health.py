"""An agent's GPU health report, applied (issue 28): `apply_report` records it by the fleet's
rules (`fleet.gpu_health.record_report`) and, for each GPU it turns unhealthy, in the same
transaction, fails the jobs running on that GPU (`GPU_FAILED`) and puts the services holding it
back to `pending`; then wakes the scheduler, the node's cancellation watch and each failed
job's followers once it commits. It sits here, above `fleet`, `jobs` and `services`, because it
acts on all three."""

from __future__ import annotations

from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.fleet import gpu_health
from control_plane.fleet.schemas import GpuHealthRequest
from control_plane.jobs import gpu_failures as job_failures
from control_plane.scheduling.dispatch import CAPACITY, job_key, jobs_changed, node_key
from control_plane.services import gpu_failures as service_failures


def apply_report(
    *, session: Session, clock: Clock, node_id: str, report: GpuHealthRequest
) -> list[gpu_health.GpuChange]:
    """Record `report` of node `node_id`'s GPUs and stop the work on any it turns unhealthy;
    returns the GPUs whose state or rules state changed."""
    now = clock.now()
    # Node, jobs, GPUs, then the services on a failed GPU: the lock order of every writer
    # (`fleet.gpu_health.lock_node`; a replica's placement locks a node before its service).
    # Only a report with a GPU judged unhealthy can fail jobs, so only that one locks them.
    gpu_health.lock_node(session, node_id)
    if any(gpu.state == "unhealthy" for gpu in report.gpus):
        job_failures.lock_running(session, node_id=node_id)
    changes = gpu_health.record_report(session, node_id=node_id, report=report, now=now)
    keys: set[str] = set()
    for change in changes:
        if not change.failed:
            if change.to_state != change.from_state:
                keys.add(CAPACITY)  # placement reads a new order of its GPUs
            continue
        cause = change.cause()
        gpu = f"GPU {change.index} ({change.uuid}) of node {node_id}"
        failed = job_failures.fail_on_gpu(
            session,
            node_id=node_id,
            uuid=change.uuid,
            message=f"{gpu} failed: {cause}",
            now=now,
        )
        service_failures.replace_from_gpu(
            session,
            node_id=node_id,
            uuid=change.uuid,
            reason=f"{gpu} became unhealthy: {cause}; placed again on a healthy GPU",
            now=now,
        )
        keys.update({CAPACITY, node_key(node_id)})
        keys.update(job_key(job_id) for job_id in failed)
    if keys:
        jobs_changed(session, keys)
    return changes
