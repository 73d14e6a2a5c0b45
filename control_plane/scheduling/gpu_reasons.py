"""How a waiting reason names the GPUs out of the schedule that keep a job waiting (issue 28):
`node gpu-a: GPU 1 quarantined: <the operator's reason>`.

The reasons are read from the GPUs' rows (`GpuHealth`) only when a waiting reason is explained,
for the nodes it names: never on a batch's path, which knows the states alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.fleet.gpu_health import OUT_OF_SCHEDULE
from control_plane.models import GpuHealth

#: node ids -> per node, per GPU UUID out of the schedule, how a reason names it.
GpuNotes = Callable[[list[str]], dict[str, dict[str, str]]]

#: At most this many nodes, and GPUs per node, are named in one reason.
_NAMED = 3
#: A GPU's reason is cut to this many characters in a waiting reason.
_WHY_MAX = 160


@dataclass(frozen=True)
class OutOfSchedule:
    """A node's GPUs out of the schedule, as the fleet view saw them."""

    node_id: str
    name: str
    #: (index, UUID, state), by index.
    gpus: tuple[tuple[int, str, str], ...]


def read_gpu_notes(session: Session, node_ids: list[str]) -> dict[str, dict[str, str]]:
    """Per node of `node_ids`, its GPUs out of the schedule named with their reason: the
    operator's for a quarantine, the rules' (the agent's evidence) for an unhealthy GPU."""
    rows = session.execute(
        select(
            GpuHealth.node_id,
            GpuHealth.uuid,
            GpuHealth.index,
            GpuHealth.state,
            GpuHealth.reason,
            GpuHealth.quarantine_reason,
        ).where(GpuHealth.node_id.in_(node_ids), GpuHealth.state.in_(OUT_OF_SCHEDULE))
    )
    notes: dict[str, dict[str, str]] = {}
    for node_id, uuid, index, state, reason, quarantine_reason in rows:
        why = quarantine_reason if state == "quarantined" else reason
        notes.setdefault(node_id, {})[uuid] = gpu_text(index, state, why)
    return notes


def gpu_text(index: int, state: str, why: str | None = None) -> str:
    text = f"GPU {index} {state}"
    if not why:
        return text
    why = " ".join(why.split())
    return f"{text}: {why if len(why) <= _WHY_MAX else why[: _WHY_MAX - 1] + '…'}"


def name_out_of_schedule(nodes: list[OutOfSchedule], notes: GpuNotes | None) -> str:
    """`node gpu-a: GPU 1 quarantined: <reason>; node gpu-b: GPU 0 unhealthy: <reason>`, the
    first few nodes; with no `notes` reader (a caller without a session), the states only."""
    named = nodes[:_NAMED]
    read = notes([node.node_id for node in named]) if notes is not None else {}
    parts = []
    for node in named:
        known = read.get(node.node_id, {})
        gpus = [
            known.get(uuid) or gpu_text(index, state) for index, uuid, state in node.gpus[:_NAMED]
        ]
        if len(node.gpus) > _NAMED:
            gpus.append(f"{len(node.gpus) - _NAMED} more")
        parts.append(f"node {node.name}: {'; '.join(gpus)}")
    if len(nodes) > _NAMED:
        parts.append(f"and {len(nodes) - _NAMED} more nodes")
    return "; ".join(parts)
