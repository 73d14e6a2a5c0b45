"""Database plumbing: migrations under a lock, SQLite pragmas, admin token sources."""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

import psycopg
import pytest
from pydantic import SecretStr
from sqlalchemy import text
from sqlalchemy.engine import make_url

from control_plane.access.admin_token import AdminTokenConfigError, resolve_admin_token
from control_plane.db import make_engine, migrate
from control_plane.settings import Settings
from tests.conftest import POSTGRES_ADMIN_URL, _libpq


def test_concurrent_migrations_on_postgresql_apply_once(postgres_url: str) -> None:
    name = f"modelforge_migrate_{secrets.token_hex(4)}"
    with psycopg.connect(_libpq(POSTGRES_ADMIN_URL), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    errors: list[BaseException] = []

    def run() -> None:
        engine = make_engine(url)
        try:
            migrate(engine)
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)
        finally:
            engine.dispose()

    try:
        threads = [threading.Thread(target=run) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []
        engine = make_engine(url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).all() == [
                ("0024",)
            ]
        engine.dispose()
    finally:
        with psycopg.connect(_libpq(POSTGRES_ADMIN_URL), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_sqlite_runs_in_wal_with_foreign_keys(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'x.db'}")
    migrate(engine, lock_dir=tmp_path)
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 30000
    engine.dispose()


def test_admin_token_sources(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("mfa_from_a_file_0123456789\n")
    from_file = resolve_admin_token(Settings(data_dir=tmp_path, admin_token_file=token_file))
    assert from_file.matches("mfa_from_a_file_0123456789")
    assert not from_file.matches("mfa_from_a_file_012345678")
    assert "0123456789" not in repr(from_file)

    with pytest.raises(AdminTokenConfigError, match="at least 16"):
        resolve_admin_token(Settings(data_dir=tmp_path, admin_token=SecretStr("short")))
    with pytest.raises(AdminTokenConfigError, match="cannot read"):
        resolve_admin_token(Settings(data_dir=tmp_path, admin_token_file=tmp_path / "missing"))

    generated = resolve_admin_token(Settings(data_dir=tmp_path / "d"))
    assert generated.generated and generated.file == tmp_path / "d" / "admin-token"
    assert generated.file.stat().st_mode & 0o777 == 0o600
    again = resolve_admin_token(Settings(data_dir=tmp_path / "d"))
    assert not again.generated and again.matches(generated.file.read_text().strip())
    generated.file.chmod(0o644)
    with pytest.raises(AdminTokenConfigError, match="chmod 600"):
        resolve_admin_token(Settings(data_dir=tmp_path / "d"))
