"""Nodes: liveness transitions, duplicate identities, views, deletion.

Liveness is computed by the one liveness reader (`fleet/liveness.py`) every time a node is
read, so the API never calls a silent node online; the background sweep only records the
transitions as events.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.db import rowcount
from control_plane.errors import NotFound
from control_plane.fleet.liveness import Liveness, counted_from, liveness_state
from control_plane.fleet.schemas import DuplicateIdentity, NeedsUpgrade, NodePublic
from control_plane.models import Node, NodeCredential, NodeEvent


def fingerprint_hash(fingerprint: dict[str, Any] | None) -> str | None:
    if not fingerprint:
        return None
    machine_id = (fingerprint.get("machine_id") or "").strip()
    gpu_uuids = sorted({u.strip() for u in fingerprint.get("gpu_uuids") or [] if u.strip()})
    if not machine_id and not gpu_uuids:
        return None
    canonical = json.dumps({"machine_id": machine_id, "gpu_uuids": gpu_uuids}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def record_event(
    session: Session,
    *,
    node_id: str,
    at: datetime,
    kind: str,
    reason: str,
    from_state: str | None = None,
    to_state: str | None = None,
) -> None:
    session.add(
        NodeEvent(
            node_id=node_id,
            at=at,
            kind=kind,
            reason=reason,
            from_state=from_state,
            to_state=to_state,
        )
    )


def get_node(*, session: Session, node_id: str) -> Node:
    node = session.get(Node, node_id)
    if node is None:
        raise NotFound(
            "No node with this id.",
            "List nodes with GET /api/v1/admin/nodes; a node exists once its token was claimed.",
            code="NODE_NOT_FOUND",
        )
    return node


def list_nodes(*, session: Session) -> list[Node]:
    return list(session.scalars(select(Node).order_by(Node.created_at)))


def duplicates_of(session: Session, nodes: list[Node]) -> dict[str, list[str]]:
    hashes = {n.fingerprint_hash for n in nodes if n.fingerprint_hash}
    if not hashes:
        return {}
    shared = set(
        session.scalars(
            select(Node.fingerprint_hash)
            .where(Node.fingerprint_hash.in_(hashes))
            .group_by(Node.fingerprint_hash)
            .having(func.count() > 1)
        )
    )
    if not shared:
        return {}
    by_hash: dict[str, list[str]] = {}
    for node_id, fp in session.execute(
        select(Node.id, Node.fingerprint_hash).where(Node.fingerprint_hash.in_(shared))
    ):
        if fp is not None:
            by_hash.setdefault(fp, []).append(node_id)
    return {
        n.id: sorted(i for i in by_hash[n.fingerprint_hash] if i != n.id)
        for n in nodes
        if n.fingerprint_hash in by_hash
    }


def node_public(
    node: Node,
    *,
    now: datetime,
    liveness: Liveness,
    duplicates: list[str],
) -> NodePublic:
    """The API view of a node, merging a heartbeat accepted but not yet flushed."""
    last = liveness.last_seen(node.id, node.last_heartbeat_at)
    reported = liveness.reported(node)
    return NodePublic(
        node_id=node.id,
        enrollment_id=node.enrollment_id,
        display_name=node.display_name,
        hostname=node.hostname,
        labels=node.labels,
        state=liveness_state(last, now, liveness.thresholds),
        created_at=node.created_at,
        last_heartbeat_at=last,
        agent_version=reported["agent_version"],
        protocol_version=reported["protocol_version"],
        health=reported["health"],
        needs_upgrade=(
            NeedsUpgrade(
                code=node.compat_code,
                component=node.compat_component or "agent",
                detail=node.compat_detail or "",
            )
            if node.compat_code
            else None
        ),
        duplicate_identity=(
            DuplicateIdentity(
                other_node_ids=duplicates,
                message="Another node was enrolled with the same machine fingerprint (GPU UUIDs "
                "and machine id): this host probably lost its agent state volume and enrolled "
                "again.",
                next_step="Mount MODELFORGE_AGENT_STATE_VOLUME on durable storage, keep the node "
                "that is online and delete the other (DELETE /api/v1/admin/nodes/{node_id}).",
            )
            if duplicates
            else None
        ),
        inventory=node.inventory,
        inventory_at=node.inventory_at,
        telemetry=node.telemetry,
        telemetry_at=node.telemetry_at,
    )


def node_views(
    *, session: Session, nodes: list[Node], now: datetime, liveness: Liveness
) -> list[NodePublic]:
    """The API views of `nodes`, in order: each with the nodes sharing its fingerprint and its
    active credential's expiry, read for all of them at once."""
    duplicates = duplicates_of(session, nodes)
    expiries = credential_expiries(session, [node.id for node in nodes])
    views = []
    for node in nodes:
        view = node_public(node, now=now, liveness=liveness, duplicates=duplicates.get(node.id, []))
        view.credential_expires_at = expiries.get(node.id)
        views.append(view)
    return views


