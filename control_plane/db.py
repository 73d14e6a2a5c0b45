"""Engine, sessions and migrations.

SQLite (the default) runs in WAL mode with foreign keys and a busy timeout, and every transaction
starts with `BEGIN IMMEDIATE` so that concurrent writers queue on the busy handler instead of
failing on a read-to-write lock upgrade. The schema comes only from Alembic, applied at start
under a lock (a PostgreSQL advisory lock, or a file lock beside the SQLite database).
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
#: Arbitrary but fixed key for `pg_advisory_lock` while migrating.
_MIGRATION_LOCK_KEY = 0x4D46_0001


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"timeout": 30, "check_same_thread": False},
            hide_parameters=True,
        )
        _configure_sqlite(engine)
        return engine
    return create_engine(
        url, pool_size=10, max_overflow=20, pool_pre_ping=True, hide_parameters=True
    )


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the driver so that BEGIN IMMEDIATE below is ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def rowcount(result: object) -> int:
    """Rows matched by an UPDATE/DELETE result (typed access for mypy)."""
    return int(getattr(result, "rowcount", 0) or 0)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def _alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


@contextmanager
def _migration_lock(engine: Engine, sqlite_lock_path: Path | None) -> Iterator[None]:
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _MIGRATION_LOCK_KEY})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _MIGRATION_LOCK_KEY})
                conn.commit()
        return
    if sqlite_lock_path is None:
        yield
        return
    with sqlite_lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def migrate(engine: Engine, *, lock_dir: Path | None = None) -> None:
    """Bring the schema to the newest Alembic revision, one process at a time."""
    lock_path = lock_dir / "migrate.lock" if lock_dir is not None else None
    with _migration_lock(engine, lock_path), engine.begin() as connection:
        config = _alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
