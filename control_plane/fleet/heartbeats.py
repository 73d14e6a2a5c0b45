"""Heartbeat ingestion for fleets (HB-4).

`accept_heartbeat` is the one place a heartbeat is judged and recorded: both the FastAPI route
and the ASGI fast path in front of it call it. An accepted heartbeat is put in memory and
answered at once; `flush()` writes all pending heartbeats at least every second (and once more
at shutdown), one UPDATE per 500 nodes whose rows travel as one JSON document, and records the
transition to `online` for nodes whose recorded state was something else. Readers merge the
pending entries, so a 2xx heartbeat counts for liveness immediately in this process.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    DateTime,
    Dialect,
    FromClause,
    Integer,
    Row,
    Select,
    Table,
    Text,
    Update,
    bindparam,
    case,
    cast,
    column,
    func,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock
from control_plane.fleet.compatibility import judge_protocol
from control_plane.fleet.liveness import PendingHeartbeat
from control_plane.fleet.nodes import record_event
from control_plane.fleet.schemas import Compatibility, HeartbeatRequest, HeartbeatResponse
from control_plane.metrics import Metrics
from control_plane.models import Node
from control_plane.settings import Settings
from modelforge_contracts.protocol import accepted

log = logging.getLogger(__name__)
_CHUNK = 500


@dataclass(frozen=True)
class JudgedHeartbeat:
    """What a heartbeat's body decides, whichever node sent it and whenever: what is recorded,
    and the answer. The agents' fast path keeps these by body, since a node sends the same
    bytes every time until its health changes; so `health` is shared by every node that sent
    those bytes, and nothing may change it in place."""

    agent_version: str
    protocol_version: int
    health: dict[str, Any]
    response: HeartbeatResponse


def judge_heartbeat(request: HeartbeatRequest, *, settings: Settings) -> JudgedHeartbeat:
    """Judge the agent's protocol and build the answer (no state, no database).

    Raises `ProtocolIncompatible` for a protocol outside the accepted range; the caller records
    the refusal (that needs the database).
    """
    protocol = judge_protocol(request.protocol_version, component="agent")
    return JudgedHeartbeat(
        agent_version=request.agent_version,
        protocol_version=protocol,
        health=request.health.model_dump(exclude_none=True),
        response=HeartbeatResponse(
            heartbeat_interval_seconds=settings.heartbeat_interval_seconds,
            telemetry_interval_seconds=settings.telemetry_interval_seconds,
            inventory_interval_seconds=settings.inventory_max_age_seconds / 4,
            compatibility=Compatibility(
                status="compatible", protocol_version=protocol, accepted=accepted()
            ),
        ),
    )


def record_heartbeat(
    judged: JudgedHeartbeat,
    *,
    node_id: str,
    buffer: HeartbeatBuffer,
    clock: Clock,
    metrics: Metrics,
) -> None:
    """Record an accepted heartbeat of `node_id` in memory (no database round trip)."""
    buffer.record(
        node_id,
        PendingHeartbeat(
            at=clock.now(),
            agent_version=judged.agent_version,
            protocol_version=judged.protocol_version,
            health=judged.health,
        ),
    )
    metrics.heartbeats_accepted.inc()


def accept_heartbeat(
    request: HeartbeatRequest,
    *,
    node_id: str,
    buffer: HeartbeatBuffer,
    clock: Clock,
    settings: Settings,
    metrics: Metrics,
) -> HeartbeatResponse:
    """Judge the heartbeat and record it in memory: `judge_heartbeat`, then `record_heartbeat`.

    Raises `ProtocolIncompatible` for a protocol outside the accepted range; the caller records
    the refusal (that needs the database).
    """
    judged = judge_heartbeat(request, settings=settings)
    record_heartbeat(judged, node_id=node_id, buffer=buffer, clock=clock, metrics=metrics)
    return judged.response


class HeartbeatBuffer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, PendingHeartbeat] = {}
        #: The batch being written: still visible to readers until its transaction commits, so
        #: a read during a flush never sees a node as less alive than it is.
        self._flushing: dict[str, PendingHeartbeat] = {}
        #: Each node's heartbeat this process wrote last, kept after the commit: a reader that
        #: loaded the node's row before that commit and asks the buffer after it would otherwise
        #: find the heartbeat in neither (a node just enrolled looked never heard from, and its
        #: readiness failed, for one read). One entry per node; readers take the newer of this
        #: and the row, so it never hides a heartbeat another process wrote later.
        self._written: dict[str, PendingHeartbeat] = {}
        # Serialises flushes so a shutdown flush never races the loop's last one.
        self._flush_lock = threading.Lock()

    def record(self, node_id: str, heartbeat: PendingHeartbeat) -> None:
        with self._lock:
            self._pending[node_id] = heartbeat

    def peek(self, node_id: str) -> PendingHeartbeat | None:
        with self._lock:
            return (
                self._pending.get(node_id)
                or self._flushing.get(node_id)
                or self._written.get(node_id)
            )

    def discard(self, node_id: str) -> None:
        with self._lock:
            self._pending.pop(node_id, None)
            self._flushing.pop(node_id, None)
            self._written.pop(node_id, None)

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
                self._written.update(batch)
                self._flushing = {}
            return len(batch)


def _write(session: Session, batch: dict[str, PendingHeartbeat]) -> None:
    dialect = session.get_bind().dialect
    time_text = _time_text(dialect)
    # Sorted: every replica's flush locks the rows it shares with another in the same order.
    node_ids = sorted(batch)
    for start in range(0, len(node_ids), _CHUNK):
        rows = []
        for node_id in node_ids[start : start + _CHUNK]:
            heartbeat = batch[node_id]
            rows.append(
                {
                    "id": node_id,
                    "at": time_text(heartbeat.at),
                    "agent_version": heartbeat.agent_version,
                    "protocol_version": heartbeat.protocol_version,
                    "health": heartbeat.health,
                }
            )
        # The chunk travels as one JSON document, to one UPDATE and one SELECT: executemany
        # (and an IN list of 500 parameters) cost ~95 ms of Python CPU per 2,000 rows, holding
        # the GIL against the event loop (docs/performance.md).
        document = {"rows": json.dumps(rows)}
        session.execute(_heartbeats_update(dialect.name), document)
        waking = session.execute(_waking(dialect.name), document).all()
        if waking:
            _record_wake_ups(session, waking, batch)


def _record_wake_ups(
    session: Session, waking: Sequence[Row[str, str]], batch: dict[str, PendingHeartbeat]
) -> None:
    """Record the transition to `online` of the `waking` nodes (id, recorded state).

    Each node's transition is a compare-and-set on the state read before, so a transition a
    concurrent sweep recorded meanwhile is never overwritten unseen; one UPDATE per previous
    state, not one per node (after an outage every node wakes at once).
    """
    table = _nodes()
    by_state: dict[str, list[str]] = {}
    for node_id, recorded in waking:
        by_state.setdefault(recorded, []).append(node_id)
    woken: set[str] = set()
    for recorded, node_ids in by_state.items():
        woken.update(
            session.scalars(
                update(table)
                .where(table.c.id.in_(node_ids), table.c.recorded_state == recorded)
                .values(recorded_state="online")
                .returning(table.c.id)
            )
        )
    for node_id, recorded in waking:
        if node_id in woken:
            record_event(
                session,
                node_id=node_id,
                at=batch[node_id].at,
                kind="state_changed",
                from_state=recorded,
                to_state="online",
                reason="heartbeat received",
            )


@functools.cache
def _heartbeats_update(dialect_name: str) -> Update:
    table = _nodes()
    rows = _heartbeat_rows(dialect_name)
    # A compatible heartbeat newer than the last refusal ends "Needs upgrade".
    cleared = (table.c.compat_component == "agent") & (table.c.compat_at < rows.c.at)
    return (
        update(table)
        .where(table.c.id == rows.c.id)
        .values(
            last_heartbeat_at=rows.c.at,
            agent_version=rows.c.agent_version,
            protocol_version=rows.c.protocol_version,
            health=rows.c.health,
            compat_code=case((cleared, None), else_=table.c.compat_code),
            compat_component=case((cleared, None), else_=table.c.compat_component),
            compat_detail=case((cleared, None), else_=table.c.compat_detail),
        )
    )


@functools.cache
def _waking(dialect_name: str) -> Select[str, str]:
    """The nodes of the chunk whose recorded state is not `online`, with that state."""
    table = _nodes()
    rows = _heartbeat_rows(dialect_name)
    return (
        select(table.c.id, table.c.recorded_state)
        .join_from(table, rows, table.c.id == rows.c.id)
        .where(table.c.recorded_state != "online")
    )


#: The fields of a pending heartbeat as they travel, one JSON object per node, in `:rows`.
_ROW_FIELDS = ("id", "at", "agent_version", "protocol_version", "health")


@functools.cache
def _heartbeat_rows(dialect_name: str) -> FromClause:
    """The JSON document `:rows` as a table `r` of `_ROW_FIELDS`: `json_to_recordset` on
    PostgreSQL, `json_each` on SQLite (UPDATE … FROM needs SQLite 3.33)."""
    document = bindparam("rows", type_=Text)
    if dialect_name == "postgresql":
        return (
            func.json_to_recordset(cast(document, postgresql.JSON))
            .table_valued(
                column("id", Text),
                column("at", DateTime(timezone=True)),
                column("agent_version", Text),
                column("protocol_version", Integer),
                column("health", postgresql.JSON),
            )
            .render_derived(name="r", with_types=True)
        )
    each = func.json_each(document).table_valued("value")
    return select(
        *(func.json_extract(each.c.value, f"$.{name}").label(name) for name in _ROW_FIELDS)
    ).subquery("r")


def _time_text(dialect: Dialect) -> Callable[[datetime], str]:
    """How a heartbeat's time travels in the JSON rows: through the column's own type (which
    refuses a naive time), so on SQLite it is exactly the text the column stores and `compat_at <
    at` compares like with like; on PostgreSQL ISO 8601 with its offset, read as timestamptz."""
    process = _nodes().c.last_heartbeat_at.type.dialect_impl(dialect).bind_processor(dialect)

    def text(at: datetime) -> str:
        value = process(at) if process is not None else at
        return value if isinstance(value, str) else value.isoformat()

    return text


def _nodes() -> Table:
    table = Node.__table__
    assert isinstance(table, Table)  # noqa: S101 - narrows the type for mypy
    return table
