"""Scheduling: which queued job a node may take now.

Only online, compatible nodes with an inventory get work. A job fits a node when the node
carries the job's labels (`require`), or — with `prefer` — when no online node carrying them has
room; and when its resource requests fit the node's inventory minus what its running jobs hold.
GPUs are counted as a set: a job is handed specific GPUs of its node (index and UUID) that no
other running job there holds, and waits, queued, while fewer are free than it asks for.
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
    """What a node has left: cpus and memory by arithmetic, GPUs as the exact set of its
    inventory's GPUs no running job holds, in index order."""

    cpus: float
    gpus: tuple[dict[str, Any], ...]
    memory_mb: int

    def fits(self, request: dict[str, Any]) -> bool:
        return (
            float(request.get("cpus", 0)) <= self.cpus + 1e-9
            and int(request.get("gpus", 0)) <= len(self.gpus)
            and int(request.get("memory_mb", 0)) <= self.memory_mb
        )

    def pick_gpus(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """The GPUs a job with `request` is handed: the free ones with the lowest indexes."""
        return [dict(gpu) for gpu in self.gpus[: int(request.get("gpus", 0))]]

    def minus(self, request: dict[str, Any], held_gpus: list[Any] | None) -> Capacity:
        held = {gpu.get("uuid") for gpu in held_gpus or []}
        gpus = tuple(gpu for gpu in self.gpus if gpu["uuid"] not in held)
        if held_gpus is None:
            # A job running from before GPUs were assigned: it holds as many as it asked for,
            # which ones unknown; count them off the end so the total stays right.
            gpus = gpus[: max(0, len(gpus) - int(request.get("gpus", 0)))]
        return Capacity(
            self.cpus - float(request.get("cpus", 0)),
            gpus,
            self.memory_mb - int(request.get("memory_mb", 0)),
        )


def labels_match(wanted: dict[str, str], carried: dict[str, str]) -> bool:
    return all(carried.get(key) == value for key, value in wanted.items())


def _inventory_gpus(inventory: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    gpus = [
        {"index": int(gpu["index"]), "uuid": str(gpu["uuid"])}
        for gpu in inventory.get("gpus") or []
        if isinstance(gpu, dict) and "index" in gpu and gpu.get("uuid")
    ]
    return tuple(sorted(gpus, key=lambda gpu: gpu["index"]))


def _free_capacity(session: Session, node: Node) -> Capacity | None:
    inventory = node.inventory
    if not inventory:
        return None
    free = Capacity(
        float(inventory.get("cpu_count", 0)),
        _inventory_gpus(inventory),
        int(inventory.get("memory_mb", 0)),
    )
    for held, held_gpus in session.execute(
        select(Job.resources, Job.assigned_gpus).where(
            Job.node_id == node.id, Job.state == "running"
        )
    ):
        free = free.minus(held, held_gpus)
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
        gpus = free.pick_gpus(job.resources)
        won = rowcount(
            session.execute(
                update(Job)
                .where(Job.id == job.id, Job.state == "queued")
                .values(
                    state="running",
                    node_id=node_id,
                    started_at=now,
                    last_contact_at=now,
                    assigned_gpus=gpus,
                )
            )
        )
        if won:
            append_events(
                session,
                job,
                [("state", {"state": "running", "node_id": node_id, "assigned_gpus": gpus})],
                at=now,
            )
            session.refresh(job)
            return job
    return None
