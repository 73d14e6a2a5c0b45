"""The one liveness reader: a node's last heartbeat is the newer of the stored one and one this
process accepted but has not flushed yet, and its state (`online`, `stale`, `offline`) follows
from the silence since then. Node views, scheduling and the liveness sweep all read it here, so
they never disagree about a node.

A silence the control plane caused is not the node's: `ContactGrace` knows since when the nodes
have been able to reach this process (its start, and the end of its latest database outage), and
every deadline counted from a node's last contact — liveness here, a running job's contact
(`jobs.sweep_jobs`), a service's placement (`deployments`) — counts from that moment at the
earliest, so each node gets one full timeout to reach a control plane that comes back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from control_plane.clock import Clock
from control_plane.models import Node
from control_plane.schemas import NodeState

if TYPE_CHECKING:  # heartbeats records state changes through nodes, which reads liveness
    from control_plane.services.heartbeats import HeartbeatBuffer


class _Availability(Protocol):
    """What `ContactGrace` reads of `db.DatabaseAvailability`."""

    @property
    def available(self) -> bool: ...

    @property
    def outages(self) -> int: ...


class ContactGrace:
    """Since when the nodes have been able to reach this control plane: the moment it started
    serving, or the end of its latest database outage, whichever is later.

    While the database is out, `since` is now (no deadline expires); the first read after an
    outage ended moves it to that moment. `DatabaseAvailability` counts outages as they begin,
    so an outage that began and ended between two reads is not missed, and a sweep that reads
    while the outage's end is not yet settled waits for the next round.
    """

    def __init__(self, *, clock: Clock, database: _Availability) -> None:
        self._clock = clock
        self._database = database
        self._lock = threading.Lock()
        self._since = clock.now()
        self._outages_seen = database.outages

    def serving(self) -> None:
        """The control plane (re)starts serving now: the nodes' silence so far is its own."""
        with self._lock:
            self._since = self._clock.now()

    def since(self, now: datetime) -> datetime:
        outages = self._database.outages  # before `available`: an outage beginning now is seen
        if not self._database.available:
            return now
        with self._lock:
            if outages != self._outages_seen:
                self._outages_seen = outages
                self._since = max(self._since, now)
            return min(self._since, now)


@dataclass(frozen=True)
class LivenessThresholds:
    stale_after: timedelta
    offline_after: timedelta
    #: Silence before this moment (the control plane's own downtime) does not count.
    grace: ContactGrace | None = None


def counted_from(last_contact: datetime, now: datetime, grace: ContactGrace | None) -> datetime:
    """The moment a node's silence is counted from: its last contact, or the end of the control
    plane's own downtime when that came later."""
    return last_contact if grace is None else max(last_contact, grace.since(now))


def liveness_state(
    last_heartbeat_at: datetime | None, now: datetime, thresholds: LivenessThresholds
) -> NodeState:
    if last_heartbeat_at is None:
        return "offline"
    silence = now - counted_from(last_heartbeat_at, now, thresholds.grace)
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
