"""Heartbeat ingestion for fleets (HB-4).

`accept_heartbeat` is the one place a heartbeat is judged and recorded: both the FastAPI route
and the ASGI fast path in front of it call it. An accepted heartbeat is put in memory and
answered at once; `flush()` writes all pending heartbeats in one batched UPDATE at least every
second (and once more at shutdown), and records the transition to `online` for nodes whose
recorded state was something else. Readers merge the pending entries, so a 2xx heartbeat counts
for liveness immediately in this process.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, bindparam, case, select, update
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock
from control_plane.db import rowcount
from control_plane.models import Node
from control_plane.schemas import Compatibility, HeartbeatRequest, HeartbeatResponse
from control_plane.services.compatibility import judge_protocol
from control_plane.services.nodes import record_event
from control_plane.settings import Settings
from modelforge_contracts.protocol import accepted

log = logging.getLogger(__name__)
_CHUNK = 500


@dataclass(frozen=True)
class PendingHeartbeat:
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


def accept_heartbeat(
    request: HeartbeatRequest,
    *,
    node_id: str,
    buffer: HeartbeatBuffer,
    clock: Clock,
    settings: Settings,
) -> HeartbeatResponse:
    """Judge the agent's protocol and record the heartbeat in memory (no database round trip).

    Raises `ProtocolIncompatible` for a protocol outside the accepted range; the caller records
    the refusal (that needs the database).
    """
    protocol = judge_protocol(request.protocol_version, component="agent")
    buffer.record(
        node_id,
        PendingHeartbeat(
            at=clock.now(),
            agent_version=request.agent_version,
            protocol_version=protocol,
            health=request.health.model_dump(exclude_none=True),
        ),
    )
    return HeartbeatResponse(
        heartbeat_interval_seconds=settings.heartbeat_interval_seconds,
        telemetry_interval_seconds=settings.telemetry_interval_seconds,
        inventory_interval_seconds=settings.inventory_max_age_seconds / 4,
        compatibility=Compatibility(
            status="compatible", protocol_version=protocol, accepted=accepted()
        ),
    )


class HeartbeatBuffer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, PendingHeartbeat] = {}
        #: The batch being written: still visible to readers until its transaction commits, so
        #: a read during a flush never sees a node as less alive than it is.
        self._flushing: dict[str, PendingHeartbeat] = {}
        # Serialises flushes so a shutdown flush never races the loop's last one.
        self._flush_lock = threading.Lock()

    def record(self, node_id: str, heartbeat: PendingHeartbeat) -> None:
        with self._lock:
            self._pending[node_id] = heartbeat

    def peek(self, node_id: str) -> PendingHeartbeat | None:
        with self._lock:
            return self._pending.get(node_id) or self._flushing.get(node_id)

    def discard(self, node_id: str) -> None:
        with self._lock:
            self._pending.pop(node_id, None)
            self._flushing.pop(node_id, None)

    def __len__(self) -> int:
        return len(self._pending)

    def flush(self, *, session_factory: sessionmaker[Session]) -> int:
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, {}
                self._flushing = batch
            if not batch:
                return 0
            try:
                with session_factory.begin() as session:
                    _write(session, batch)
            except Exception:
                # Put the batch back (newer heartbeats win) so nothing answered 2xx is lost.
                with self._lock:
                    self._pending = batch | self._pending
                    self._flushing = {}
                raise
            with self._lock:
                self._flushing = {}
            return len(batch)


def _write(session: Session, batch: dict[str, PendingHeartbeat]) -> None:
    table = Node.__table__
    assert isinstance(table, Table)  # noqa: S101 - narrows the type for mypy
    # A compatible heartbeat newer than the last refusal ends "Needs upgrade".
    cleared = (table.c.compat_component == "agent") & (table.c.compat_at < bindparam("b_at"))
    statement = (
        update(table)
        .where(table.c.id == bindparam("b_id"))
        .values(
            last_heartbeat_at=bindparam("b_at"),
            agent_version=bindparam("b_agent_version"),
            protocol_version=bindparam("b_protocol_version"),
            health=bindparam("b_health"),
            compat_code=case((cleared, None), else_=table.c.compat_code),
            compat_component=case((cleared, None), else_=table.c.compat_component),
            compat_detail=case((cleared, None), else_=table.c.compat_detail),
        )
    )
    rows = [
        {
            "b_id": node_id,
            "b_at": hb.at,
            "b_agent_version": hb.agent_version,
            "b_protocol_version": hb.protocol_version,
            "b_health": hb.health,
        }
        for node_id, hb in batch.items()
    ]
    session.connection().execute(statement, rows)
    node_ids = list(batch)
    for start in range(0, len(node_ids), _CHUNK):
        chunk = node_ids[start : start + _CHUNK]
        waking = session.execute(
            select(Node.id, Node.recorded_state).where(
                Node.id.in_(chunk), Node.recorded_state != "online"
            )
        ).all()
        for node_id, recorded in waking:
            result = session.execute(
                update(Node)
                .where(Node.id == node_id, Node.recorded_state == recorded)
                .values(recorded_state="online")
            )
            if rowcount(result) == 1:
                record_event(
                    session,
                    node_id=node_id,
                    at=batch[node_id].at,
                    kind="state_changed",
                    from_state=recorded,
                    to_state="online",
                    reason="heartbeat received",
                )
