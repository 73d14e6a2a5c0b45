"""The control plane's own downtime is not the nodes' silence (liveness.ContactGrace): after a
restart, and after a database outage, a node's liveness, its running job's contact and its
services' placement each count from the moment the control plane was back, so every node gets one
full timeout to reach it — and only one: a node that stays silent is still judged after it.

Real app and database; a restart is a second app on the same data dir and database, on the same
injected clock moved past the downtime."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sqlalchemy import text

from control_plane.background.loops import sweep_jobs
from control_plane.background.service_placement import place_services
from control_plane.db import is_database_unavailable, make_engine
from tests.control_plane.test_jobs import _claim, _node, _submit
from tests.e2e.server import free_port
from tests.factories import ControlPlane, control_plane

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
        cp.clock.advance(DOWNTIME)  # the outage lasts; agents' reports are refused meanwhile
        # The outage ends once statements work for a second (DatabaseAvailability's settling).
        time.sleep(1.1)
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
