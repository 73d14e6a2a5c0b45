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
from tests.factories import control_plane

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
