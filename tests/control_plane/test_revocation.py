"""Revocation is durable and reaches requests already waiting: a deleted node's credential stays
revoked for every replica, and a long poll (work claim, cancellation watch) parked when its
credential is revoked ends with CREDENTIAL_REVOKED instead of being handed work. SQLite and
PostgreSQL; two in-process replicas on one PostgreSQL for what crosses processes."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select

from control_plane.models import NodeCredential
from tests.factories import PYTHON_JOB, ControlPlane, control_plane, heartbeat_body, two_replicas


def _assert_revoked(response: Any) -> None:
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == "CREDENTIAL_REVOKED"


class _Parked:
    """A long poll running on a thread of its own: its response once it ends."""

    def __init__(self, cp: ControlPlane, path: str, headers: dict[str, str], body: Any) -> None:
        self.response: Any = None
        self._thread = threading.Thread(
            target=lambda: setattr(
                self, "response", cp.client.post(path, headers=headers, json=body)
            )
        )
        self._thread.start()
        time.sleep(0.5)  # parked in its long poll
        assert self.response is None, "the long poll answered before it was parked"

    def result(self, timeout: float = 20) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the long poll never answered"
        return self.response


def _job_state(cp: ControlPlane, job_id: str) -> dict[str, Any]:
    response = cp.client.get(f"/api/v1/jobs/{job_id}", headers=cp.admin)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_a_waiting_claim_ends_when_its_credential_is_revoked(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = cp.ready_node()
        started = time.monotonic()
        parked = _Parked(cp, "/api/v1/agent/work/claim", node.headers, {"hold_seconds": 30})
        revoked = cp.client.post(
            f"/api/v1/admin/nodes/{node.node_id}/credential/revoke", headers=cp.admin
        )
        assert revoked.status_code == 200, revoked.text
        job = cp.client.post("/api/v1/jobs", headers=cp.admin, json=PYTHON_JOB).json()
        response = parked.result()
        _assert_revoked(response)
        assert time.monotonic() - started < 15  # woken by the submission, not the 30 s hold
        state = _job_state(cp, job["job_id"])
        assert state["state"] == "queued" and state["node_id"] is None


def test_a_waiting_claim_ends_when_its_node_is_deleted(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = cp.ready_node()
        parked = _Parked(cp, "/api/v1/agent/work/claim", node.headers, {"hold_seconds": 30})
        deleted = cp.client.delete(f"/api/v1/admin/nodes/{node.node_id}", headers=cp.admin)
        assert deleted.status_code == 204, deleted.text
        job = cp.client.post("/api/v1/jobs", headers=cp.admin, json=PYTHON_JOB).json()
        response = parked.result()
        _assert_revoked(response)
        assert _job_state(cp, job["job_id"])["state"] == "queued"


def test_a_waiting_watch_ends_when_its_credential_is_revoked(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = cp.ready_node()
        running = cp.client.post("/api/v1/jobs", headers=cp.admin, json=PYTHON_JOB).json()
        claimed = cp.client.post(
            "/api/v1/agent/work/claim", headers=node.headers, json={"hold_seconds": 0}
        )
        assert claimed.status_code == 200 and claimed.json()["job_id"] == running["job_id"]
        parked = _Parked(
            cp,
            "/api/v1/agent/jobs/watch",
            node.headers,
            {"job_ids": [running["job_id"]], "hold_seconds": 30},
        )
        cp.client.post(f"/api/v1/admin/nodes/{node.node_id}/credential/revoke", headers=cp.admin)
        cp.client.post("/api/v1/jobs", headers=cp.admin, json=PYTHON_JOB)  # any job change wakes it
        response = parked.result()
        _assert_revoked(response)


def test_a_claim_waiting_on_another_replica_ends_once_it_refreshed(
    tmp_path: Path, pg_database_url: str
) -> None:
    with two_replicas(tmp_path, pg_database_url) as (a, b):
        node = b.ready_node()
        parked = _Parked(b, "/api/v1/agent/work/claim", node.headers, {"hold_seconds": 30})
        a.client.post(f"/api/v1/admin/nodes/{node.node_id}/credential/revoke", headers=a.admin)
        b.ctx.authority.refresh()  # the app runs it every second
        job = a.client.post("/api/v1/jobs", headers=a.admin, json=PYTHON_JOB).json()
        response = parked.result()  # woken by NOTIFY from replica A
        _assert_revoked(response)
        assert _job_state(a, job["job_id"])["state"] == "queued"


def test_deleting_a_node_keeps_its_credentials_revoked(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = cp.ready_node()
        deleted = cp.client.delete(f"/api/v1/admin/nodes/{node.node_id}", headers=cp.admin)
        assert deleted.status_code == 204
        with cp.ctx.session_factory() as session:
            rows = list(
                session.scalars(
                    select(NodeCredential).where(NodeCredential.node_id == node.node_id)
                )
            )
        assert len(rows) == 1
        assert rows[0].revoked_at is not None and rows[0].revoked_reason == "node deleted"
        refused = cp.client.post(
            "/api/v1/agent/heartbeat", headers=node.headers, json=heartbeat_body()
        )
        _assert_revoked(refused)


def test_a_node_deleted_on_one_replica_is_refused_by_the_other(
    tmp_path: Path, pg_database_url: str
) -> None:
    with two_replicas(tmp_path, pg_database_url) as (a, b):
        node = b.ready_node()  # replica B holds the credential as verified and active
        a.clock.advance(5)
        deleted = a.client.delete(f"/api/v1/admin/nodes/{node.node_id}", headers=a.admin)
        assert deleted.status_code == 204
        b.ctx.authority.refresh()
        refused = b.client.post(
            "/api/v1/agent/heartbeat", headers=node.headers, json=heartbeat_body()
        )
        _assert_revoked(refused)
