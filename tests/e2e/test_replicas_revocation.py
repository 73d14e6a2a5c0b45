"""Two real control plane processes (Granian) on one PostgreSQL with one signing key: a node
deleted on replica A is refused by replica B within its revocation refresh — heartbeat, artifact
upload and artifact download — although B had verified and cached the credential as active."""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import httpx
import pytest

from control_plane.fleet.credentials import SIGNING_KEY_FILE
from tests.e2e.server import LiveServer
from tests.factories import heartbeat_body

pytestmark = pytest.mark.e2e

#: B re-reads revocations this often; the refusal must come within a few of them.
REFRESH = 1.0


def test_a_node_deleted_on_one_replica_is_refused_by_the_other(
    tmp_path: Path, pg_database_url: str
) -> None:
    with LiveServer(tmp_path / "a", pg_database_url) as a:
        (tmp_path / "b").mkdir()
        shutil.copy2(tmp_path / "a" / SIGNING_KEY_FILE, tmp_path / "b" / SIGNING_KEY_FILE)
        refresh = {"MODELFORGE_CREDENTIAL_REFRESH_INTERVAL_SECONDS": str(REFRESH)}
        with LiveServer(tmp_path / "b", pg_database_url, env_overrides=refresh) as b:
            enrolled = a.enroll("replicated")
            node = {"Authorization": f"Bearer {enrolled['credential']}"}
            data = b"made on the node, kept on replica B"
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            with b.client() as on_b:
                # B verifies the credential and caches it as active.
                assert on_b.post(
                    "/api/v1/agent/heartbeat", headers=node, json=heartbeat_body()
                ).is_success
                uploaded = on_b.put(f"/api/v1/agent/artifacts/{digest}", headers=node, content=data)
                assert uploaded.status_code == 201, uploaded.text
                assert on_b.get(f"/api/v1/agent/artifacts/{digest}", headers=node).content == data

                with a.client() as on_a:
                    deleted = on_a.delete(
                        f"/api/v1/admin/nodes/{enrolled['node_id']}", headers=a.admin
                    )
                assert deleted.status_code == 204
                deleted_at = time.monotonic()
                while True:
                    beat = on_b.post("/api/v1/agent/heartbeat", headers=node, json=heartbeat_body())
                    if beat.status_code != 200 or time.monotonic() - deleted_at > 10 * REFRESH:
                        break
                    time.sleep(0.05)
                waited = time.monotonic() - deleted_at
                refusals: list[httpx.Response] = [
                    beat,
                    on_b.put(f"/api/v1/agent/artifacts/{digest}", headers=node, content=data),
                    on_b.get(f"/api/v1/agent/artifacts/{digest}", headers=node),
                ]
    for refused in refusals:
        assert refused.status_code == 403, (refused.request.method, refused.text)
        assert refused.json()["error"]["code"] == "CREDENTIAL_REVOKED"
    # One refresh, its jitter and a loaded machine; before the fix it was never.
    assert waited < 5 * REFRESH, f"replica B refused the deleted node only after {waited:.1f} s"
