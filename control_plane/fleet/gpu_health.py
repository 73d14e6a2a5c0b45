"""Per-GPU health (issue 28): what the agents report of each GPU, an operator's quarantine and
re-admission, and what the scheduler reads of it.

States: `healthy`, `degraded` (placed on last), `unhealthy` (out of the schedule until an
admin re-admits it and its active check passes) and `quarantined` (out by an operator's hand).

`state` is `quarantined` while an operator's quarantine holds, else `rules_state`, what the
rules made of the agent's reports (`record_report`): the agent's `unhealthy` makes it
`unhealthy`, and that sticks (later clean reports only update `reported`); `degraded` and
`healthy` are taken as reported otherwise. Every change of a row's state passes through
`set_state`, which writes its timeline (`gpu_health_events`). This module never fails jobs or
moves services: that is `scheduling.gpu_health`'s, above the jobs and services.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.fleet.schemas import GpuEvidence, GpuHealthReport, GpuHealthRequest
from control_plane.models import GpuHealth, GpuHealthEvent, Node
from modelforge_contracts import gpu_health as contract
from modelforge_contracts.gpu_health import EvidenceKind, describe_evidence, describe_xid

#: The states the scheduler never places on.
OUT_OF_SCHEDULE = frozenset({"unhealthy", "quarantined"})
#: Every state a GPU can be in, as `state` (and the metrics' label values).
STATES = ("healthy", "degraded", "unhealthy", "quarantined")
#: How many evidence entries a GPU keeps: the newest, as many as one report carries.
MAX_EVIDENCE = contract.MAX_EVIDENCE
#: Evidence kinds that make a GPU unhealthy (the others only degrade it).
FAULT_KINDS = frozenset(str(kind) for kind in contract.UNHEALTHY_KINDS)


def out_of_schedule(
    session: Session, node_ids: list[str] | None = None
) -> dict[str, dict[str, str]]:
    """Per node, every GPU not `healthy` (by UUID: its state). A GPU without a row is healthy.
    With `node_ids`, only theirs. One query over the few rows not healthy (indexed by state)."""
    query = select(GpuHealth.node_id, GpuHealth.uuid, GpuHealth.state).where(
        GpuHealth.state != "healthy"
    )
    if node_ids is not None:
        query = query.where(GpuHealth.node_id.in_(node_ids))
    found: dict[str, dict[str, str]] = {}
    for node_id, uuid, state in session.execute(query):
        found.setdefault(node_id, {})[uuid] = state
    return found


@dataclass(frozen=True)
class GpuChange:
    """A GPU whose `state` or `rules_state` a report changed."""

    node_id: str
    uuid: str
    index: int
    from_state: str
    to_state: str
    from_rules: str
    to_rules: str
    reason: str
    #: This report's evidence of the GPU, oldest first.
    evidence: list[dict[str, Any]]
    #: Unhealthy already, and its agent reports a fault again after reporting it clean.
    refault: bool = False

    @property
    def failed(self) -> bool:
        """The rules turned it unhealthy with this report (whether or not it is quarantined),
        or it faulted again: the work on it (after a fault: only its active check) must stop."""
        return self.to_rules == "unhealthy" and (self.from_rules != "unhealthy" or self.refault)

    def cause(self) -> str:
        """What made it change, for people: its newest fault (`XID 79 (GPU has fallen off the
        bus) at ...`), else the agent's reason."""
        faults = [item for item in self.evidence if item["kind"] in FAULT_KINDS]
        if not faults:
            return self.reason or f"the agent reports it {self.to_rules}"
        newest = faults[-1]
        if newest["kind"] == EvidenceKind.XID:
            # The catalogue's words, not the agent's detail, which already says the same.
            return f"{describe_xid(int(newest['xid']))} at {newest['at']}"
        if not newest.get("detail"):
            return f"{newest['kind']} at {newest['at']}"
        return describe_evidence(newest)


def gpu_row(
    session: Session,
    node_id: str,
    uuid: str,
    *,
    create_index: int | None = None,
    lock: bool = False,
    now: datetime | None = None,
) -> GpuHealth | None:
    """The GPU's row (locked with `lock`); None when it has none, unless `create_index` is
    given: then a healthy row is created with that index, as of `now` (else the node's
    inventory time, when a GPU known from its inventory has been healthy since). Creating locks
    the node's row first, so two writers never both create it."""
    query = select(GpuHealth).where(GpuHealth.node_id == node_id, GpuHealth.uuid == uuid)
    row = session.scalars(query.with_for_update() if lock else query).first()
    if row is not None or create_index is None:
        return row
    node = session.scalars(
        select(Node).where(Node.id == node_id).with_for_update(key_share=True)
    ).first()
    row = session.scalars(query.with_for_update()).first()  # created while we waited
    if row is not None or node is None:
        return row
    row = healthy_row(node_id, uuid, create_index, now or node.inventory_at or node.created_at)
    session.add(row)
    session.flush()
    return row


def healthy_row(node_id: str, uuid: str, index: int, since: datetime | None) -> GpuHealth:
    """A GPU's row as it stands before anything was reported of it: healthy since `since`. Not
    added to a session: `gpu_row` adds it, the views show a GPU that has no row through it."""
    return GpuHealth(
        node_id=node_id,
        uuid=uuid,
        index=index,
        state="healthy",
        rules_state="healthy",
        reported="healthy",
        reason="",
        evidence=[],
        since=since,
        reported_at=since,
    )


