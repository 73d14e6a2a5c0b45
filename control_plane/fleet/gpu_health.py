"""Per-GPU health (issue 28): what the agents report of each GPU, an operator's quarantine and
re-admission, and what the scheduler reads of it.

States: `healthy`, `degraded` (placed on last), `unhealthy` (out of the schedule until an
admin re-admits it and its active check passes) and `quarantined` (out by an operator's hand).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.models import GpuHealth

#: The states the scheduler never places on.
OUT_OF_SCHEDULE = frozenset({"unhealthy", "quarantined"})


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
