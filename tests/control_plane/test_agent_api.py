"""Agent API: credentials, compatibility, inventory and telemetry, duplicate identities. SQLite
and PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from control_plane.models import NodeCredential
from tests.factories import control_plane, inventory_body, telemetry_body


def _active_credentials(cp: Any, node_id: str) -> int:
    with cp.ctx.session_factory() as session:
        return int(
            session.scalar(
                select(func.count()).where(
                    NodeCredential.node_id == node_id, NodeCredential.revoked_at.is_(None)
                )
            )
            or 0
        )


def test_enroll_returns_credential_and_intervals(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url, heartbeat_interval_seconds=7) as cp:
        enrolled = cp.enroll()
        assert enrolled["heartbeat_interval_seconds"] == 7
        assert enrolled["telemetry_interval_seconds"] == 15
        assert enrolled["credential"].count(".") == 2
        assert _active_credentials(cp, enrolled["node_id"]) == 1
        ok = cp.heartbeat(enrolled["credential"])
        assert ok.status_code == 200
        assert ok.json()["compatibility"] == {
            "status": "compatible",
            "protocol_version": 1,
            "accepted": [1],
        }
        assert ok.json()["heartbeat_interval_seconds"] == 7


@pytest.mark.parametrize(
    ("protocol", "code"),
    [
        (0, "TOO_OLD"),
        (2, "TOO_NEW"),
        (None, "UNKNOWN"),
        ("x", "UNKNOWN"),
        (True, "UNKNOWN"),
        (1.5, "UNKNOWN"),
    ],
)
def test_protocol_mismatch_is_426(
    tmp_path: Path, database_url: str, protocol: Any, code: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        response = cp.heartbeat(enrolled["credential"], protocol=protocol)
        assert response.status_code == 426
        error = response.json()["error"]
        assert error["code"] == code and error["component"] == "agent"
        assert error["next_step"]
        node = cp.node(enrolled["node_id"])
        assert node["needs_upgrade"]["code"] == code
        # Listed as Needs upgrade until it attaches again compatibly.
        cp.clock.advance(1)
        assert cp.heartbeat(enrolled["credential"]).status_code == 200
        cp.flush()
        assert cp.node(enrolled["node_id"])["needs_upgrade"] is None


def test_missing_protocol_on_enroll_is_unknown(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        token = cp.mint()["token"]
        response = cp.client.post(
            "/api/v1/agent/enroll",
            json={
                "token": token,
                "claim_nonce": "n" * 20,
                "hostname": "h",
                "agent_version": "0.1.0",
            },
        )
        assert response.status_code == 426
        assert response.json()["error"]["code"] == "UNKNOWN"


def test_incompatible_runtime_worker_is_426_and_flagged(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        headers = cp.agent(enrolled["credential"])
        response = cp.client.put(
            "/api/v1/agent/inventory", headers=headers, json=inventory_body(worker_protocol=2)
        )
        assert response.status_code == 426
        assert response.json()["error"]["component"] == "runtime-worker"
        assert cp.node(enrolled["node_id"])["needs_upgrade"]["component"] == "runtime-worker"
        assert cp.node(enrolled["node_id"])["inventory"] is None  # refused input changes nothing
        fixed = cp.client.put("/api/v1/agent/inventory", headers=headers, json=inventory_body())
        assert fixed.status_code == 200
        assert cp.node(enrolled["node_id"])["needs_upgrade"] is None


def test_credential_errors(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        body = {
            "protocol_version": 1,
            "agent_version": "0.1.0",
            "health": {"status": "healthy", "preflight": "passed"},
        }
        cases = {
            "CREDENTIAL_MISSING": {},
            "CREDENTIAL_INVALID": {"Authorization": "Bearer not.a.jwt"},
        }
        for code, headers in cases.items():
            response = cp.client.post("/api/v1/agent/heartbeat", headers=headers, json=body)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == code
        head, claims, signature = enrolled["credential"].split(".")
        forged = f"{head}.{claims}.{signature[::-1]}"
        response = cp.client.post("/api/v1/agent/heartbeat", headers=cp.agent(forged), json=body)
        assert response.json()["error"]["code"] == "CREDENTIAL_INVALID"


def test_revoked_credential_is_refused_on_next_request(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        credential, node_id = enrolled["credential"], enrolled["node_id"]
        assert cp.heartbeat(credential).status_code == 200
        revoke = cp.client.post(
            f"/api/v1/admin/nodes/{node_id}/credential/revoke", headers=cp.admin
        )
        assert revoke.json() == {"node_id": node_id, "revoked": 1}
        for response in (
            cp.heartbeat(credential),
            cp.client.put(
                "/api/v1/agent/inventory", headers=cp.agent(credential), json=inventory_body()
            ),
            cp.client.post(
                "/api/v1/agent/telemetry", headers=cp.agent(credential), json=telemetry_body()
            ),
        ):
            assert response.status_code == 403
            assert response.json()["error"]["code"] == "CREDENTIAL_REVOKED"
        assert _active_credentials(cp, node_id) == 0
        assert any(e["kind"] == "credential_revoked" for e in cp.events(node_id))


def test_revocation_seen_by_a_second_process(tmp_path: Path, pg_database_url: str) -> None:
    """A replica that cached the credential as active learns of the revocation on refresh."""
    database_url = pg_database_url
    with control_plane(tmp_path / "a", database_url) as a:
        enrolled = a.enroll()
        with control_plane(tmp_path / "b", database_url, clock=a.clock) as b:
            assert b.heartbeat(enrolled["credential"]).status_code == 200
            a.client.post(
                f"/api/v1/admin/nodes/{enrolled['node_id']}/credential/revoke", headers=a.admin
            )
            b.ctx.authority.refresh()
            assert b.heartbeat(enrolled["credential"]).json()["error"]["code"] == (
                "CREDENTIAL_REVOKED"
            )


def test_signing_key_rotation_refuses_every_old_credential(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        first, second = cp.enroll(), cp.enroll()
        key_file = tmp_path / "signing-key.pem"
        old_key = key_file.read_bytes()
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        rotated = cp.client.post("/api/v1/admin/signing-key/rotate", headers=cp.admin)
        assert rotated.status_code == 200
        assert rotated.json()["revoked_credentials"] == 2
        assert key_file.read_bytes() != old_key
        for enrolled in (first, second):
            response = cp.heartbeat(enrolled["credential"])
            assert response.status_code == 403
            assert response.json()["error"]["code"] == "CREDENTIAL_REVOKED"
        # New enrollments work with the new key.
        assert cp.heartbeat(cp.enroll()["credential"]).status_code == 200


def test_inventory_and_telemetry_are_stored_without_invention(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        headers = cp.agent(enrolled["credential"])
        inv = cp.client.put(
            "/api/v1/agent/inventory", headers=headers, json=inventory_body(mode="nvidia")
        )
        assert inv.status_code == 200
        sample = telemetry_body()
        tel = cp.client.post("/api/v1/agent/telemetry", headers=headers, json=sample)
        assert tel.status_code == 200
        node = cp.node(enrolled["node_id"])
        assert node["inventory"]["gpus"][0]["uuid"] == "GPU-0000-aaaa"
        assert node["inventory"]["accelerator_mode"] == "nvidia"
        gpu = node["telemetry"]["gpus"][0]
        assert gpu["utilization_percent"] == 37.0 and gpu["power_draw_w"] == 120.5
        # A field the agent could not read stays absent, never becomes zero.
        assert "power_limit_w" not in gpu and "ecc_volatile_corrected" not in gpu
        assert node["telemetry"]["host"]["cpu_percent"] == 12.5


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b["gpus"][0].update(utilization_percent=140),
        lambda b: b["gpus"][0].update(memory_used_mb=-1),
        lambda b: b.update(extra_field=1),
        lambda b: b["gpus"][0].pop("uuid"),
    ],
)
def test_bad_telemetry_is_refused_and_changes_nothing(
    tmp_path: Path, database_url: str, mutate: Any
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        body = telemetry_body()
        mutate(body)
        response = cp.client.post(
            "/api/v1/agent/telemetry", headers=cp.agent(enrolled["credential"]), json=body
        )
        assert response.status_code == 422
        assert response.json()["error"]["code"] == "INVALID_REQUEST"
        assert cp.node(enrolled["node_id"])["telemetry"] is None


def test_duplicate_fingerprint_flags_both_nodes(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        fingerprint = {"machine_id": "m-123", "gpu_uuids": ["GPU-b", "GPU-a"]}
        first = cp.enroll(fingerprint=fingerprint)
        other = cp.enroll(fingerprint={"machine_id": "m-999", "gpu_uuids": []})
        assert cp.node(first["node_id"])["duplicate_identity"] is None
        second = cp.enroll(fingerprint={"machine_id": "m-123", "gpu_uuids": ["GPU-a", "GPU-b"]})
        a, b = cp.node(first["node_id"]), cp.node(second["node_id"])
        assert a["duplicate_identity"]["other_node_ids"] == [second["node_id"]]
        assert b["duplicate_identity"]["other_node_ids"] == [first["node_id"]]
        assert "state volume" in a["duplicate_identity"]["message"]
        assert "MODELFORGE_AGENT_STATE_VOLUME" in a["duplicate_identity"]["next_step"]
        assert cp.node(other["node_id"])["duplicate_identity"] is None
        assert any(e["kind"] == "duplicate_identity" for e in cp.events(first["node_id"]))
        # Deleting the stale identity clears the flag on the survivor.
        deleted = cp.client.delete(f"/api/v1/admin/nodes/{first['node_id']}", headers=cp.admin)
        assert deleted.status_code == 204
        assert cp.node(second["node_id"])["duplicate_identity"] is None
        assert cp.heartbeat(first["credential"]).json()["error"]["code"] == "CREDENTIAL_REVOKED"
