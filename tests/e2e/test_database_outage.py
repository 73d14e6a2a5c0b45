"""A PostgreSQL outage under a real control plane (Granian) on a PostgreSQL cluster this test
starts and stops itself: 503 DATABASE_UNAVAILABLE with a next step instead of 500, one log line
when the outage starts and one when it ends (no tracebacks), agents answered from memory, and
recovery without a restart, with nothing written before or during the outage lost."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import exc, text

from control_plane.db import is_database_unavailable, make_engine, migrate
from tests.e2e.server import FAST, LiveServer, free_port
from tests.factories import heartbeat_body

pytestmark = pytest.mark.e2e

_PASSWORD = "pg-outage-" + os.urandom(8).hex()
_OUTAGE_STARTED = re.compile(r"database unavailable \(")
_OUTAGE_ENDED = re.compile(r"database available again after [0-9.]+ s")


def _postgres_bin() -> Path:
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not candidates:
        pytest.fail(
            "the PostgreSQL server programs (initdb, pg_ctl) are not installed under "
            "/usr/lib/postgresql; run scripts/ensure-postgres",
            pytrace=False,
        )
    return candidates[-1].parent


@dataclass
class PrivatePostgres:
    """A PostgreSQL cluster of this test alone, on its own port and socket directory."""

    root: Path
    port: int
    bin_dir: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres:{_PASSWORD}@127.0.0.1:{self.port}/postgres"

    @property
    def conninfo(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres password={_PASSWORD} dbname=postgres"

    def _run(self, *argv: str) -> None:
        # PostgreSQL refuses to run as root: as root, run its programs as the postgres user.
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        result = subprocess.run(  # noqa: S603 - fixed programs, arguments of this test
            [*prefix, *argv], capture_output=True, text=True, timeout=120, check=False
        )
        assert result.returncode == 0, f"{argv[0]} failed: {result.stdout}{result.stderr}"

    def init(self) -> None:
        password_file = self.root / "password"
        password_file.write_text(_PASSWORD + "\n")
        self._run(
            str(self.bin_dir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            f"--pwfile={password_file}",
            "--no-sync",
        )
        password_file.unlink()

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            str(self.bin_dir / "pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.root / "postgres.log"),
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self) -> None:
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    # Not under pytest's tmp_path: the postgres user must be able to reach the directory.
    root = Path(tempfile.mkdtemp(prefix="modelforge-pg-outage-"))
    if os.geteuid() == 0:
        shutil.chown(root, user="postgres", group="postgres")
    server = PrivatePostgres(root=root, port=free_port(), bin_dir=_postgres_bin())
    try:
        server.init()
        server.start()
        yield server
    finally:
        if server.running():
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _stored_heartbeat(db: PrivatePostgres, node_id: str) -> datetime | None:
    with psycopg.connect(db.conninfo, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT last_heartbeat_at FROM nodes WHERE id = %s", (node_id,)
        ).fetchone()
    assert row is not None
    stored = row[0]
    assert stored is None or isinstance(stored, datetime)
    return stored


def _unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "DATABASE_UNAVAILABLE"
    assert "reconnects by itself" in error["next_step"]
    assert _PASSWORD not in response.text and "postgresql" not in response.text.lower()


def test_database_outage_is_503_logged_once_and_recovers(
    tmp_path: Path, private_postgres: PrivatePostgres
) -> None:
    db = private_postgres
    with (
        LiveServer(tmp_path / "data", db.url, env_overrides=FAST) as server,
        server.client() as client,
    ):
        enrolled = server.enroll("outage-host")
        node_id = enrolled["node_id"]
        agent = {"Authorization": f"Bearer {enrolled['credential']}"}
        assert (
            client.post("/api/v1/agent/heartbeat", headers=agent, json=heartbeat_body())
        ).status_code == 200
        before = server.mint(display_name="minted-before-outage")
        deadline = time.monotonic() + 10
        while _stored_heartbeat(db, node_id) is None:
            assert time.monotonic() < deadline, "the first heartbeat never reached the database"
            time.sleep(0.1)
        stored_before = _stored_heartbeat(db, node_id)
        assert stored_before is not None
        log_before = len(server.log().splitlines())

        db.stop()
        last_sent = datetime.now(UTC)
        outage_end = time.monotonic() + 3.0  # long enough for every background loop to fail
        while time.monotonic() < outage_end:
            last_sent = datetime.now(UTC)
            beat = client.post("/api/v1/agent/heartbeat", headers=agent, json=heartbeat_body())
            assert beat.status_code == 200, beat.text
            _unavailable(client.get("/api/v1/health"))
            _unavailable(
                client.post(
                    "/api/v1/admin/node-enrollments",
                    headers=server.admin,
                    json={"display_name": "during-outage", "expires_in_seconds": 900},
                )
            )
            _unavailable(client.get(f"/api/v1/admin/nodes/{node_id}", headers=server.admin))
            time.sleep(0.2)
        during = server.log().splitlines()[log_before:]
        assert not [line for line in during if "Traceback" in line], "\n".join(during)
        assert len([line for line in during if _OUTAGE_STARTED.search(line)]) == 1, during
        # Nothing else at warning level or above: the loops and the requests stay quiet.
        loud = [line for line in during if re.search(r"\b(WARNING|ERROR|CRITICAL)\b", line)]
        assert len(loud) == 1, "\n".join(loud)

        db.start()
        deadline = time.monotonic() + 15
        while (health := client.get("/api/v1/health")).status_code != 200:
            assert time.monotonic() < deadline, f"not healthy after the restart: {health.text}"
            time.sleep(0.2)
        assert server.process is not None and server.process.poll() is None  # never restarted

        # The heartbeats answered during the outage reach the database after it.
        deadline = time.monotonic() + 10
        while (stored := _stored_heartbeat(db, node_id)) is None or stored < last_sent:
            assert time.monotonic() < deadline, f"outage heartbeats lost: {stored} < {last_sent}"
            time.sleep(0.1)
        assert stored > stored_before
        kept = server.get(f"/api/v1/admin/node-enrollments/{before['enrollment_id']}")
        assert kept["state"] == "pending"
        after = server.mint(display_name="minted-after-outage")
        names = {e["display_name"] for e in server.get("/api/v1/admin/node-enrollments")}
        assert {"minted-before-outage", "minted-after-outage"} <= names
        assert "during-outage" not in names

        deadline = time.monotonic() + 10
        while not [line for line in server.log().splitlines() if _OUTAGE_ENDED.search(line)]:
            assert time.monotonic() < deadline, "the end of the outage was never logged"
            time.sleep(0.1)
        whole = server.log()
        assert len(_OUTAGE_ENDED.findall(whole)) == 1
        assert len(_OUTAGE_STARTED.findall(whole)) == 1
        assert "Traceback" not in whole
        assert _PASSWORD not in whole
        assert after["enrollment_id"] != before["enrollment_id"]


def _raised(engine_url: str, statement: str, *, migrated: bool = False) -> BaseException:
    engine = make_engine(engine_url)
    try:
        if migrated:
            migrate(engine)
        with engine.begin() as conn:
            conn.execute(text(statement))
    except Exception as error:
        return error
    finally:
        engine.dispose()
    raise AssertionError(f"{statement!r} did not fail")


def test_outages_are_told_from_bugs(database_url: str) -> None:
    """Connection-level failures are an outage (503); a statement the database refuses is a
    bug (500), however the driver classes it."""
    bad_sql = _raised(database_url, "SELECT * FROM no_such_table")
    assert not is_database_unavailable(bad_sql)
    duplicate = _raised(
        database_url,
        "INSERT INTO signing_keys (kid, public_key_pem, created_at) "
        "SELECT kid, public_key_pem, created_at FROM signing_keys "
        "UNION ALL SELECT 'k', 'p', CURRENT_TIMESTAMP UNION ALL SELECT 'k', 'p', CURRENT_TIMESTAMP",
        migrated=True,
    )
    assert isinstance(duplicate, exc.IntegrityError)
    assert not is_database_unavailable(duplicate)
    refused = _raised(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres", "SELECT 1")
    assert isinstance(refused, exc.OperationalError)
    assert is_database_unavailable(refused)
    assert is_database_unavailable(exc.TimeoutError("QueuePool limit reached"))


def test_a_killed_connection_is_an_outage(pg_database_url: str) -> None:
    engine = make_engine(pg_database_url)
    try:
        with engine.connect() as victim:
            pid = victim.execute(text("SELECT pg_backend_pid()")).scalar_one()
            with engine.connect() as killer:
                killer.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            with pytest.raises(exc.DBAPIError) as lost:
                victim.execute(text("SELECT 1"))
        assert is_database_unavailable(lost.value)
        # The pool replaces the dead connection by itself.
        with engine.connect() as fresh:
            assert fresh.execute(text("SELECT 1")).scalar_one() == 1
    finally:
        engine.dispose()


def test_a_locked_sqlite_database_is_an_outage(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("CREATE TABLE t (x INTEGER)")
        holder.execute("BEGIN IMMEDIATE")
        waiter = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            with pytest.raises(sqlite3.OperationalError) as locked:
                waiter.execute("BEGIN IMMEDIATE")
        finally:
            waiter.close()
        assert is_database_unavailable(locked.value)
    finally:
        holder.close()
