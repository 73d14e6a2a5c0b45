"""Scheduling: which queued job a node may take now.

Only online, compatible nodes with an inventory get work. A job fits a node when the node
carries the job's labels (`require`), or — with `prefer` — when no online node carrying them has
room; and when its resource requests fit the node's inventory minus what its running jobs hold.
The claim itself is a conditional UPDATE, so two replicas never hand out one job twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.db import rowcount
from control_plane.models import Job, Node
from control_plane.services.jobs import append_events
from control_plane.services.liveness import Liveness

_CANDIDATES = 200


@dataclass(frozen=True)
class Capacity:
    cpus: float
    gpus: int
    memory_mb: int

    def fits(self, request: dict[str, Any]) -> bool:
        return (
            float(request.get("cpus", 0)) <= self.cpus + 1e-9
            and int(request.get("gpus", 0)) <= self.gpus
            and int(request.get("memory_mb", 0)) <= self.memory_mb
        )

    def minus(self, request: dict[str, Any]) -> Capacity:
        return Capacity(
            self.cpus - float(request.get("cpus", 0)),
            self.gpus - int(request.get("gpus", 0)),
            self.memory_mb - int(request.get("memory_mb", 0)),
        )


def labels_match(wanted: dict[str, str], carried: dict[str, str]) -> bool:
    return all(carried.get(key) == value for key, value in wanted.items())


def _free_capacity(session: Session, node: Node) -> Capacity | None:
    inventory = node.inventory
    if not inventory:
        return None
    free = Capacity(
        float(inventory.get("cpu_count", 0)),
        len(inventory.get("gpus") or []),
        int(inventory.get("memory_mb", 0)),
    )
    for (held,) in session.execute(
        select(Job.resources).where(Job.node_id == node.id, Job.state == "running")
    ):
        free = free.minus(held)
    return free


def _eligible(node: Node, now: datetime, liveness: Liveness) -> bool:
    return (
        liveness.state(node, now) == "online"
        and node.compat_code is None
        and node.inventory is not None
    )


def claim_next_job(
    *,
    session: Session,
    clock: Clock,
    node_id: str,
    liveness: Liveness,
) -> Job | None:
    now = clock.now()
    # Locks the node row on PostgreSQL: one claim per node at a time, so parallel slots of one
    # agent never over-commit its resources (SQLite serialises writers anyway).
    node = session.get(Node, node_id, with_for_update=True)
    if node is None or not _eligible(node, now, liveness):
        return None
    free = _free_capacity(session, node)
    if free is None:
        return None
    queued = session.scalars(
        select(Job).where(Job.state == "queued").order_by(Job.created_at).limit(_CANDIDATES)
    ).all()
    others: list[tuple[Node, Capacity]] | None = None
    for job in queued:
        if not free.fits(job.resources):
            continue
        if not labels_match(job.labels, node.labels):
            if job.worker_policy == "require":
                continue
            if others is None:
                others = [
                    (other, capacity)
                    for other in session.scalars(select(Node).where(Node.id != node_id))
                    if _eligible(other, now, liveness)
                    and (capacity := _free_capacity(session, other)) is not None
                ]
            if any(labels_match(job.labels, o.labels) and c.fits(job.resources) for o, c in others):
                continue  # `prefer`: a node carrying the labels has room; leave it to that one
        won = rowcount(
            session.execute(
                update(Job)
                .where(Job.id == job.id, Job.state == "queued")
                .values(state="running", node_id=node_id, started_at=now, last_contact_at=now)
            )
        )
        if won:
            append_events(
                session, job, [("state", {"state": "running", "node_id": node_id})], at=now
            )
            session.refresh(job)
            return job
    return None
