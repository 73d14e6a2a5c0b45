"""Engine, sessions, migrations, database outages and the data dir's file modes.

SQLite (the default) runs in WAL mode with foreign keys and a busy timeout. A transaction that
may write starts with `BEGIN IMMEDIATE`, so that concurrent writers queue on the busy handler
instead of failing on a read-to-write lock upgrade; a read-only one (`make_read_engine`: the
sessions of GET and HEAD requests) starts deferred and takes no lock at all, since WAL readers
never wait for the writer. SQLite refuses any write on the read engine's connections ("not
authorized"), as PostgreSQL does in its read-only transactions, so a read-only session that
writes is a bug the tests see, not a lock upgrade that fails under load. The schema comes only
from Alembic, applied at start under a lock (a PostgreSQL advisory lock, or a file lock beside
the SQLite database).

The data dir holds the database, keys and tokens: it is kept 0700 and every file the control
plane creates in it 0600, whatever the process umask. A database outage is an operating
condition, not a bug: `is_database_unavailable` tells one from the other, and
`DatabaseAvailability` logs each outage once, when it starts and when it ends. This module never
logs a database URL: it carries the password.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, exc, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
#: Arbitrary but fixed key for `pg_advisory_lock` while migrating.
_MIGRATION_LOCK_KEY = 0x4D46_0001
#: A new PostgreSQL connection gives up after this long (an unreachable host would otherwise
#: hold a request for the TCP timeout, minutes); a `connect_timeout` in the URL wins.
_CONNECT_TIMEOUT_SECONDS = 10
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
#: The files SQLite keeps beside its database (WAL mode).
_SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")


#: Pooled connections kept open, and the most opened beyond them. Every thread that works on the
#: database holds at most one; the app's threads (its worker lanes, the default pool of sync
#: dependencies and background loops, the scheduler's and completions' own) number fewer than
#: these together, so a thread never waits for a pooled connection (`POOL_CONNECTIONS`).
_POOL_SIZE = 10
_POOL_OVERFLOW = 30
POOL_CONNECTIONS = _POOL_SIZE + _POOL_OVERFLOW


def make_engine(url: str) -> Engine:
    """The engine for transactions that may write (on SQLite: `BEGIN IMMEDIATE`)."""
    if url.startswith("sqlite"):
        database = make_url(url).database
        if database and database != ":memory:" and not database.startswith("file:"):
            _prepare_sqlite_files(Path(database))
        engine = _sqlite_engine(url)
        _configure_sqlite(engine, read_only=False)
        return engine
    connect_args: dict[str, Any] = {}
    if "connect_timeout" not in make_url(url).query:
        connect_args["connect_timeout"] = _CONNECT_TIMEOUT_SECONDS
    # pool_pre_ping: a connection that died with the server (a restart, a failover) is replaced
    # on its next checkout, so recovery after an outage needs no restart of the control plane.
    return create_engine(
        url,
        pool_size=_POOL_SIZE,
        max_overflow=_POOL_OVERFLOW,
        pool_pre_ping=True,
        hide_parameters=True,
        connect_args=connect_args,
    )


def make_read_engine(engine: Engine) -> Engine:
    """The engine for read-only transactions on `engine`'s database: on SQLite its own pool of
    connections that begin deferred (no lock: a read never waits for a writer, nor a writer for
    it) and are refused any write; on PostgreSQL the same pool, in READ ONLY transactions."""
    if engine.dialect.name != "sqlite":
        return engine.execution_options(postgresql_readonly=True)
    read = _sqlite_engine(engine.url.render_as_string(hide_password=False))
    _configure_sqlite(read, read_only=True)
    return read


def _sqlite_engine(url: str) -> Engine:
    return create_engine(
        url,
        connect_args={"timeout": 30, "check_same_thread": False},
        pool_size=_POOL_SIZE,
        max_overflow=_POOL_OVERFLOW,
        hide_parameters=True,
    )


# -- file modes ---------------------------------------------------------------------------------


def prepare_data_dir(path: Path) -> None:
    """Create the data dir 0700, or tighten an existing one that others could enter."""
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        path.chmod(PRIVATE_DIR_MODE)
        log.warning(
            "data dir %s was mode %o; tightened to 0700 (it holds the database, keys and tokens)",
            path,
            mode,
        )


def create_private_file(path: Path) -> None:
    """Create `path` empty with mode 0600 if it does not exist; tighten it if it is wider."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    except FileExistsError:
        tighten_file(path)
        return
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)  # the umask only ever removes bits; be explicit anyway
    finally:
        os.close(fd)


