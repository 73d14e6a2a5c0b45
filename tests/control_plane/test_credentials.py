"""A restarted control plane (same database, same data dir) knows which credentials are active
from one query at start: the first heartbeats of a whole fleet cost no database statement each,
and revocations still win — one made before the restart, and one another process commits after
it, picked up by `refresh`. SQLite and PostgreSQL."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event, update

from control_plane.models import NodeCredential
from tests.factories import control_plane, heartbeat_body

NODES = 60
_NOT_COUNTED = re.compile(r"\bjobs\b|^BEGIN IMMEDIATE$")


@contextmanager
def _statements(engine: Engine) -> Iterator[list[str]]:
    """The statements run on `engine` meanwhile, but for the job scheduler's, which re-reads
    the queue on its own (at start and every 30 s) whatever the heartbeats do, and SQLite's
    `BEGIN IMMEDIATE` (a transaction's statements are counted themselves)."""
    seen: list[str] = []

    def count(*args: Any) -> None:
        if not _NOT_COUNTED.search(args[2]):
            seen.append(args[2])

    event.listen(engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", count)


def _revoked(response: Any) -> bool:
    return bool(
        response.status_code == 403 and response.json()["error"]["code"] == "CREDENTIAL_REVOKED"
    )


def test_first_heartbeats_after_a_restart_cost_no_query_per_node(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        credentials = [cp.enroll()["credential"] for _ in range(NODES)]
    with control_plane(tmp_path, database_url) as cp:  # the restart
        counts, seen = [], []
        for group in (credentials[:10], credentials[10:]):
            with _statements(cp.ctx.engine) as statements:
                for credential in group:
                    assert cp.heartbeat(credential).status_code == 200
            counts.append(len(statements))
            seen.append(statements)
        # 50 nodes' first heartbeats cost no more statements than 10 did: none.
        assert counts == [0, 0], seen
        assert len(cp.ctx.heartbeats) == NODES


def test_a_credential_revoked_before_the_restart_stays_refused(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        kept, revoked = cp.enroll(), cp.enroll()
        response = cp.client.post(
            f"/api/v1/admin/nodes/{revoked['node_id']}/credential/revoke", headers=cp.admin
        )
        assert response.status_code == 200, response.text
    with control_plane(tmp_path, database_url) as cp:
        assert cp.heartbeat(kept["credential"]).status_code == 200
        assert _revoked(cp.heartbeat(revoked["credential"]))


def test_a_revocation_committed_elsewhere_after_the_restart_is_picked_up(
    tmp_path: Path, database_url: str
) -> None:
    """The credential was active at start and never used since: only the start-up load knew it,
    and `refresh` must still end it."""
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
    with control_plane(tmp_path, database_url) as cp:
        cp.clock.advance(3)
        with cp.ctx.session_factory.begin() as session:  # as another replica would
            session.execute(
                update(NodeCredential)
                .where(NodeCredential.node_id == enrolled["node_id"])
                .values(revoked_at=cp.clock.now(), revoked_reason="revoked elsewhere")
            )
        cp.clock.advance(1)
        cp.ctx.authority.refresh()  # the app runs it every second
        assert _revoked(cp.heartbeat(enrolled["credential"]))


# -- lifetimes (CR-3) ---------------------------------------------------------------------------


def test_a_credential_expires_after_its_lifetime(tmp_path: Path, database_url: str) -> None:
    """Enrollment-issued credentials last MODELFORGE_CREDENTIAL_LIFETIME_DAYS: until then every
    call is accepted (also from the verification cache and the fast path), after it every call
    is refused with CREDENTIAL_EXPIRED and the next step."""
    with control_plane(tmp_path, database_url, credential_lifetime_days=2) as cp:
        node = cp.ready_node()
        issued = cp.clock.now()
        view = cp.node(node.node_id)
        assert view["credential_expires_at"] is not None
        listed = cp.client.get("/api/v1/admin/credentials", headers=cp.admin).json()
        (entry,) = listed
        assert entry["node_id"] == node.node_id and entry["issuer"] == "enrollment"
        assert entry["revoked_at"] is None
        expires = entry["expires_at"]
        assert expires == view["credential_expires_at"]
        assert abs(_seconds(expires) - (issued.timestamp() + 2 * 86400)) < 2

        cp.clock.advance(2 * 86400 - 60)
        assert cp.client.post(
            "/api/v1/agent/heartbeat", headers=node.headers, json=heartbeat_body()
        ).is_success
        cp.clock.advance(120)
        for method, path, body in (
            ("POST", "/api/v1/agent/heartbeat", heartbeat_body()),
            ("POST", "/api/v1/agent/work/claim", {"hold_seconds": 0}),
            ("POST", "/api/v1/agent/services/sync", {}),
        ):
            refused = cp.client.request(method, path, headers=node.headers, json=body)
            assert refused.status_code == 401, (path, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "CREDENTIAL_EXPIRED" and "enroll" in error["next_step"]
            assert node.headers["Authorization"].split()[1] not in refused.text


def test_revoking_one_jti_refuses_that_credential_and_no_other(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        first, second = cp.ready_node(), cp.ready_node()
        credentials = cp.client.get(
            "/api/v1/admin/credentials", headers=cp.admin, params={"node_id": first.node_id}
        ).json()
        (jti,) = [entry["jti"] for entry in credentials]
        revoked = cp.client.post(f"/api/v1/admin/credentials/{jti}/revoke", headers=cp.admin)
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
        refused = cp.heartbeat(first.headers["Authorization"].split()[1])
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "CREDENTIAL_REVOKED"
        assert cp.heartbeat(second.headers["Authorization"].split()[1]).is_success
        unknown = cp.client.post("/api/v1/admin/credentials/jti_nope/revoke", headers=cp.admin)
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "CREDENTIAL_NOT_FOUND"
        active = cp.client.get(
            "/api/v1/admin/credentials", headers=cp.admin, params={"active": "true"}
        ).json()
        assert [entry["node_id"] for entry in active] == [second.node_id]
        audit = cp.client.get("/api/v1/admin/audit", headers=cp.admin).json()
        outcomes = [(e["action"], e["target"], e["outcome"]) for e in audit[:2]]
        assert outcomes == [
            ("credential.revoke", "jti_nope", "CREDENTIAL_NOT_FOUND"),
            ("credential.revoke", jti, "ok"),
        ]


def _seconds(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text).timestamp()
