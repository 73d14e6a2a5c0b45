"""The one liveness reader: a node's last heartbeat is the newer of the stored one and one this
process accepted but has not flushed yet, and its state (`online`, `stale`, `offline`) follows
from the silence since then. Node views, scheduling and the liveness sweep all read it here, so
they never disagree about a node.

A silence the control plane caused is not the node's: `ContactGrace` knows when the nodes could
not reach this process (before its start, during a database outage), and every deadline counted
from a node's last contact — liveness here, a running job's contact
(`jobs.reports.sweep_jobs`), a service's placement (`services.placement`) — that had not yet
expired when such a downtime began counts from its end instead, so each node gets one full
timeout to reach a control plane that comes back. A deadline that had already expired is not
extended: a node that died before the control plane stopped is offline right after it starts
again.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.db import dialect_insert
from control_plane.models import ControlPlanePresence, Node
from control_plane.schemas import NodeState

#: The one row of `control_plane_presence`.
_PRESENCE_ROW = 1
#: Downtimes kept in memory: more than any deadline can span in practice (an older one only
#: matters to a node silent through all of those since).
_KEPT_DOWNTIMES = 16


@dataclass(frozen=True)
class PendingHeartbeat:
    """A heartbeat this process accepted and has not flushed yet (`heartbeats.HeartbeatBuffer`)."""

    at: datetime
    agent_version: str
    protocol_version: int
    health: dict[str, Any]

    def as_view(self) -> dict[str, Any]:
        return {
            "agent_version": self.agent_version,
            "protocol_version": self.protocol_version,
            "health": self.health,
        }


class UnflushedHeartbeats(Protocol):
    """What the liveness reader needs of `heartbeats.HeartbeatBuffer`: the reader sits below
    the heartbeat writer (which records transitions through `nodes`, a reader of liveness), so
    it knows the buffer only by this."""

    def peek(self, node_id: str) -> PendingHeartbeat | None:
        """The node's newest heartbeat this process holds: not yet written, being written, or
        the one it wrote last (a row read before that write does not have it)."""
        ...


class _Availability(Protocol):
    """What `ContactGrace` uses of `db.DatabaseAvailability`."""

    @property
    def available(self) -> bool: ...

    def on_outage(self, listener: Callable[[], None]) -> None: ...


def last_alive(*, session: Session) -> datetime | None:
    """The latest moment the control plane (any replica) is known to have been alive: its
    presence mark, or a node's heartbeat it wrote later. None when neither exists (a new
    database)."""
    marked = session.scalar(
        select(ControlPlanePresence.alive_at).where(ControlPlanePresence.id == _PRESENCE_ROW)
    )
    heard = session.scalar(select(func.max(Node.last_heartbeat_at)))
    known = [moment for moment in (marked, heard) if moment is not None]
    return max(known) if known else None


def mark_alive(*, session: Session, at: datetime) -> None:
    """Record that the control plane is alive at `at`: one upsert, which never moves the mark
    back (another replica may be ahead) and never conflicts with a replica marking at once."""
    statement = dialect_insert(session, ControlPlanePresence).values(id=_PRESENCE_ROW, alive_at=at)
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[ControlPlanePresence.id],
            set_={"alive_at": statement.excluded.alive_at},
            where=ControlPlanePresence.alive_at < statement.excluded.alive_at,
        )
    )


@dataclass
class Downtime:
    """A stretch in which the nodes could not reach this control plane."""

    #: When it began; None when unknown (nothing recorded the control plane alive before).
    began: datetime | None
    #: When it ended; None while it lasts (a database outage).
    ended: datetime | None


class ContactGrace:
    """When the nodes could not reach this control plane, and so which deadlines it extends.

    Two kinds of downtime:

    - before this process started (`started`): it began at the control plane's last moment
      known alive, which a background loop marks every few seconds in the database
      (`mark_alive`; a node's heartbeat written later counts too), and it ended when this
      process started serving (`serving`);
    - a database outage: it began when `DatabaseAvailability` saw it begin, and it ends at the
      first read after the database counts as available again.

    A deadline (a node's last contact plus a timeout) that had not expired when a downtime
    began counts from the downtime's end instead (`counted_from`); one that had already expired
    stays where it was. While a database outage lasts, no unexpired deadline expires.
    """

    def __init__(self, *, clock: Clock, database: _Availability) -> None:
        self._clock = clock
        self._database = database
        self._lock = threading.Lock()
        self._downtimes: deque[Downtime] = deque(maxlen=_KEPT_DOWNTIMES)
        self._start: Downtime | None = None
        database.on_outage(self._outage_began)

    def started(self, *, session: Session) -> None:
        """This process starts: the control plane was down since it was last known alive.
        Marks it alive now, in `session`'s transaction."""
        began = last_alive(session=session)
        now = self._clock.now()
        mark_alive(session=session, at=now)
        with self._lock:
            self._start = Downtime(began=None if began is None else min(began, now), ended=now)
            self._downtimes.append(self._start)

    def serving(self) -> None:
        """The control plane serves from now: its downtime before the start ends here."""
        with self._lock:
            if self._start is not None:
                self._start.ended = self._clock.now()

    def _outage_began(self) -> None:
        now = self._clock.now()
        with self._lock:
            if self._downtimes and self._downtimes[-1].ended is None:
                return  # the outage already recorded goes on
            self._downtimes.append(Downtime(began=now, ended=None))

    def counted_from(self, last_contact: datetime, now: datetime, timeout: timedelta) -> datetime:
        """The moment a deadline of `timeout` after `last_contact` counts from: `last_contact`,
        or the end of each downtime that began before that deadline, taken in turn."""
        deadline = last_contact + timeout
        with self._lock:
            latest = self._downtimes[-1] if self._downtimes else None
            if latest is not None and latest.ended is None and self._database.available:
                latest.ended = now  # the first read since the outage ended
            for downtime in self._downtimes:
                if downtime.began is None or deadline > downtime.began:
                    ended = now if downtime.ended is None else downtime.ended
                    deadline = max(deadline, ended + timeout)
        return deadline - timeout


@dataclass(frozen=True)
class LivenessThresholds:
    stale_after: timedelta
    offline_after: timedelta
    #: The control plane's own downtime, which does not count against a node that was live.
    grace: ContactGrace | None = None


def counted_from(
    last_contact: datetime, now: datetime, grace: ContactGrace | None, *, timeout: timedelta
) -> datetime:
    """The moment a node's silence is counted from for a deadline of `timeout`: its last
    contact, or the end of the control plane's own downtime when that began before the
    deadline expired (`ContactGrace.counted_from`)."""
    return last_contact if grace is None else grace.counted_from(last_contact, now, timeout)


def liveness_state(
    last_heartbeat_at: datetime | None, now: datetime, thresholds: LivenessThresholds
) -> NodeState:
    if last_heartbeat_at is None:
        return "offline"
    offline, stale = thresholds.offline_after, thresholds.stale_after
    if now - counted_from(last_heartbeat_at, now, thresholds.grace, timeout=offline) >= offline:
        return "offline"
    if now - counted_from(last_heartbeat_at, now, thresholds.grace, timeout=stale) >= stale:
        return "stale"
    return "online"


@dataclass(frozen=True)
class Liveness:
    buffer: UnflushedHeartbeats
    thresholds: LivenessThresholds

    def last_seen(self, node_id: str, stored: datetime | None) -> datetime | None:
        """The node's last heartbeat: the newer of the stored one and the buffer's."""
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
