"""An operator's hand on a node's GPUs (issue 28): the views of its GPUs and of one GPU's
timeline, quarantine, lifting a quarantine, and what the end of a GPU's active check does.

Re-admission's rules live with the active check's creation in `scheduling/gpu_admin.py` (the
check is a job, and jobs sit above this room); this module only changes the GPU's row and
timeline, through `gpu_health.set_state` as the agents' reports do. It never stops running
work: a quarantine drains a GPU (no new placements), it does not fail what runs there.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.errors import GpuNotFound
from control_plane.fleet.gpu_health import gpu_row, healthy_row, lock_node, set_state
from control_plane.fleet.nodes import get_node
from control_plane.fleet.schemas import (
    GpuCheck,
    GpuHealthEventPublic,
    GpuHealthPublic,
    GpuQuarantine,
)
from control_plane.models import GpuHealth, GpuHealthEvent, Job, Node
from control_plane.scheduling.dispatch import CAPACITY, jobs_changed, node_key

#: The actor of what the active check decides.
CHECK_ACTOR = "check"


@dataclass(frozen=True)
class AdminGpu:
    """One GPU of a node as an admin request names it: its row (None while it has none: an
    implicit healthy GPU of the inventory) and its index."""

    node: Node
    uuid: str
    index: int
    row: GpuHealth | None

    @property
    def label(self) -> str:
        """How messages name it: never the node id or UUID of the request's path."""
        return f"GPU {self.index} of this node"


def _inventory_gpus(node: Node) -> list[dict[str, Any]]:
    gpus = (node.inventory or {}).get("gpus") or []
    return [gpu for gpu in gpus if isinstance(gpu, dict) and "uuid" in gpu]


def find_gpu(session: Session, *, node_id: str, uuid: str, lock: bool = False) -> AdminGpu:
    """The node's GPU `uuid`, from its row or its inventory; NODE_NOT_FOUND, GPU_NOT_FOUND.
    With `lock`, the node's row and then the GPU's are locked, in the order the agents' reports
    take them (`gpu_health.lock_node`)."""
    if lock:
        lock_node(session, node_id)
    node = get_node(session=session, node_id=node_id)
    row = gpu_row(session, node_id, uuid, lock=lock)
    if row is not None:
        return AdminGpu(node, uuid, row.index, row)
    for gpu in _inventory_gpus(node):
        if gpu["uuid"] == uuid:
            return AdminGpu(node, uuid, int(gpu["index"]), None)
    raise GpuNotFound()


# -- views -------------------------------------------------------------------------------------


def gpus_of_node(*, session: Session, node_id: str) -> list[GpuHealthPublic]:
    """Every GPU of the node's inventory, in index order (one without a row is healthy since
    the inventory's time), then any GPU a report named that the inventory does not list yet."""
    node = get_node(session=session, node_id=node_id)
    rows = {
        row.uuid: row
        for row in session.scalars(select(GpuHealth).where(GpuHealth.node_id == node_id))
    }
    checks = _check_states(session, [r.check_job_id for r in rows.values() if r.check_job_id])
    views = []
    for gpu in sorted(_inventory_gpus(node), key=lambda gpu: int(gpu["index"])):
        row = rows.pop(gpu["uuid"], None)
        name = gpu.get("name")
        if row is None:
            views.append(_implicit_healthy(node_id, gpu, node.inventory_at))
        else:
            views.append(_public(row, name=name, checks=checks))
    views += [_public(row, name=None, checks=checks) for row in sorted(rows.values(), key=_index)]
    return views


def gpu_public(session: Session, gpu: AdminGpu) -> GpuHealthPublic:
    """One GPU's view, as `gpus_of_node` lists it."""
    name = next((g.get("name") for g in _inventory_gpus(gpu.node) if g["uuid"] == gpu.uuid), None)
    if gpu.row is None:
        return _implicit_healthy(
            gpu.node.id, {"index": gpu.index, "uuid": gpu.uuid, "name": name}, None
        )
    checks = _check_states(session, [gpu.row.check_job_id] if gpu.row.check_job_id else [])
    return _public(gpu.row, name=name, checks=checks)


