"""A deployed service's name is its address at the gateway (`/v2/models/{name}`,
`/services/{name}/...`), so it is unique among the services not `stopped`: a deploy of a name in
use is refused 409 `SERVICE_NAME_TAKEN` and creates nothing, an undeployed service's name is free
again, two deploys of one name at once cannot both win (the partial unique index of migration
0016, on PostgreSQL with two real transactions), and migration 0016 renames the duplicates an
older control plane let through. The real app over HTTP on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from control_plane.errors import Conflict
from control_plane.services import lifecycle
from control_plane.services.schemas import ServiceCreate
from tests.control_plane.test_service_replicas import _alembic
from tests.control_plane.test_workloads import _deploy
from tests.factories import control_plane

COMMAND = ["python3", "-m", "http.server", "{port}"]


def _listed(cp: Any) -> list[dict[str, Any]]:
    response = cp.client.get("/api/v1/services", headers=cp.admin)
    assert response.status_code == 200, response.text
    return list(response.json())


def test_a_name_in_use_is_refused_and_free_again_once_undeployed(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        first = _deploy(cp, name="web")
        refused = cp.client.post(
            "/api/v1/services", headers=cp.admin, json={"name": "web", "command": COMMAND}
        )
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "SERVICE_NAME_TAKEN"
        assert first["service_id"] in error["message"]
        assert f"DELETE /api/v1/services/{first['service_id']}" in error["next_step"]
        assert "another name" in error["next_step"]
        # Nothing was created: one service, one replica, and its events alone.
        (only,) = _listed(cp)
        assert only["service_id"] == first["service_id"] and len(only["replicas"]) == 1
        # Another name is fine; a rename by PATCH does not exist.
        assert _deploy(cp, name="web-2")["name"] == "web-2"
        patched = cp.client.patch(
            f"/api/v1/services/{first['service_id']}", headers=cp.admin, json={"name": "web-2"}
        )
        assert patched.status_code == 422, patched.text

        # Undeployed, its name is free; the stopped service keeps it in its record.
        gone = cp.client.delete(f"/api/v1/services/{first['service_id']}", headers=cp.admin)
        assert gone.status_code == 200, gone.text
        again = _deploy(cp, name="web")
        assert again["service_id"] != first["service_id"]
        names = sorted((s["name"], s["state"]) for s in _listed(cp))
        assert names == [("web", "pending"), ("web", "stopped"), ("web-2", "pending")]


def test_two_deploys_of_one_name_at_once_cannot_both_win(
    tmp_path: Path, pg_database_url: str
) -> None:
    with control_plane(tmp_path, pg_database_url) as cp:
        factory, clock = cp.ctx.session_factory, cp.clock
        request = ServiceCreate.model_validate({"name": "race", "command": COMMAND})
        outcome: list[BaseException | str] = []

        def second() -> None:
            try:
                with factory.begin() as session:
                    outcome.append(
                        lifecycle.deploy(session=session, clock=clock, request=request).id
                    )
            except BaseException as exc:  # collected and asserted below
                outcome.append(exc)

        with factory() as session, session.begin():
            winner = lifecycle.deploy(session=session, clock=clock, request=request).id
            # The first has inserted and not committed: the second's check finds nothing, so
            # only the index can stop it; it waits on the first's row.
            racer = threading.Thread(target=second)
            racer.start()
            deadline = time.monotonic() + 20
            while not _waiting_on_a_lock(session) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _waiting_on_a_lock(session), "the second deploy never waited on the index"
        racer.join(20)
        assert not racer.is_alive()
        (lost,) = outcome
        assert isinstance(lost, Conflict) and lost.code == "SERVICE_NAME_TAKEN", lost
        assert winner in lost.message
        assert [s["service_id"] for s in _listed(cp)] == [winner]


def _waiting_on_a_lock(session: Any) -> bool:
    """Whether another backend of this database waits on a lock (the racing insert)."""
    with session.bind.connect() as probe:
        count = probe.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            )
        ).scalar()
    return bool(count)


def test_migration_0016_renames_duplicates_and_keeps_the_gateways_choice(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'old.db'}")
    at = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    with engine.begin() as connection:
        command.upgrade(_alembic(connection), "0015")
        for service_id, name, state in (
            ("svc_a", "web", "healthy"),
            ("svc_b", "web", "pending"),  # the greatest id: the gateway's, keeps the name
            ("svc_c", "web", "stopped"),
            ("svc_d", "api", "healthy"),
        ):
            connection.execute(
                text(
                    "INSERT INTO services (id, name, state, command, runner, params, env, "
                    "secrets, labels, worker_policy, resources, health, restart, restarts, "
                    "generation, created_at, updated_at, next_event_seq, replicas, revision) "
                    "VALUES (:id, :name, :state, '[\"x\"]', NULL, '{}', '{}', '[]', '{}', "
                    "'require', '{}', '{}', '{}', 0, 1, :at, :at, 4, 1, 1)"
                ),
                {"id": service_id, "name": name, "state": state, "at": at},
            )
        command.upgrade(_alembic(connection), "head")
        names: dict[str, str] = dict(
            connection.execute(text("SELECT id, name FROM services")).all()
        )
        events = connection.execute(
            text("SELECT service_id, seq, kind, data FROM service_events")
        ).all()
        seq = connection.execute(
            text("SELECT next_event_seq FROM services WHERE id = 'svc_a'")
        ).scalar()
        # From now on the index refuses a second deployed `web`, and lets a stopped one be.
        insert = text(
            "INSERT INTO services (id, name, state, command, params, env, secrets, labels, "
            "worker_policy, resources, health, restart, restarts, generation, created_at, "
            "updated_at, next_event_seq, replicas, revision) VALUES (:id, 'web', :state, "
            "'[\"x\"]', '{}', '{}', '[]', '{}', 'require', '{}', '{}', '{}', 0, 1, :at, :at, "
            "1, 1, 1)"
        )
        connection.execute(insert, {"id": "svc_e", "state": "stopped", "at": at})
        with pytest.raises(IntegrityError), connection.begin_nested():
            connection.execute(insert, {"id": "svc_f", "state": "pending", "at": at})
    engine.dispose()
    assert names == {"svc_a": "web-svc_a", "svc_b": "web", "svc_c": "web", "svc_d": "api"}
    ((service_id, event_seq, kind, data),) = events
    assert (service_id, event_seq, kind, seq) == ("svc_a", 4, "renamed", 5)
    assert '"from": "web"' in data and '"to": "web-svc_a"' in data
