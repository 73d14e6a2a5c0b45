"""Migrations 0013 and 0015 on PostgreSQL (issue 27): a placed service's placement is copied into
its replica 0 before 0015 drops the services' columns, on a database of its own migrated from
0012 (the SQLite case is test_service_replicas')."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from control_plane.db import MIGRATIONS_DIR
from tests.conftest import POSTGRES_ADMIN_URL, _libpq


@pytest.fixture
def empty_postgres(postgres_url: str) -> Iterator[str]:
    """A new, empty PostgreSQL database (the session's is migrated already), dropped after."""
    name = f"modelforge_mig_{secrets.token_hex(4)}"
    with psycopg.connect(_libpq(POSTGRES_ADMIN_URL), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(_libpq(POSTGRES_ADMIN_URL), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _alembic(connection: Any) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def test_a_placed_service_becomes_its_replica_0_on_postgresql(empty_postgres: str) -> None:
    engine = create_engine(empty_postgres)
    at = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    with engine.begin() as connection:
        command.upgrade(_alembic(connection), "0012")
        for service_id, state, node_id, url in (
            ("svc_placed", "healthy", "node_1", "http://10.0.0.1:81"),
            ("svc_waiting", "starting", None, None),
            ("svc_gone", "stopped", None, None),
        ):
            connection.execute(
                text(
                    "INSERT INTO services (id, name, state, command, runner, params, env, "
                    "secrets, labels, worker_policy, resources, health, restart, node_id, "
                    "assigned_gpus, url, grpc_url, restarts, last_exit, log_tail, generation, "
                    "created_at, updated_at, placed_at, next_event_seq, replicas, revision) "
                    "VALUES (:id, :id, :state, '[\"x\"]', NULL, '{}', '{}', '[]', '{}', "
                    "'require', '{\"cpus\": 1}', '{}', '{}', :node, :gpus, :url, "
                    "'127.0.0.1:9', 3, :exit, '[\"line\"]', 1, :at, :at, :at, 1, 1, 1)"
                ),
                {
                    "id": service_id,
                    "state": state,
                    "node": node_id,
                    "gpus": '[{"index": 0, "uuid": "GPU-n-0"}]' if node_id else None,
                    "url": url,
                    "exit": '{"code": 1}',
                    "at": at,
                },
            )
        command.upgrade(_alembic(connection), "head")
        replicas = connection.execute(
            text(
                "SELECT service_id, ordinal, revision, state, node_id, assigned_gpus, url, "
                "grpc_url, restarts, last_exit, log_tail, placed_at, ready_at "
                "FROM service_replicas ORDER BY service_id"
            )
        ).all()
        states: dict[str, str] = {
            service_id: state
            for service_id, state in connection.execute(text("SELECT id, state FROM services"))
        }
        revisions = connection.execute(
            text("SELECT service_id, revision, spec FROM service_revisions ORDER BY service_id")
        ).all()
        columns = {column["name"] for column in inspect(connection).get_columns("services")}
    engine.dispose()
    placed, waiting = replicas
    assert placed[:5] == ("svc_placed", 0, 1, "healthy", "node_1")
    assert placed.assigned_gpus == [{"index": 0, "uuid": "GPU-n-0"}]
    assert (placed.url, placed.grpc_url, placed.restarts) == (
        "http://10.0.0.1:81",
        "127.0.0.1:9",
        3,
    )
    assert placed.last_exit == {"code": 1} and placed.log_tail == ["line"]
    assert placed.placed_at == at and placed.ready_at is not None
    # Starting with no node: nothing to copy, it waits to be placed again.
    assert waiting[:5] == ("svc_waiting", 0, 1, "pending", None)
    assert states == {"svc_placed": "healthy", "svc_waiting": "pending", "svc_gone": "stopped"}
    assert [row[:2] for row in revisions] == [
        ("svc_gone", 1),
        ("svc_placed", 1),
        ("svc_waiting", 1),
    ]
    assert revisions[1].spec["command"] == ["x"] and revisions[1].spec["resources"] == {"cpus": 1}
    # 0015: the placement lives on the replicas only.
    assert not columns & {"node_id", "assigned_gpus", "url", "grpc_url", "placed_at", "log_tail"}