def gpu_events(
    *, session: Session, node_id: str, uuid: str, limit: int
) -> list[GpuHealthEventPublic]:
    """The GPU's timeline, newest first."""
    find_gpu(session, node_id=node_id, uuid=uuid)
    rows = session.scalars(
        select(GpuHealthEvent)
        .where(GpuHealthEvent.node_id == node_id, GpuHealthEvent.uuid == uuid)
        .order_by(GpuHealthEvent.id.desc())
        .limit(limit)
    )
    return [
        GpuHealthEventPublic(
            id=r.id,
            at=r.at,
            kind=r.kind,
            from_state=r.from_state,
            to_state=r.to_state,
            reason=r.reason,
            evidence=r.evidence,
            actor=r.actor,
        )
        for r in rows
    ]


def check_running(session: Session, row: GpuHealth) -> bool:
    """Whether the GPU's active check is still queued or running. Its end clears
    `check_job_id` (`check_ended`); one that points at an ended or deleted job anyway is not
    a running check, so it never blocks a re-admission for good."""
    if row.check_job_id is None:
        return False
    state = _check_states(session, [row.check_job_id]).get(row.check_job_id)
    return state in ("queued", "running")


def _index(row: GpuHealth) -> int:
    return row.index


def _check_states(session: Session, job_ids: list[str]) -> dict[str, str]:
    if not job_ids:
        return {}
    rows = session.execute(select(Job.id, Job.state).where(Job.id.in_(job_ids)))
    return {job_id: state for job_id, state in rows}


def _implicit_healthy(node_id: str, gpu: dict[str, Any], since: datetime | None) -> GpuHealthPublic:
    """The view of a GPU that has no row yet: the row it would get (`healthy_row`)."""
    row = healthy_row(node_id, gpu["uuid"], int(gpu["index"]), since)
    return _public(row, name=gpu.get("name"), checks={})


def _public(row: GpuHealth, *, name: str | None, checks: dict[str, str]) -> GpuHealthPublic:
    quarantine = None
    if row.quarantine_reason is not None and row.quarantined_at is not None:
        quarantine = GpuQuarantine(reason=row.quarantine_reason, at=row.quarantined_at)
    check = None
    if row.check_job_id:
        check = GpuCheck(job_id=row.check_job_id, state=checks.get(row.check_job_id, "deleted"))
    return GpuHealthPublic(
        index=row.index,
        uuid=row.uuid,
        name=name,
        state=row.state,
        rules_state=row.rules_state,
        reported=row.reported,
        reason=row.reason,
        evidence=list(row.evidence or []),
        since=row.since,
        quarantine=quarantine,
        check=check,
    )


# -- changes -----------------------------------------------------------------------------------


def quarantine(
    *, session: Session, clock: Clock, node_id: str, uuid: str, reason: str, actor: str
) -> GpuHealthPublic:
    """Take the GPU out of the schedule by an operator's hand (running work drains: nothing is
    stopped). A GPU never reported gets its row now; an already quarantined one a new reason."""
    gpu = find_gpu(session, node_id=node_id, uuid=uuid, lock=True)
    now = clock.now()
    row = gpu.row or gpu_row(session, node_id, uuid, create_index=gpu.index, lock=True)
    assert row is not None  # noqa: S101 - created when missing
    if row.quarantine_reason is None:
        row.quarantined_at = now
    row.quarantine_reason = reason
    set_state(
        session,
        row,
        state="quarantined",
        reason=reason,
        evidence=None,
        kind="quarantine",
        actor=actor,
        now=now,
    )
    _wake(session, node_id)
    return gpu_public(session, AdminGpu(gpu.node, uuid, row.index, row))


