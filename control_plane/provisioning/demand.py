"""What work wants a node of which profile (the provisioner's demand, PV-1): the shapes of the
queued jobs and pending service replicas, whether a waiting reason is one a new node would
answer, and whether a profile's node would run work of a shape."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.models import Job, Service, ServiceReplica
from control_plane.provisioning.config import Profile
from control_plane.scheduling.shapes import Capacity, Shape, labels_match

#: Waiting reasons a new node of a fitting profile would answer.
_NEEDS_A_NODE = {"NO_NODES", "NO_MATCHING_NODE", "NODES_OFFLINE", "TOO_LARGE", "NO_ROOM"}
#: How many queued jobs' shapes one round looks at.
_SHAPES_FROM = 2000


def needs_a_node(reason_code: str) -> bool:
    return reason_code in _NEEDS_A_NODE


def waiting_shapes(session: Session) -> set[Shape]:
    shapes = {
        Shape.of(labels, policy, resources, required, pinned)
        for labels, policy, resources, required, pinned in session.execute(
            select(Job.labels, Job.worker_policy, Job.resources, Job.required_labels, Job.pinned)
            .where(Job.state == "queued")
            .order_by(Job.created_at)
            .limit(_SHAPES_FROM)
        )
    }
    shapes.update(
        Shape.of(labels, policy, resources)
        for labels, policy, resources in session.execute(
            select(Service.labels, Service.worker_policy, Service.resources).where(
                Service.id.in_(
                    select(ServiceReplica.service_id).where(ServiceReplica.state == "pending")
                )
            )
        )
    )
    return shapes


def serves(profile: Profile, shape: Shape) -> bool:
    """A node of `profile` would run work of `shape`: its labels (unless `prefer`), its secrets'
    labels, and its resources. Never a job pinned to a GPU (`admits`: it runs on its node only)."""
    labels = dict(profile.labels)
    if not shape.prefer and not labels_match(shape.labels, labels):
        return False
    if not shape.admits(labels):
        return False
    gpus = tuple({"index": i, "uuid": f"profile-{i}"} for i in range(profile.gpus))
    return Capacity(float(profile.cpus), gpus, profile.ram_mb).fits(shape.request)