def list_events(*, session: Session, node_id: str, limit: int) -> list[NodeEvent]:
    get_node(session=session, node_id=node_id)
    return list(
        session.scalars(
            select(NodeEvent)
            .where(NodeEvent.node_id == node_id)
            .order_by(NodeEvent.id.desc())
            .limit(limit)
        )
    )


def sweep_liveness(*, session: Session, clock: Clock, liveness: Liveness) -> int:
    """Record each liveness change as an event. Safe to run in several processes.

    Transitions to `online` are recorded by the heartbeat flush; this records the decay, judged
    by the liveness reader (a heartbeat accepted here but not yet flushed keeps a node online).
    """
    now = clock.now()
    thresholds = liveness.thresholds
    stale_before = now - thresholds.stale_after
    offline_before = now - thresholds.offline_after
    candidates = session.execute(
        select(Node.id, Node.recorded_state, Node.last_heartbeat_at).where(
            Node.last_heartbeat_at.is_not(None),
            ((Node.recorded_state == "online") & (Node.last_heartbeat_at <= stale_before))
            | ((Node.recorded_state == "stale") & (Node.last_heartbeat_at <= offline_before)),
        )
    ).all()
    changed = 0
    for node_id, recorded, last in candidates:
        to_state = liveness_state(liveness.last_seen(node_id, last), now, thresholds)
        if last is None or to_state == recorded:
            continue
        # Conditional: with several replicas sweeping, exactly one records the event.
        result = session.execute(
            update(Node)
            .where(
                Node.id == node_id,
                Node.recorded_state == recorded,
                Node.last_heartbeat_at == last,
            )
            .values(recorded_state=to_state)
        )
        if rowcount(result) != 1:
            continue
        limit = thresholds.offline_after if to_state == "offline" else thresholds.stale_after
        counted = counted_from(last, now, thresholds.grace, timeout=limit)
        silence = (now - counted).total_seconds()
        since = " since the control plane was back" if counted > last else ""
        record_event(
            session,
            node_id=node_id,
            at=now,
            kind="state_changed",
            from_state=recorded,
            to_state=to_state,
            reason=f"no heartbeat for {silence:.0f} s{since} ({to_state} after "
            f"{limit.total_seconds():g} s)",
        )
        changed += 1
    return changed


def delete_node(*, session: Session, node_id: str) -> Node:
    node = get_node(session=session, node_id=node_id)
    session.delete(node)
    return node


def credential_expiries(session: Session, node_ids: list[str]) -> dict[str, datetime | None]:
    """Each listed node's active credential's expiry (CR-3), in one query."""
    if not node_ids:
        return {}
    rows = session.execute(
        select(NodeCredential.node_id, NodeCredential.expires_at).where(
            NodeCredential.node_id.in_(node_ids), NodeCredential.revoked_at.is_(None)
        )
    )
    return {node_id: expires_at for node_id, expires_at in rows}


def list_credentials(
    *, session: Session, node_id: str | None, active: bool | None, limit: int
) -> list[NodeCredential]:
    query = select(NodeCredential).order_by(NodeCredential.issued_at.desc()).limit(limit)
    if node_id:
        query = query.where(NodeCredential.node_id == node_id)
    if active is not None:
        query = query.where(
            NodeCredential.revoked_at.is_(None)
            if active
            else NodeCredential.revoked_at.is_not(None)
        )
    return list(session.scalars(query))