def set_state(
    session: Session,
    row: GpuHealth,
    *,
    state: str,
    rules_state: str | None = None,
    reason: str,
    evidence: list[dict[str, Any]] | None,
    kind: str,
    actor: str,
    now: datetime,
) -> None:
    """Write `row`'s state (and `rules_state`, when given), its reason, `evidence` (what showed
    this change; None or empty: nothing new) into its bounded history (the newest
    `MAX_EVIDENCE`, none twice), `since` when the state changes, and one `gpu_health_events`
    row of `kind` by `actor`. The event's from/to are the GPU's
    states; while it stays `quarantined`, its rules states (what changed underneath)."""
    before, before_rules = row.state, row.rules_state
    if rules_state is not None:
        row.rules_state = rules_state
    row.state = state
    if state != before:
        row.since = now
    row.reason = reason
    if evidence:
        row.evidence = merge_evidence(list(row.evidence or []), evidence)
    shown = (before, state)
    if before == state == "quarantined" and rules_state is not None:
        shown = (before_rules, rules_state)
    session.add(
        GpuHealthEvent(
            node_id=row.node_id,
            uuid=row.uuid,
            at=now,
            kind=kind,
            from_state=shown[0],
            to_state=shown[1],
            reason=reason,
            evidence=evidence or None,
            actor=actor,
        )
    )


def merge_evidence(kept: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`kept` and the entries of `new` not in it, oldest first, the newest `MAX_EVIDENCE`."""
    seen = {_evidence_key(item) for item in kept}
    merged = kept + [item for item in new if _evidence_key(item) not in seen]
    merged.sort(key=_when)
    return merged[-MAX_EVIDENCE:]


def _when(item: dict[str, Any]) -> datetime:
    at = item.get("at")
    return datetime.fromisoformat(at) if isinstance(at, str) else datetime.min.replace(tzinfo=UTC)


def _evidence_key(item: dict[str, Any]) -> tuple[Any, ...]:
    return (item.get("kind"), item.get("at"), item.get("xid"), item.get("detail"))


def evidence_of(entries: list[GpuEvidence]) -> list[dict[str, Any]]:
    """A report's evidence as stored: JSON, its times in ISO-8601 UTC, oldest first."""
    stored = [entry.stored() for entry in entries]
    stored.sort(key=_when)
    return stored


def lock_node(session: Session, node_id: str) -> None:
    """Lock the node's row, the first of the rows a GPU's change takes. The order is node,
    jobs, GPUs: a report that may fail jobs locks the node's running jobs before its GPUs
    (`scheduling.gpu_health`), because a job's end (an agent's completion, a cancellation, the
    sweep) locks the job's row and then, for an active check, its GPU's; the other order would
    let a report and a completion group on PostgreSQL wait on each other for good.

    `FOR NO KEY UPDATE`: it still serialises with a batch placing on the node (which takes
    `FOR UPDATE`), but not with a row that only references the node (a GPU's timeline entry
    written by a job's end takes `FOR KEY SHARE` on it through its foreign key)."""
    session.execute(select(Node.id).where(Node.id == node_id).with_for_update(key_share=True))


def record_report(
    session: Session, *, node_id: str, report: GpuHealthRequest, now: datetime
) -> list[GpuChange]:
    """Apply one agent's report of its GPUs (the full snapshot; sent again as a refresh, so it
    is idempotent) by the rules; returns the GPUs whose state or rules state it changed.

    The node's row is locked first: reports of one node and a batch placing on it (which locks
    the same row, then reads the GPUs out of the schedule) are serialised, so no job is placed
    on a GPU this report takes out without the report's transaction seeing and failing it. A
    GPU the node's inventory does not list yet is recorded all the same (inventories lag).

    Locks are taken node, then (the caller's, when it may fail jobs) the jobs, then the GPUs:
    the order of every other writer of these rows (`lock_node`)."""
    lock_node(session, node_id)
    rows = {
        row.uuid: row
        for row in session.scalars(
            select(GpuHealth).where(GpuHealth.node_id == node_id).with_for_update()
        )
    }
    changes: list[GpuChange] = []
    for gpu in report.gpus:
        row = rows.get(gpu.uuid) or gpu_row(
            session, node_id, gpu.uuid, create_index=gpu.index, now=now
        )
        assert row is not None  # noqa: S101 - the node row exists (it authenticated)
        change = _apply(session, row, gpu, now)
        if change is not None:
            changes.append(change)
    return changes


def _apply(
    session: Session, row: GpuHealth, gpu: GpuHealthReport, now: datetime
) -> GpuChange | None:
    """One GPU's report by the rules; its change, if any."""
    reported_before = row.reported
    row.index = gpu.index
    row.reported = gpu.state
    row.reported_at = now
    evidence = evidence_of(gpu.evidence)
    if row.rules_state == "unhealthy":
        # Sticky: only re-admission after a passing check ends it. A clean report changes
        # nothing else; a fault reported anew (its active check may be running on it) fails
        # what runs there again.
        refault = gpu.state == "unhealthy" and reported_before != "unhealthy"
        rules = "unhealthy"
    else:
        refault = False
        rules = gpu.state
    state = "quarantined" if row.quarantine_reason is not None else rules
    if rules == row.rules_state and state == row.state and not refault:
        if gpu.state == "unhealthy" or rules != "unhealthy":
            row.evidence = merge_evidence(list(row.evidence or []), evidence)
        return None
    change = GpuChange(
        node_id=row.node_id,
        uuid=row.uuid,
        index=gpu.index,
        from_state=row.state,
        to_state=state,
        from_rules=row.rules_state,
        to_rules=rules,
        reason=gpu.reason,
        evidence=evidence,
        refault=refault,
    )
    if change.failed:
        reason = gpu.reason or change.cause()
    else:
        reason = gpu.reason or f"the agent reports it {rules}"
    set_state(
        session,
        row,
        state=state,
        rules_state=rules,
        reason=reason,
        evidence=evidence,
        kind="state",
        actor="agent",
        now=now,
    )
    return change