def lift_quarantine(session: Session, gpu: AdminGpu, *, actor: str, now: datetime) -> None:
    """Re-admit a GPU only an operator's quarantine held: back to what the rules say."""
    row = gpu.row
    assert row is not None and row.quarantine_reason is not None  # noqa: S101 - the caller's rule
    row.quarantine_reason = None
    row.quarantined_at = None
    set_state(
        session,
        row,
        state=row.rules_state,
        reason=f"quarantine lifted by {actor}",
        evidence=None,
        kind="readmit",
        actor=actor,
        now=now,
    )
    _wake(session, row.node_id)


def check_started(
    session: Session, gpu: AdminGpu, *, job_id: str, actor: str, now: datetime
) -> None:
    """Record the active check `job_id` an operator's re-admission started on the GPU."""
    row = gpu.row
    assert row is not None  # noqa: S101 - only a rules-unhealthy GPU is checked
    row.check_job_id = job_id
    _event(
        session,
        row,
        kind="check",
        reason=f"re-admission asked: active check started (job {job_id})",
        actor=actor,
        now=now,
    )


def check_ended(
    session: Session,
    *,
    job_id: str,
    pinned: dict[str, Any],
    state: str,
    error: tuple[str, str] | None,
    at: datetime,
) -> None:
    """A pinned job ended (`jobs._changes`, however it ended). When it is the GPU's running
    active check: passed while the agent does not report the GPU unhealthy -> healthy again, a
    quarantine already there when the check started lifted with it (one an operator placed
    after holds: the rules' verdict alone is cleared); else the GPU stays out, the failure in
    its timeline."""
    row = gpu_row(session, str(pinned.get("node_id")), str(pinned.get("uuid")), lock=True)
    if row is None or row.check_job_id != job_id:
        return
    row.check_job_id = None
    passed = state == "succeeded" and row.reported != "unhealthy"
    if passed and _quarantined_since(session, row, job_id):
        # The operator's later word stands: only what the check answered (the rules) clears.
        set_state(
            session,
            row,
            state="quarantined",
            rules_state="healthy",
            reason=f"the active check passed (job {job_id}), but the quarantine placed after "
            "it started holds: re-admit the GPU to lift it",
            evidence=None,
            kind="check",
            actor=CHECK_ACTOR,
            now=at,
        )
        return
    if passed:
        row.quarantine_reason = None
        row.quarantined_at = None
        set_state(
            session,
            row,
            state="healthy",
            rules_state="healthy",
            reason=f"the active check passed (job {job_id})",
            evidence=None,
            kind="readmit",
            actor=CHECK_ACTOR,
            now=at,
        )
        _wake(session, row.node_id)
        return
    if state == "succeeded":
        why = "it passed, but the agent reports the GPU unhealthy again"
    elif error is not None:
        why = f"{error[0]}: {error[1]}"
    else:
        why = state
    _event(
        session,
        row,
        kind="check",
        reason=f"the active check failed (job {job_id}, {state}): {why}"[:2000],
        actor=CHECK_ACTOR,
        now=at,
    )


def _quarantined_since(session: Session, row: GpuHealth, job_id: str) -> bool:
    """Whether an operator quarantined the GPU after its active check `job_id` started (was
    submitted: the check's job is made in the re-admission's transaction)."""
    if row.quarantine_reason is None or row.quarantined_at is None:
        return False
    started = session.scalar(select(Job.created_at).where(Job.id == job_id))
    return started is not None and row.quarantined_at > started


def _event(
    session: Session, row: GpuHealth, *, kind: str, reason: str, actor: str, now: datetime
) -> None:
    """A timeline entry that changes no state (a check started or failed)."""
    session.add(
        GpuHealthEvent(
            node_id=row.node_id,
            uuid=row.uuid,
            at=now,
            kind=kind,
            from_state=row.state,
            to_state=row.state,
            reason=reason,
            evidence=None,
            actor=actor[:64],
        )
    )


def _wake(session: Session, node_id: str) -> None:
    """The GPU's place in the schedule changed: the scheduler and the fleet view look again."""
    jobs_changed(session, [CAPACITY, node_key(node_id)])
