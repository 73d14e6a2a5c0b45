"""A service's replicas (issue 27): placed apart (distinct nodes, else distinct GPUs), each synced
to its node by its own id, summarised in the service's state, re-placed alone when its node goes
offline, all stopped by an undeploy; and migration 0013 turning a placed service into replica 0.
The real app over HTTP on SQLite and PostgreSQL; the agents' side is driven by its HTTP calls."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, text

from control_plane.background.service_placement import place_services
from control_plane.db import MIGRATIONS_DIR
from tests.control_plane.test_jobs import _node
from tests.control_plane.test_workloads import _deploy, _service, _sync
from tests.factories import ControlPlane, control_plane, heartbeat_body


def _status(replica_id: str, state: str, port: int) -> dict[str, Any]:
    return {"service_id": replica_id, "generation": 1, "state": state, "port": port}


def _replica_ids(desired: dict[str, Any]) -> list[str]:
    return [spec["replica_id"] for spec in desired["services"]]


def _events(cp: ControlPlane, service_id: str) -> list[dict[str, Any]]:
    response = cp.client.get(f"/api/v1/services/{service_id}/events", headers=cp.admin)
    assert response.status_code == 200, response.text
    return list(response.json())


def test_two_replicas_land_on_distinct_nodes_and_summarise_their_state(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        a, b = _node(cp), _node(cp)
        service = _deploy(cp, replicas=2)
        assert service["desired_replicas"] == 2 and service["state"] == "pending"
        assert [r["state"] for r in service["replicas"]] == ["pending", "pending"]
        assert place_services(cp.ctx) == 2
        placed = _service(cp, service["service_id"])
        assert {r["node_id"] for r in placed["replicas"]} == {a["node_id"], b["node_id"]}
        assert placed["state"] == "starting"

        # Each node is told of its own replica, by the replica's id, beside the service's.
        on_a, on_b = _sync(cp, a), _sync(cp, b)
        (spec_a,), (spec_b,) = on_a["services"], on_b["services"]
        assert spec_a["service_id"] == spec_b["service_id"] == service["service_id"]
        assert spec_a["replica_id"] != spec_b["replica_id"]
        by_id = {r["id"]: r for r in placed["replicas"]}
        assert by_id[spec_a["replica_id"]]["node_id"] == a["node_id"]

        # One healthy: degraded; its url is the service's. Both: healthy.
        _sync(
            cp, a, service_host="10.0.0.1", services=[_status(spec_a["replica_id"], "healthy", 81)]
        )
        one = _service(cp, service["service_id"])
        assert one["state"] == "degraded"
        assert one["url"] == "http://10.0.0.1:81" and one["node_id"] == a["node_id"]
        ready = {r["id"]: r["ready_at"] for r in one["replicas"]}
        assert ready[spec_a["replica_id"]] is not None and ready[spec_b["replica_id"]] is None
        listed = cp.client.get("/api/v1/services?state=degraded", headers=cp.admin).json()
        assert [s["service_id"] for s in listed] == [service["service_id"]]
        scrape = cp.client.get("/metrics", headers=cp.admin).text
        assert 'modelforge_services{state="degraded"} 1.0' in scrape

        _sync(
            cp, b, service_host="10.0.0.2", services=[_status(spec_b["replica_id"], "healthy", 82)]
        )
        both = _service(cp, service["service_id"])
        assert both["state"] == "healthy"
        assert sorted(r["url"] for r in both["replicas"]) == [
            "http://10.0.0.1:81",
            "http://10.0.0.2:82",
        ]

        # Events name their replica; the summary's own event names none.
        events = _events(cp, service["service_id"])
        healthy = [e for e in events if e["data"].get("state") == "healthy"]
        assert {e["replica_id"] for e in healthy} == {
            spec_a["replica_id"],
            spec_b["replica_id"],
            None,
        }
        assert any(e["data"].get("state") == "degraded" and e["replica_id"] is None for e in events)


def test_replicas_on_one_node_take_distinct_gpus(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp, gpus=2)
        service = _deploy(cp, replicas=2, resources={"cpus": 1, "gpus": 1})
        assert place_services(cp.ctx) == 2
        placed = _service(cp, service["service_id"])
        assert {r["node_id"] for r in placed["replicas"]} == {node["node_id"]}
        held = sorted(gpu["index"] for r in placed["replicas"] for gpu in r["assigned_gpus"])
        assert held == [0, 1]
        # Both run on the node, each by its own id, each with its own GPU.
        specs = _sync(cp, node)["services"]
        assert len({spec["replica_id"] for spec in specs}) == 2
        assert sorted(spec["assigned_gpus"][0]["index"] for spec in specs) == [0, 1]
        # A third replica's worth finds no GPU left: a second service waits.
        other = _deploy(cp, name="other", resources={"cpus": 1, "gpus": 1})
        assert place_services(cp.ctx) == 0
        assert _service(cp, other["service_id"])["state"] == "pending"


def test_a_replicas_node_going_offline_replaces_only_that_replica(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        a, b = _node(cp), _node(cp)
        service = _deploy(cp, replicas=2)
        assert place_services(cp.ctx) == 2
        before = {r["node_id"]: r["id"] for r in _service(cp, service["service_id"])["replicas"]}

        cp.clock.advance(cp.ctx.settings.node_offline_after_seconds + 1)
        beat = cp.client.post(
            "/api/v1/agent/heartbeat",
            headers={"Authorization": b["Authorization"]},
            json=heartbeat_body(),
        )
        assert beat.status_code == 200, beat.text
        c = _node(cp)
        assert place_services(cp.ctx) == 1
        after = {r["node_id"]: r["id"] for r in _service(cp, service["service_id"])["replicas"]}
        # b's replica stayed; a's moved to c (not beside its sibling on b), keeping its id.
        assert after == {b["node_id"]: before[b["node_id"]], c["node_id"]: before[a["node_id"]]}
        assert _sync(cp, a)["services"] == []  # a comes back: its agent stops its copy
        assert _replica_ids(_sync(cp, b)) == [before[b["node_id"]]]
        moved = [
            e
            for e in _events(cp, service["service_id"])
            if e["data"].get("reason") == "its node went offline"
        ]
        assert [e["replica_id"] for e in moved] == [before[a["node_id"]]]


def test_undeploy_stops_every_replica(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        a, b = _node(cp), _node(cp)
        service = _deploy(cp, replicas=2, resources={"cpus": 4})
        assert place_services(cp.ctx) == 2
        undeployed = cp.client.delete(f"/api/v1/services/{service['service_id']}", headers=cp.admin)
        assert undeployed.status_code == 200, undeployed.text
        assert undeployed.json()["state"] == "stopped" and undeployed.json()["replicas"] == []
        assert _sync(cp, a)["services"] == [] and _sync(cp, b)["services"] == []
        # Their resources are free: a service needing each node's 4 CPUs is placed on both.
        again = _deploy(cp, name="again", replicas=2, resources={"cpus": 4})
        assert place_services(cp.ctx) == 2
        assert _service(cp, again["service_id"])["state"] == "starting"


def test_bad_replica_counts_are_refused(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        for replicas in (0, 17, "2", 1.5):
            response = cp.client.post(
                "/api/v1/services",
                headers=cp.admin,
                json={"name": "web", "command": ["x", "{port}"], "replicas": replicas},
            )
            assert response.status_code == 422, (replicas, response.text)
        assert cp.client.get("/api/v1/services", headers=cp.admin).json() == []


def _alembic(connection: Any) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def test_the_migration_makes_a_placed_service_its_replica_0(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'old.db'}")
    at = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    gpus = '[{"index": 0, "uuid": "GPU-n-0"}]'
    with engine.begin() as connection:
        command.upgrade(_alembic(connection), "0012")
        for service_id, state, node_id, url in (
            ("svc_placed", "healthy", "node_1", "http://10.0.0.1:81"),
            ("svc_waiting", "pending", None, None),
            ("svc_gone", "stopped", None, None),
        ):
            connection.execute(
                text(
                    "INSERT INTO services (id, name, state, command, runner, params, env, "
                    "secrets, labels, worker_policy, resources, health, restart, node_id, "
                    "assigned_gpus, url, grpc_url, restarts, last_exit, generation, created_at, "
                    "updated_at, placed_at, next_event_seq, replicas, revision) VALUES (:id, "
                    ":id, :state, '[\"x\"]', NULL, '{}', '{}', '[]', '{}', 'require', "
                    "'{\"cpus\": 1}', '{}', '{}', :node, :gpus, :url, NULL, 3, NULL, 1, :at, "
                    ":at, :at, 1, 1, 1)"
                ),
                {
                    "id": service_id,
                    "state": state,
                    "node": node_id,
                    "gpus": gpus if node_id else None,
                    "url": url,
                    "at": at,
                },
            )
        command.upgrade(_alembic(connection), "head")
        replicas = connection.execute(
            text(
                "SELECT service_id, ordinal, revision, state, node_id, assigned_gpus, url, "
                "restarts, ready_at FROM service_replicas ORDER BY service_id"
            )
        ).all()
        revisions = connection.execute(
            text("SELECT service_id, revision, spec FROM service_revisions ORDER BY service_id")
        ).all()
    engine.dispose()
    placed, waiting = replicas
    assert placed[:5] == ("svc_placed", 0, 1, "healthy", "node_1")
    assert '"GPU-n-0"' in placed.assigned_gpus and placed.url == "http://10.0.0.1:81"
    assert placed.restarts == 3 and placed.ready_at is not None
    assert waiting[:5] == ("svc_waiting", 0, 1, "pending", None)
    assert [row[:2] for row in revisions] == [
        ("svc_gone", 1),
        ("svc_placed", 1),
        ("svc_waiting", 1),
    ]
    assert '"cpus": 1' in revisions[1].spec and '"command": ["x"]' in revisions[1].spec
