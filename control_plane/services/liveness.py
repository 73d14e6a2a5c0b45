"""The one liveness reader: a node's last heartbeat is the newer of the stored one and one this
process accepted but has not flushed yet, and its state (`online`, `stale`, `offline`) follows
from the silence since then. Node views, scheduling and the liveness sweep all read it here, so
they never disagree about a node.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from control_plane.models import Node
from control_plane.schemas import NodeState

if TYPE_CHECKING:  # heartbeats records state changes through nodes, which reads liveness
    from control_plane.services.heartbeats import HeartbeatBuffer


@dataclass(frozen=True)
class LivenessThresholds:
    stale_after: timedelta
    offline_after: timedelta


def liveness_state(
    last_heartbeat_at: datetime | None, now: datetime, thresholds: LivenessThresholds
) -> NodeState:
    if last_heartbeat_at is None:
        return "offline"
    silence = now - last_heartbeat_at
    if silence >= thresholds.offline_after:
        return "offline"
    if silence >= thresholds.stale_after:
        return "stale"
    return "online"


@dataclass(frozen=True)
class Liveness:
    buffer: HeartbeatBuffer
    thresholds: LivenessThresholds

    def last_seen(self, node_id: str, stored: datetime | None) -> datetime | None:
        """The node's last heartbeat, counting one accepted but not yet flushed."""
        pending = self.buffer.peek(node_id)
        if pending is not None and (stored is None or pending.at > stored):
            return pending.at
        return stored

    def state(self, node: Node, now: datetime) -> NodeState:
        return self.state_of(node.id, node.last_heartbeat_at, now)

    def state_of(self, node_id: str, stored: datetime | None, now: datetime) -> NodeState:
        """`state` from the node's id and stored heartbeat, for readers that select columns."""
        return liveness_state(self.last_seen(node_id, stored), now, self.thresholds)

    def reported(self, node: Node) -> dict[str, Any]:
        """What the node's latest heartbeat said: version, protocol and health."""
        pending = self.buffer.peek(node.id)
        if pending is not None and (
            node.last_heartbeat_at is None or pending.at > node.last_heartbeat_at
        ):
            return pending.as_view()
        return {
            "agent_version": node.agent_version,
            "protocol_version": node.protocol_version,
            "health": node.health,
        }
