""" "Needs upgrade" is the verdict of the running control plane, and a restart clears it
(docs/COMPATIBILITY.md: it stays "until the agent (or runtime worker) attaches again compatibly,
or until the control plane restarts"; a restart may be the upgrade that makes it compatible).

Real processes: the control plane on Granian, stopped and started again on the same data
directory and database. The nodes are driven over HTTP as agents would, since a real agent only
speaks this release's protocol: one whose agent's heartbeat is refused, one whose runtime
worker's inventory is refused. A real agent can stand behind a refused runtime worker, though
(a stand-in worker at its socket speaks the newer protocol): after a restart it reports that
worker again within an inventory interval, and the node is marked again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.node import live_stack, wait_until
from tests.e2e.server import FAST, LiveServer
from tests.factories import heartbeat_body, inventory_body

pytestmark = pytest.mark.e2e

#: A protocol newer than this release speaks: refused TOO_NEW.
NEWER = 2


def _bearer(node: dict[str, Any]) -> dict[str, str]:
    return {"Authorization": f"Bearer {node['credential']}"}


def _refuse(server: LiveServer, agent: dict[str, Any], worker: dict[str, Any]) -> None:
    """The agent of `agent` and the runtime worker of `worker` each speak a newer protocol."""
    with server.client() as client:
        heartbeat = client.post(
            "/api/v1/agent/heartbeat", headers=_bearer(agent), json=heartbeat_body(protocol=NEWER)
        )
        inventory = client.put(
            "/api/v1/agent/inventory",
            headers=_bearer(worker),
            json=inventory_body(worker_protocol=NEWER),
        )
    assert heartbeat.status_code == 426, heartbeat.text
    assert inventory.status_code == 426, inventory.text


def _marks(server: LiveServer) -> dict[str, Any]:
    return {node["node_id"]: node["needs_upgrade"] for node in server.get("/api/v1/admin/nodes")}


def test_a_restart_clears_needs_upgrade_and_the_verdict_is_made_again(tmp_path: Path) -> None:
    server = LiveServer(tmp_path / "cp", f"sqlite:///{tmp_path / 'cp.db'}", env_overrides=FAST)
    with server:
        agent, worker = server.enroll("old-agent"), server.enroll("old-worker")
        _refuse(server, agent, worker)
        marks = _marks(server)
        assert marks[agent["node_id"]]["component"] == "agent"
        assert marks[worker["node_id"]]["component"] == "runtime-worker"
        assert {mark["code"] for mark in marks.values()} == {"TOO_NEW"}
        protocol = next(
            check
            for check in server.get(f"/api/v1/admin/nodes/{worker['node_id']}/readiness")["checks"]
            if check["name"] == "protocol"
        )
        assert protocol["status"] == "fail"

        assert server.stop() == 0
        server.start()  # the same data directory and database

        assert _marks(server) == {agent["node_id"]: None, worker["node_id"]: None}
        for node in (agent, worker):
            # The refusal stays in the node's history; only the mark is gone.
            events = server.get(f"/api/v1/admin/nodes/{node['node_id']}/events")
            assert [e["kind"] for e in events].count("needs_upgrade") == 1

        # The restarted control plane judges for itself: the same refusals mark them again.
        _refuse(server, agent, worker)
        marks = _marks(server)
        assert marks[agent["node_id"]]["component"] == "agent"
        assert marks[worker["node_id"]]["component"] == "runtime-worker"


def test_a_real_agent_reports_a_refused_worker_again_after_a_restart(tmp_path: Path) -> None:
    # The shortest inventory interval a control plane gives: a quarter of the maximum age.
    interval = 60 / 4
    env = dict(FAST, MODELFORGE_INVENTORY_MAX_AGE_SECONDS="60")
    with live_stack(tmp_path, env) as (server, node):
        node_id = node.start_fake_worker(NEWER).start_agent().node_id()

        def mark() -> Any:
            return _marks(server).get(node_id)

        def refusals() -> int:
            events = server.get(f"/api/v1/admin/nodes/{node_id}/events")
            return [e["kind"] for e in events].count("needs_upgrade")

        wait_until(lambda: mark() is not None, 30, "the worker's refusal marked", interval=0.2)
        assert mark()["component"] == "runtime-worker", mark()
        assert refusals() == 1

        assert server.stop() == 0
        server.start()  # the same data directory and database: the mark is cleared

        # The agent asks again about the same worker within an interval (a couple, on a loaded
        # machine), rather than leaving the node online and silently without an inventory.
        wait_until(
            lambda: mark() is not None, 2 * interval + 10, "the node marked again", interval=0.2
        )
        assert mark()["component"] == "runtime-worker", mark()
        assert mark()["code"] == "TOO_NEW", mark()
        assert refusals() == 2  # a new refusal, by the restarted control plane
        checks = server.get(f"/api/v1/admin/nodes/{node_id}/readiness")["checks"]
        assert next(c for c in checks if c["name"] == "protocol")["status"] == "fail"
        assert node.agent is not None and node.agent.poll() is None, node.log()