def tighten_file(path: Path) -> None:
    """Make an existing file 0600 if other users could read it (logged when changed)."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return
    if mode & 0o077:
        path.chmod(PRIVATE_FILE_MODE)
        log.warning("%s was mode %o; tightened to 0600", path, mode)


def _prepare_sqlite_files(database: Path) -> None:
    """The database file exists with 0600 before SQLite opens it: SQLite creates its files
    0644 (less the umask) and gives its -wal and -shm files the database file's mode."""
    if not database.parent.is_dir():
        return  # SQLite reports the missing directory itself
    create_private_file(database)
    for suffix in _SQLITE_COMPANIONS:
        tighten_file(database.with_name(database.name + suffix))


# -- outages ------------------------------------------------------------------------------------

#: SQLite's messages for a database that cannot be used right now (as opposed to a statement
#: it refuses, such as "no such table", which is a bug).
_SQLITE_OUTAGES = (
    "database is locked",
    "unable to open database file",
    "disk i/o error",
    "database or disk is full",
    "attempt to write a readonly database",
)
#: PostgreSQL SQLSTATE classes of an unusable server: connection exception, insufficient
#: resources (too many connections, disk full), operator intervention (shutdown, crash
#: recovery), system error. Others (a cancelled statement, a lock timeout) are not an outage.
_POSTGRES_OUTAGE_STATES = ("08", "53", "57P", "58")
#: After an outage, the database counts as back once it has worked this long without a failure:
#: a statement that was already in flight when the outage began does not end it.
_SETTLE_SECONDS = 1.0


def is_database_unavailable(error: BaseException) -> bool:
    """Whether `error` means the database cannot be reached or used right now (an outage), as
    opposed to a bug or a refused statement (programming and integrity errors)."""
    return _outage_reason(error) is not None


def is_database_busy(error: BaseException) -> bool:
    """Whether `error` is a wait for the database that ran out, not an outage: no pooled
    connection became free, or SQLite's write lock stayed taken for the whole busy timeout. A
    request that meets it is answered 503 `BUSY`; background work retries it quietly. Neither
    counts as an outage (`DatabaseAvailability`): the database works, it is only saturated."""
    seen: BaseException | None = error
    for _ in range(5):  # follow `raise ... from` a few links, as `_outage_reason` does
        if seen is None:
            return False
        if isinstance(seen, exc.TimeoutError):
            return True
        driver = seen.orig if isinstance(seen, exc.DBAPIError) else seen
        if isinstance(driver, sqlite3.OperationalError) and "is locked" in str(driver).lower():
            return True
        seen = seen.__cause__
    return False


def _outage_reason(error: BaseException) -> str | None:
    """What to call an outage error in the log (class names only, never a message that could
    carry the host or user of the URL); None when `error` is not an outage."""
    seen: BaseException | None = error
    for _ in range(5):  # follow `raise ... from` a few links: a service may wrap the error
        if seen is None:
            return None
        reason = _outage_reason_of(seen)
        if reason is not None:
            return reason
        seen = seen.__cause__
    return None


def _outage_reason_of(error: BaseException) -> str | None:
    name = _qualified(error)
    if isinstance(error, exc.TimeoutError):
        return f"{name}: no pooled connection became free"
    if isinstance(error, exc.DBAPIError):
        driver = error.orig
        if error.connection_invalidated:
            return f"{name}: {_qualified(driver)}, connection lost"
        if isinstance(error, exc.OperationalError | exc.InterfaceError) and (
            driver is None or _driver_outage(driver) is not None
        ):
            return f"{name}: {_qualified(driver)}{_driver_outage(driver) or ''}"
        return None
    if isinstance(error, psycopg.Error | sqlite3.Error):
        detail = _driver_outage(error)
        return None if detail is None else f"{name}{detail}"
    return None


def _driver_outage(driver: BaseException | None) -> str | None:
    """For a driver error that is an outage: what to add to its class name in the log (empty,
    or SQLite's fixed phrase); None for any other error."""
    if isinstance(driver, psycopg.InterfaceError):
        return ""
    if isinstance(driver, psycopg.OperationalError):
        state = driver.sqlstate
        return "" if state is None or state.startswith(_POSTGRES_OUTAGE_STATES) else None
    if isinstance(driver, sqlite3.OperationalError):
        text_ = str(driver).lower()
        for phrase in _SQLITE_OUTAGES:
            if phrase in text_:
                return f": {phrase}"
        return None
    return None


