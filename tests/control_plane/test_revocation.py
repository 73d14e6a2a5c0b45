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
from tests.factories import ControlPlane, control_plane, heartbeat_body, inventory_body

JOB = {
    "entrypoint": {
        "kind": "python",
        "module": "m",
        "function": "f",
        "source": {"m.py": "def f():\n    return 1\n"},
    }
}


def _ready_node(cp: ControlPlane) -> dict[str, Any]:
    enrolled = cp.enroll()
    headers = cp.agent(enrolled["credential"])
    assert cp.client.put(
        "/api/v1/agent/inventory", headers=headers, json=inventory_body()
    ).is_success
    assert cp.client.post(
        "/api/v1/agent/heartbeat", headers=headers, json=heartbeat_body()
    ).is_success
    cp.flush()
    return {"node_id": enrolled["node_id"], "headers": headers}


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
        node = _ready_node(cp)
        started = time.monotonic()
        parked = _Parked(cp, "/api/v1/agent/work/claim", node["headers"], {"hold_seconds": 30})
        revoked = cp.client.post(
            f"/api/v1/admin/nodes/{node['node_id']}/credential/revoke", headers=cp.admin
        )
        assert revoked.status_code == 200, revoked.text
        job = cp.client.post("/api/v1/jobs", headers=cp.admin, json=JOB).json()
        response = parked.result()
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == "CREDENTIAL_REVOKED"
        assert time.monotonic() - started < 15  # woken by the submission, not the 30 s hold
        state = _job_state(cp, job["job_id"])
        assert state["state"] == "queued" and state["node_id"] is None


def test_a_waiting_claim_ends_when_its_node_is_deleted(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _ready_node(cp)
        parked = _Parked(cp, "/api/v1/agent/work/claim", node["headers"], {"hold_seconds": 30})
        deleted = cp.client.delete(f"/api/v1/admin/nodes/{node['node_id']}", headers=cp.admin)
        assert deleted.status_code == 204, deleted.text
        job = cp.client.post("/api/v1/jobs", headers=cp.admin, json=JOB).json()
        response = parked.result()
        assert response.json()["error"]["code"] == "CREDENTIAL_REVOKED"
        assert _job_state(cp, job["job_id"])["state"] == "queued"


def test_a_waiting_watch_ends_when_its_credential_is_revoked(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _ready_node(cp)
        running = cp.client.post("/api/v1/jobs", headers=cp.admin, json=JOB).json()
        claimed = cp.client.post(
            "/api/v1/agent/work/claim", headers=node["headers"], json={"hold_seconds": 0}
        )
        assert claimed.status_code == 200 and claimed.json()["job_id"] == running["job_id"]
        parked = _Parked(
            cp,
            "/api/v1/agent/jobs/watch",
            node["headers"],
            {"job_ids": [running["job_id"]], "hold_seconds": 30},
        )
        cp.client.post(f"/api/v1/admin/nodes/{node['node_id']}/credential/revoke", headers=cp.admin)
        cp.client.post("/api/v1/jobs", headers=cp.admin, json=JOB)  # any job change wakes it
        response = parked.result()
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == "CREDENTIAL_REVOKED"


def test_a_claim_waiting_on_another_replica_ends_once_it_refreshed(
    tmp_path: Path, pg_database_url: str
) -> None:
    with (
        control_plane(tmp_path / "a", pg_database_url) as a,
        control_plane(tmp_path / "b", pg_database_url, clock=a.clock) as b,
    ):
        node = _ready_node(b)
        parked = _Parked(b, "/api/v1/agent/work/claim", node["headers"], {"hold_seconds": 30})
        a.client.post(f"/api/v1/admin/nodes/{node['node_id']}/credential/revoke", headers=a.admin)
        b.ctx.authority.refresh()  # the app runs it every second
        job = a.client.post("/api/v1/jobs", headers=a.admin, json=JOB).json()
        response = parked.result()  # woken by NOTIFY from replica A
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == "CREDENTIAL_REVOKED"
        assert _job_state(a, job["job_id"])["state"] == "queued"


def test_deleting_a_node_keeps_its_credentials_revoked(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _ready_node(cp)
        deleted = cp.client.delete(f"/api/v1/admin/nodes/{node['node_id']}", headers=cp.admin)
        assert deleted.status_code == 204
        with cp.ctx.session_factory() as session:
            rows = list(
                session.scalars(
                    select(NodeCredential).where(NodeCredential.node_id == node["node_id"])
                )
            )
        assert len(rows) == 1
        assert rows[0].revoked_at is not None and rows[0].revoked_reason == "node deleted"
        refused = cp.client.post(
            "/api/v1/agent/heartbeat", headers=node["headers"], json=heartbeat_body()
        )
        assert refused.json()["error"]["code"] == "CREDENTIAL_REVOKED"


def test_a_node_deleted_on_one_replica_is_refused_by_the_other(
    tmp_path: Path, pg_database_url: str
) -> None:
    with (
        control_plane(tmp_path / "a", pg_database_url) as a,
        control_plane(tmp_path / "b", pg_database_url, clock=a.clock) as b,
    ):
        node = _ready_node(b)  # replica B holds the credential as verified and active
        a.clock.advance(5)
        deleted = a.client.delete(f"/api/v1/admin/nodes/{node['node_id']}", headers=a.admin)
        assert deleted.status_code == 204
        b.ctx.authority.refresh()
        refused = b.client.post(
            "/api/v1/agent/heartbeat", headers=node["headers"], json=heartbeat_body()
        )
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "CREDENTIAL_REVOKED"
