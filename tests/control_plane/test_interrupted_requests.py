"""Requests that end badly for reasons outside the control plane are told apart from its bugs: a
client that cuts off its upload is one INFO line without a traceback (and leaves no file
behind), and the audit log records the code a refused admin request was answered with, a
database outage's `DATABASE_UNAVAILABLE` included, not `INTERNAL_ERROR`."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import psycopg
from sqlalchemy.engine import make_url

from tests.e2e.server import LiveServer
from tests.factories import ADMIN_TOKEN, control_plane


def test_an_upload_cut_off_by_its_client_is_one_line_without_a_traceback(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with LiveServer(data_dir, f"sqlite:///{data_dir / 'cp.db'}") as server:
        head = (
            "POST /api/v1/artifacts HTTP/1.1\r\nHost: modelforge\r\n"
            f"X-ModelForge-Admin-Token: {ADMIN_TOKEN}\r\nContent-Length: 10000000\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(head.encode() + b"a" * 300_000)
            time.sleep(0.5)  # the upload is under way when the client goes
        line = "client disconnected before sending all of POST /api/v1/artifacts"
        deadline = time.monotonic() + 30
        while line not in server.log():
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.1)
        with server.client() as client:  # still serving
            assert client.get("/api/v1/artifacts", headers=server.admin).json() == []
        log = server.log()
        assert "INFO control_plane.app: " + line in log, log[-3000:]
        assert "Traceback" not in log and "ClientDisconnect" not in log, log[-3000:]
        assert " ERROR " not in log, log[-3000:]
        uploads = data_dir / "artifacts" / "tmp"
        assert not uploads.is_dir() or list(uploads.iterdir()) == []  # no partial file


def _backend_waiting_on_a_lock(admin: psycopg.Connection, database: str) -> int:
    deadline = time.monotonic() + 30
    while True:
        row = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
            (database,),
        ).fetchone()
        if row is not None:
            return int(row[0])
        assert time.monotonic() < deadline, "the request never waited on the table lock"
        time.sleep(0.05)


def test_the_audit_records_the_code_of_a_database_outage(
    tmp_path: Path, pg_database_url: str
) -> None:
    url = make_url(pg_database_url)
    libpq = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with control_plane(tmp_path, pg_database_url) as cp, psycopg.connect(libpq) as locker:
        # The secrets table is locked; the audit log is not: the request's statement waits,
        # its connection is then cut (as a database restart would), and the audit entry of the
        # refusal is written on a fresh one.
        locker.execute("LOCK TABLE secrets IN ACCESS EXCLUSIVE MODE")
        answers: list[httpx.Response] = []

        def put() -> None:
            body = {"value": "v" * 32, "labels": {}}
            answers.append(cp.client.put("/api/v1/admin/secrets/S1", headers=cp.admin, json=body))

        request = threading.Thread(target=put)
        request.start()
        with psycopg.connect(libpq, autocommit=True) as admin:
            pid = _backend_waiting_on_a_lock(admin, str(url.database))
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        request.join(timeout=60)
        locker.rollback()
        assert answers and answers[0].status_code == 503, answers and answers[0].text
        assert answers[0].json()["error"]["code"] == "DATABASE_UNAVAILABLE"
        entries = cp.client.get(
            "/api/v1/admin/audit", headers=cp.admin, params={"action": "secret.set"}
        )
        assert entries.status_code == 200, entries.text
        assert [entry["outcome"] for entry in entries.json()] == ["DATABASE_UNAVAILABLE"]