def _qualified(error: BaseException | None) -> str:
    if error is None:
        return "unknown"
    kind = type(error)
    return f"{kind.__module__}.{kind.__qualname__}"


class DatabaseAvailability:
    """Whether the database works, as the last statements found: an outage is logged once when
    it starts (naming the error class) and once when it ends (with its duration), however many
    requests and background loops meet it in between."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._last_failure = 0.0
        self._clear_since: float | None = None
        self._refused = 0
        self._outage_listeners: list[Callable[[], None]] = []

    @property
    def available(self) -> bool:
        return self._down_since is None

    def on_outage(self, listener: Callable[[], None]) -> None:
        """Call `listener` as each outage begins, before it is logged (liveness.ContactGrace
        records where the nodes' grace begins)."""
        self._outage_listeners.append(listener)

    def watch(self, engine: Engine) -> None:
        """Count every statement `engine` completes as proof that the database works."""
        event.listen(engine, "after_cursor_execute", self._statement_completed)

    def failed(self, error: BaseException) -> None:
        """Record an outage error (see `is_database_unavailable`)."""
        now = self._monotonic()
        with self._lock:
            self._last_failure, self._clear_since = now, None
            self._refused += 1
            if self._down_since is not None:
                return
            self._down_since, self._refused = now, 1
        for listener in self._outage_listeners:
            listener()
        log.warning(
            "database unavailable (%s): requests that need it get 503 DATABASE_UNAVAILABLE and "
            "background work waits; known agents' heartbeats are kept in memory. Check that "
            "the database server is running and reachable; the control plane reconnects by "
            "itself",
            _outage_reason(error) or _qualified(error),
        )

    def _statement_completed(self, *_args: object) -> None:
        if self._down_since is None:  # the common case: no lock, no clock
            return
        now = self._monotonic()
        with self._lock:
            if self._down_since is None:
                return
            if self._clear_since is None:
                self._clear_since = now
            if now - self._last_failure < _SETTLE_SECONDS:
                return
            duration = self._clear_since - self._down_since
            refused, self._down_since, self._clear_since = self._refused, None, None
        log.warning(
            "database available again after %.1f s (%d failed attempts during the outage)",
            duration,
            refused,
        )


#: What a read-only SQLite connection may do (`sqlite3` authorizer actions); anything else, a
#: write or a schema change, is refused with "not authorized".
_READ_ACTIONS = frozenset(
    {
        sqlite3.SQLITE_SELECT,
        sqlite3.SQLITE_READ,
        sqlite3.SQLITE_FUNCTION,
        sqlite3.SQLITE_RECURSIVE,
        sqlite3.SQLITE_TRANSACTION,
        sqlite3.SQLITE_SAVEPOINT,
    }
)


def _read_only_authorizer(action: int, *_args: object) -> int:
    return sqlite3.SQLITE_OK if action in _READ_ACTIONS else sqlite3.SQLITE_DENY


def _configure_sqlite(engine: Engine, *, read_only: bool) -> None:
    # A read-only transaction starts deferred: it takes no lock, so it waits for no writer.
    begin = "BEGIN" if read_only else "BEGIN IMMEDIATE"

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the driver so that the BEGIN below is ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()
        if read_only:
            dbapi_connection.set_authorizer(_read_only_authorizer)

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql(begin)


def rowcount(result: object) -> int:
    """Rows matched by an UPDATE/DELETE result (typed access for mypy)."""
    return int(getattr(result, "rowcount", 0) or 0)


def dialect_insert(session: Session, table: Any) -> Any:
    """An INSERT into `table` in the session's dialect (PostgreSQL's or SQLite's), so that an
    upsert's `on_conflict_do_nothing` / `on_conflict_do_update` is written once for both."""
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def ping(*, session: Session) -> None:
    """One round trip to the database (`/api/v1/health`): raises, as any query would, when the
    database does not answer, which the app answers `503 DATABASE_UNAVAILABLE`."""
    session.execute(text("SELECT 1"))


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def alembic_config() -> Config:
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
    create_private_file(sqlite_lock_path)
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
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
