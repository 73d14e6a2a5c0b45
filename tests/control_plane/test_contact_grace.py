"""The control plane's own downtime is not the nodes' silence (liveness.ContactGrace): after a
restart, and after a database outage, a node's liveness, its running job's contact and its
services' placement each count from the moment the control plane was back, so every node gets one
full timeout to reach it — and only one: a node that stays silent is still judged after it.

Real app and database; a restart is a second app on the same data dir and database, on the same
injected clock moved past the downtime."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import text

from control_plane.background.loops import PRESENCE_INTERVAL_SECONDS, sweep_jobs
from control_plane.background.service_placement import place_services
from control_plane.db import is_database_unavailable, make_engine
from control_plane.fleet.liveness import liveness_state
from tests.control_plane.test_jobs import _claim, _node, _submit
from tests.e2e.server import FAST, LiveServer, free_port
from tests.factories import ControlPlane, control_plane, heartbeat_body

#: Past every default deadline: offline after 90 s, job contact lost after 90 s.
DOWNTIME = 200


def _job(cp: ControlPlane, job_id: str) -> dict[str, Any]:
    return dict(cp.client.get(f"/api/v1/jobs/{job_id}", headers=cp.admin).json())


def _service(cp: ControlPlane, service_id: str) -> dict[str, Any]:
    return dict(cp.client.get(f"/api/v1/services/{service_id}", headers=cp.admin).json())


def _busy_node(cp: ControlPlane) -> tuple[dict[str, str], str, str]:
    """A node running a job and holding a service: (node, job id, service id)."""
    node = _node(cp)
    cp.flush()
    job_id = _submit(cp)["job_id"]
    assert _claim(cp, node) is not None
    deployed = cp.client.post(
        "/api/v1/services",
        headers=cp.admin,
        json={"name": "web", "command": ["python3", "-m", "http.server", "{port}"]},
    )
    assert deployed.status_code == 201, deployed.text
    service_id = deployed.json()["service_id"]
    assert place_services(cp.ctx) == 1
    assert _service(cp, service_id)["node_id"] == node["node_id"]
    return node, job_id, service_id


def _refused_connection() -> Exception:
    """What a request meets while the database server is down: a refused connection."""
    engine = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres")
    try:
        with engine.connect():
            pass
    except Exception as error:
        assert is_database_unavailable(error)
        return error
    finally:
        engine.dispose()
    raise AssertionError("a closed port accepted a connection")


def _still_judged_after_one_timeout(
    cp: ControlPlane, node: dict[str, str], job_id: str, service_id: str
) -> None:
    """One full timeout after the control plane came back, a node still silent is judged."""
    cp.clock.advance(91)
    assert cp.node(node["node_id"])["state"] == "offline"
    assert sweep_jobs(cp.ctx) == 1
    assert _job(cp, job_id)["error"]["code"] == "JOB_CONTACT_LOST"
    place_services(cp.ctx)
    assert _service(cp, service_id)["node_id"] is None
    cp.sweep()
    reasons = [e["reason"] for e in cp.events(node["node_id"]) if e["kind"] == "state_changed"]
    assert any("since the control plane was back" in reason for reason in reasons), reasons


def test_a_restart_gives_every_node_one_full_timeout(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path / "cp", database_url) as before:
        node, job_id, service_id = _busy_node(before)
        clock = before.clock
    clock.advance(DOWNTIME)  # the control plane is down; no agent can reach it
    with control_plane(tmp_path / "cp", database_url, clock=clock) as after:
        # Right after the restart, nothing the downtime caused is held against the node.
        assert after.node(node["node_id"])["state"] == "online"
        assert after.sweep() == 0
        assert sweep_jobs(after.ctx) == 0
        assert _job(after, job_id)["state"] == "running"
        place_services(after.ctx)
        kept = _service(after, service_id)
        assert kept["node_id"] == node["node_id"] and kept["state"] == "starting"
        # The agent's report, retried after the downtime, is accepted.
        report = after.client.post(
            f"/api/v1/agent/jobs/{job_id}/events",
            headers={"Authorization": node["Authorization"]},
            json={"events": [{"kind": "event", "data": {"during": "downtime"}}]},
        )
        assert report.status_code == 200, report.text
        after.clock.advance(80)
        assert sweep_jobs(after.ctx) == 0  # contact renewed by that report
        _still_judged_after_one_timeout(after, node, job_id, service_id)


def test_a_database_outage_gives_every_node_one_full_timeout(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node, job_id, service_id = _busy_node(cp)
        cp.clock.advance(10)
        database = cp.ctx.database
        database.failed(_refused_connection())
        assert not database.available
        # The outage lasts; agents' reports are refused meanwhile. It ends once statements work
        # a second (DatabaseAvailability's settling, on the same clock) after the last failure.
        cp.clock.advance(DOWNTIME)
        with cp.ctx.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        assert database.available
        assert cp.node(node["node_id"])["state"] == "online"
        assert cp.sweep() == 0
        assert sweep_jobs(cp.ctx) == 0
        assert _job(cp, job_id)["state"] == "running"
        place_services(cp.ctx)
        assert _service(cp, service_id)["node_id"] == node["node_id"]
        _still_judged_after_one_timeout(cp, node, job_id, service_id)


# -- only a deadline that had not expired when the downtime began is extended ------------------

#: A node that died long before the control plane went down (the review's case: 30 days).
LONG_DEAD = 30 * 86400


def test_a_node_dead_before_a_restart_is_offline_right_after_it(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path / "cp", database_url) as before:
        dead, job_id, service_id = _busy_node(before)
        before.clock.advance(LONG_DEAD)  # the node died; no sweep ran (no background loops here)
        live = _node(before)  # heartbeats until the control plane stops
        clock = before.clock
    clock.advance(DOWNTIME)
    with control_plane(tmp_path / "cp", database_url, clock=clock) as after:
        # Right after the restart: the dead node is judged, the live one gets its timeout.
        assert after.node(dead["node_id"])["state"] == "offline"
        assert after.node(live["node_id"])["state"] == "online"
        assert sweep_jobs(after.ctx) == 1
        assert _job(after, job_id)["error"]["code"] == "JOB_CONTACT_LOST"
        place_services(after.ctx)  # not left on, nor placed on, the dead node
        assert _service(after, service_id)["node_id"] == live["node_id"]
        assert after.sweep() == 1  # the dead node's recorded state catches up at once
        changed = [e for e in after.events(dead["node_id"]) if e["kind"] == "state_changed"][-1]
        assert changed["to_state"] == "offline"
        assert "since the control plane was back" not in changed["reason"], changed


def test_a_node_stale_before_a_restart_is_stale_after_it_and_offline_one_timeout_later(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path / "cp", database_url) as before:
        node = _node(before)
        before.flush()
        before.clock.advance(40)  # stale after 30 s, not yet offline (90 s)
        clock = before.clock
    clock.advance(DOWNTIME)
    with control_plane(tmp_path / "cp", database_url, clock=clock) as after:
        assert after.node(node["node_id"])["state"] == "stale"  # its stale deadline had passed
        after.clock.advance(85)
        assert after.node(node["node_id"])["state"] == "stale"  # its offline one had not
        after.clock.advance(6)
        assert after.node(node["node_id"])["state"] == "offline"


def test_a_killed_control_plane_counts_its_downtime_from_its_last_presence_mark(
    tmp_path: Path,
) -> None:
    """A real process killed with SIGKILL writes nothing at the end: the presence mark its
    background loop wrote every few seconds is where the next start counts the downtime from.
    The node stopped heartbeating long enough before the kill to be offline then, so it is
    offline right after the restart (with the start's own time as the downtime's start, it
    would read online for the whole stale threshold)."""
    data_dir = tmp_path / "data"
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    # Stale after 15 s: long enough that a node counted from the start would surely read
    # online at the first request after it, on a loaded machine.
    env = {**FAST, "MODELFORGE_NODE_STALE_AFTER_SECONDS": "15"}
    env["MODELFORGE_NODE_OFFLINE_AFTER_SECONDS"] = "20"
    server = LiveServer(data_dir, url, env_overrides=env).start()
    try:
        enrolled = server.enroll()
        with server.client() as client:
            beat = client.post(
                "/api/v1/agent/heartbeat",
                headers={"Authorization": f"Bearer {enrolled['credential']}"},
                json=heartbeat_body(),
            )
        assert beat.status_code == 200, beat.text
        heard_at = time.monotonic()
        # The node dies; the control plane runs on long enough to see it offline and to mark
        # itself alive after that (PRESENCE_INTERVAL_SECONDS).
        node_path = f"/api/v1/admin/nodes/{enrolled['node_id']}"
        while server.get(node_path)["state"] != "offline":
            assert time.monotonic() - heard_at < 120, server.get(node_path)
            time.sleep(1)
        time.sleep(PRESENCE_INTERVAL_SECONDS + 2)
        server.kill()
        server.start()
        assert server.get(node_path)["state"] == "offline"
    finally:
        server.stop()


def test_a_node_offline_before_a_database_outage_stays_offline(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        dead, job_id, service_id = _busy_node(cp)
        dead_last = cp.node(dead["node_id"])["last_heartbeat_at"]
        cp.clock.advance(100)  # the node died: offline, its job's contact lost
        live = _node(cp)
        cp.flush()
        live_last = cp.node(live["node_id"])["last_heartbeat_at"]
        cp.clock.advance(10)
        database = cp.ctx.database
        database.failed(_refused_connection())
        cp.clock.advance(DOWNTIME)
        # During the outage (read without the database, which would end it): only the node
        # that was live when it began is spared.
        assert not database.available
        now, thresholds = cp.clock.now(), cp.ctx.thresholds
        assert liveness_state(datetime.fromisoformat(dead_last), now, thresholds) == "offline"
        assert liveness_state(datetime.fromisoformat(live_last), now, thresholds) == "online"
        with cp.ctx.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        assert database.available
        assert cp.node(dead["node_id"])["state"] == "offline"
        assert cp.node(live["node_id"])["state"] == "online"
        assert sweep_jobs(cp.ctx) == 1
        assert _job(cp, job_id)["error"]["code"] == "JOB_CONTACT_LOST"
        place_services(cp.ctx)
        assert _service(cp, service_id)["node_id"] == live["node_id"]
