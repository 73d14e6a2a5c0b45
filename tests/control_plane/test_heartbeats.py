"""The heartbeat flush (HB-4) on a fleet-sized batch: every column of every node written, the
transitions to `online` recorded once each, "Needs upgrade" cleared only by a newer heartbeat,
a bounded number of statements, and a failed flush losing nothing. SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, insert, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from control_plane.fleet.heartbeats import HeartbeatBuffer, PendingHeartbeat
from control_plane.models import Node, NodeEnrollment, NodeEvent
from tests.factories import ControlPlane, control_plane

FLEET = 1_200  # more than two chunks of the flush
#: The recorded state each node starts from, by its index modulo 4.
STATES = ("online", "offline", "stale", "online")


def _node_id(index: int) -> str:
    return f"n_{index:05d}"


def _add_fleet(cp: ControlPlane, size: int) -> None:
    """`size` nodes straight into the database (enrolling 1,200 through the API takes minutes):
    a mix of recorded states and of compatibility refusals older and newer than `now`."""
    now = cp.clock.now()
    enrollments = [
        {
            "id": f"e_{index:05d}",
            "node_id": _node_id(index),
            "display_name": "gpu",
            "labels": {},
            "token_hash": f"{index:064d}",
            "state": "claimed",
            "production_eligible": False,
            "created_at": now,
            "expires_at": now,
        }
        for index in range(size)
    ]
    nodes = []
    for index in range(size):
        node: dict[str, Any] = {
            "id": _node_id(index),
            "enrollment_id": f"e_{index:05d}",
            "display_name": "gpu",
            "hostname": "gpu-host",
            "labels": {},
            "created_at": now,
            "recorded_state": STATES[index % 4],
            "last_heartbeat_at": now - timedelta(minutes=5),
            "agent_version": "0.0.1",
            "protocol_version": 1,
            "health": {"status": "unhealthy", "preflight": "failed"},
            "compat_code": None,
            "compat_component": None,
            "compat_detail": None,
            "compat_at": None,
        }
        if index % 3 == 1:  # refused before the heartbeat: cleared
            node |= _refusal("agent", now - timedelta(seconds=1))
        elif index % 3 == 2:  # refused after the heartbeat was taken: kept
            node |= _refusal("agent", now + timedelta(hours=1))
        elif index % 9 == 0:  # another component's refusal: a heartbeat does not end it
            node |= _refusal("runtime-worker", now - timedelta(seconds=1))
        nodes.append(node)
    with cp.ctx.session_factory.begin() as session:
        session.execute(insert(NodeEnrollment), enrollments)
        session.execute(insert(Node), nodes)


def _refusal(component: str, at: datetime) -> dict[str, Any]:
    return {
        "compat_code": "TOO_OLD",
        "compat_component": component,
        "compat_detail": f"{component} too old",
        "compat_at": at,
    }


def _heartbeat(at: datetime, index: int) -> PendingHeartbeat:
    return PendingHeartbeat(
        at=at + timedelta(microseconds=index),  # every node its own time
        agent_version=f"0.2.{index}",
        protocol_version=1,
        health={"status": "healthy", "preflight": "passed", "message": f"node {index} ✓"},
    )


@contextmanager
def _statements(engine: Engine) -> Iterator[list[str]]:
    """The statements `engine` runs in this thread meanwhile: the control plane's own tasks
    (the scheduler's first read of the queue, a tick after its start) run in others."""
    seen: list[str] = []
    here = threading.get_ident()

    def count(*args: Any) -> None:
        if threading.get_ident() == here:
            seen.append(args[2])

    event.listen(engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", count)


def test_a_fleet_sized_flush_writes_every_node(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        _add_fleet(cp, FLEET + 10)  # the last 10 get no heartbeat
        now = cp.clock.now()
        sent = {_node_id(i): _heartbeat(now, i) for i in range(FLEET)}
        for node_id, pending in sent.items():
            cp.ctx.heartbeats.record(node_id, pending)
        cp.ctx.heartbeats.record("n_gone", _heartbeat(now, 0))  # deleted meanwhile: no row

        with _statements(cp.ctx.engine) as statements:
            assert cp.flush() == FLEET + 1
        # Per chunk of 500: the UPDATE, the SELECT of waking nodes and one compare-and-set
        # UPDATE per previous state, not one per node. (The events are ORM inserts: batched on
        # PostgreSQL, one INSERT each on SQLite, which cannot return ids in order in one.)
        nodes_statements = [s for s in statements if not s.startswith("INSERT INTO node_events")]
        assert len(nodes_statements) <= 1 + 3 * 4, nodes_statements

        with cp.ctx.session_factory() as session:
            stored = {n.id: n for n in session.scalars(select(Node))}
            events = list(session.scalars(select(NodeEvent).order_by(NodeEvent.id)))
        assert "n_gone" not in stored
        for index in range(FLEET + 10):
            node = stored[_node_id(index)]
            heartbeat = sent.get(node.id)
            if heartbeat is None:
                assert node.last_heartbeat_at == now - timedelta(minutes=5)
                assert node.recorded_state == STATES[index % 4]
                continue
            assert node.last_heartbeat_at == heartbeat.at, node.id
            assert node.agent_version == heartbeat.agent_version
            assert node.protocol_version == 1
            assert node.health == heartbeat.health
            assert node.recorded_state == "online"
            refusal = (node.compat_code, node.compat_component, node.compat_detail)
            if index % 3 == 1:
                assert refusal == (None, None, None), node.id
            elif index % 3 == 2:
                assert refusal == ("TOO_OLD", "agent", "agent too old"), node.id
            elif index % 9 == 0:
                assert refusal == ("TOO_OLD", "runtime-worker", "runtime-worker too old")
            else:
                assert refusal == (None, None, None)
        woken = {_node_id(i): STATES[i % 4] for i in range(FLEET) if STATES[i % 4] != "online"}
        assert {e.node_id: e.from_state for e in events} == woken
        assert len(events) == len(woken)  # once each
        for e in events:
            assert (e.kind, e.to_state, e.reason) == (
                "state_changed",
                "online",
                "heartbeat received",
            )
            assert e.at == sent[e.node_id].at

        # The next flush of the same nodes records no transition again.
        later = cp.clock.now() + timedelta(seconds=10)
        for node_id in sent:
            cp.ctx.heartbeats.record(node_id, _heartbeat(later, 0))
        assert cp.flush() == FLEET
        with cp.ctx.session_factory() as session:
            assert len(list(session.scalars(select(NodeEvent)))) == len(woken)
            written = session.scalars(select(Node.last_heartbeat_at).where(Node.id.in_(sent)))
            assert set(written) == {later}


class _FailingOnce:
    """A session factory whose first transaction fails as a lost connection would, after a
    newer heartbeat for one node arrived mid-flush."""

    def __init__(self, real: sessionmaker[Session], during: Any) -> None:
        self.real = real
        self.during = during
        self.failed = False

    def begin(self) -> Any:
        if self.failed:
            return self.real.begin()
        self.failed = True
        self.during()
        raise OperationalError("UPDATE nodes", {}, Exception("connection lost"))


def test_a_failed_flush_puts_its_batch_back_and_newer_heartbeats_win(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        _add_fleet(cp, 3)
        buffer: HeartbeatBuffer = cp.ctx.heartbeats
        now = cp.clock.now()
        for index in range(3):
            buffer.record(_node_id(index), _heartbeat(now, index))
        newer = _heartbeat(now + timedelta(seconds=5), 99)
        factory = _FailingOnce(cp.ctx.session_factory, lambda: buffer.record(_node_id(1), newer))
        with pytest.raises(OperationalError):
            buffer.flush(session_factory=factory)  # type: ignore[arg-type]
        assert len(buffer) == 3  # nothing answered 2xx is lost
        assert buffer.peek(_node_id(1)) == newer
        assert buffer.flush(session_factory=factory) == 3  # type: ignore[arg-type]
        with cp.ctx.session_factory() as session:
            stored = dict(session.execute(select(Node.id, Node.last_heartbeat_at)).all())
        assert stored == {
            _node_id(0): now,
            _node_id(1): newer.at,
            _node_id(2): now + timedelta(microseconds=2),
        }
