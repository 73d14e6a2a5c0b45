"""Liveness with an injectable clock, heartbeat coalescing (HB-4), readiness."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import select

from control_plane.models import Node
from tests.factories import control_plane, inventory_body, telemetry_body


def _state_events(cp: Any, node_id: str) -> list[tuple[str, str]]:
    return [
        (e["from_state"], e["to_state"]) for e in cp.events(node_id) if e["kind"] == "state_changed"
    ]


def test_online_stale_offline_and_back(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        node_id, credential = enrolled["node_id"], enrolled["credential"]
        assert cp.node(node_id)["state"] == "offline"  # enrolled, never heartbeated
        assert cp.heartbeat(credential).status_code == 200
        # Read before any flush: the pending heartbeat already counts.
        assert cp.node(node_id)["state"] == "online"
        cp.flush()
        cp.clock.advance(29)
        assert cp.node(node_id)["state"] == "online"
        cp.clock.advance(1)
        # Computed on read, before any sweep ran.
        assert cp.node(node_id)["state"] == "stale"
        assert cp.sweep() == 1
        cp.clock.advance(60)
        assert cp.node(node_id)["state"] == "offline"
        assert cp.sweep() == 1
        assert cp.sweep() == 0  # a transition is recorded once
        cp.clock.advance(5)
        cp.heartbeat(credential)
        cp.flush()
        assert cp.node(node_id)["state"] == "online"
        assert _state_events(cp, node_id) == [
            ("offline", "online"),
            ("online", "stale"),
            ("stale", "offline"),
            ("offline", "online"),
        ]
        reasons = [e["reason"] for e in cp.events(node_id) if e["kind"] == "state_changed"]
        assert reasons[1] == "no heartbeat for 30 s (stale after 30 s)"
        assert reasons[2] == "no heartbeat for 90 s (offline after 90 s)"


def test_sweep_skips_stale_when_silence_already_offline(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        cp.heartbeat(enrolled["credential"])
        cp.flush()
        cp.clock.advance(500)
        cp.sweep()
        assert _state_events(cp, enrolled["node_id"])[-1] == ("online", "offline")


def test_flush_batches_heartbeats_into_the_database(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        nodes = [cp.enroll() for _ in range(5)]
        for enrolled in nodes:
            assert cp.heartbeat(enrolled["credential"]).status_code == 200
            assert cp.heartbeat(enrolled["credential"]).status_code == 200
        assert len(cp.ctx.heartbeats) == 5  # coalesced per node
        with cp.ctx.session_factory() as session:
            assert all(n.last_heartbeat_at is None for n in session.scalars(select(Node)))
        assert cp.flush() == 5
        with cp.ctx.session_factory() as session:
            stored = {n.id: n.last_heartbeat_at for n in session.scalars(select(Node))}
        assert set(stored) == {n["node_id"] for n in nodes}
        assert all(at == cp.clock.now() for at in stored.values())


def test_readiness_needs_more_than_a_connection(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        node_id, headers = enrolled["node_id"], cp.agent(enrolled["credential"])
        cp.heartbeat(enrolled["credential"])
        readiness = cp.readiness(node_id)
        assert readiness["node_id"] == node_id and readiness["ready"] is False
        checks = {c["name"]: c for c in readiness["checks"]}
        assert list(checks) == ["connected", "inventory", "protocol", "agent_health", "telemetry"]
        assert checks["connected"]["status"] == "pass"
        assert checks["inventory"]["status"] == "fail"
        assert "inventory" in checks["inventory"]["next_step"]
        assert checks["telemetry"]["status"] == "unknown"
        assert all(c["next_step"] for c in readiness["checks"])

        cp.client.put("/api/v1/agent/inventory", headers=headers, json=inventory_body("nvidia"))
        checks = {c["name"]: c for c in cp.readiness(node_id)["checks"]}
        assert checks["inventory"]["status"] == "pass"
        assert checks["telemetry"]["status"] == "fail"  # nvidia mode requires telemetry

        cp.client.post("/api/v1/agent/telemetry", headers=headers, json=telemetry_body())
        ready = cp.readiness(node_id)
        assert ready["ready"] is True, ready
        assert {c["status"] for c in ready["checks"]} == {"pass"}

        cp.clock.advance(46)  # telemetry older than 3 intervals, heartbeat stale
        late = {c["name"]: c["status"] for c in cp.readiness(node_id)["checks"]}
        assert late["telemetry"] == "fail" and late["connected"] == "fail"


def test_readiness_in_cpu_mode_and_failed_preflight(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        node_id, headers = enrolled["node_id"], cp.agent(enrolled["credential"])
        cp.heartbeat(enrolled["credential"])
        no_worker = inventory_body("cpu")
        del no_worker["runtime_worker"]
        cp.client.put("/api/v1/agent/inventory", headers=headers, json=no_worker)
        checks = {c["name"]: c for c in cp.readiness(node_id)["checks"]}
        assert checks["protocol"]["status"] == "fail"
        assert "runtime worker" in checks["protocol"]["next_step"]
        assert checks["telemetry"]["status"] == "pass"  # not required in cpu mode

        cp.client.put("/api/v1/agent/inventory", headers=headers, json=inventory_body("cpu"))
        assert cp.readiness(node_id)["ready"] is True

        cp.heartbeat(enrolled["credential"], preflight="failed")
        checks = {c["name"]: c for c in cp.readiness(node_id)["checks"]}
        assert checks["agent_health"]["status"] == "fail"
        assert "--preflight" in checks["agent_health"]["next_step"]


def test_a_read_during_a_flush_still_sees_the_heartbeat(tmp_path: Path, database_url: str) -> None:
    """Between taking the batch and committing it, readers must not lose the heartbeat."""
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        cp.heartbeat(enrolled["credential"])
        seen: list[Any] = []
        buffer = cp.ctx.heartbeats
        original = cp.ctx.session_factory

        class Spy:
            def begin(self) -> Any:
                seen.append(buffer.peek(enrolled["node_id"]))  # mid-flush, before the commit
                return original.begin()

        assert buffer.flush(session_factory=Spy()) == 1  # type: ignore[arg-type]
        assert seen and seen[0] is not None
        assert len(buffer) == 0  # written: nothing is pending
        assert cp.node(enrolled["node_id"])["state"] == "online"


def test_a_row_read_before_a_flush_and_judged_after_it_keeps_the_heartbeat(
    tmp_path: Path, database_url: str
) -> None:
    """A reader loads the node's row, the flush commits and leaves the buffer, then the reader
    asks the buffer: the heartbeat is in neither unless the buffer keeps what it wrote (a CI
    run saw a node's readiness go from ready to 'no heartbeat' for one read)."""
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        node_id = enrolled["node_id"]
        cp.heartbeat(enrolled["credential"])
        liveness = cp.ctx.liveness
        with cp.ctx.read_session_factory() as session:
            node = session.get(Node, node_id)
            assert node is not None and node.last_heartbeat_at is None  # loaded before the flush
            assert cp.flush() == 1
            assert liveness.last_seen(node_id, node.last_heartbeat_at) == cp.clock.now()
            assert liveness.reported(node)["health"] == {"status": "healthy", "preflight": "passed"}
            assert liveness.state(node, cp.clock.now()) == "online"
        cp.clock.advance(5)
        cp.heartbeat(enrolled["credential"])
        assert cp.flush() == 1
        with cp.ctx.read_session_factory() as session:
            node = session.get(Node, node_id)
            assert node is not None and node.last_heartbeat_at == cp.clock.now()
            assert liveness.last_seen(node_id, node.last_heartbeat_at) == cp.clock.now()
        cp.client.delete(f"/api/v1/admin/nodes/{node_id}", headers=cp.admin).raise_for_status()
        assert cp.ctx.heartbeats.peek(node_id) is None  # a deleted node's is forgotten
