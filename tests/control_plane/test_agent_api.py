"""Agent API: credentials, compatibility, inventory and telemetry, duplicate identities. SQLite
and PostgreSQL."""

from __future__ import annotations

import hashlib
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


@pytest.mark.parametrize(("protocol", "code"), [(2, "TOO_NEW"), (0, "TOO_OLD")])
def test_another_protocols_body_still_learns_the_verdict(
    tmp_path: Path, database_url: str, protocol: int, code: str
) -> None:
    """An agent of another protocol sends another body shape: the protocol verdict (426)
    comes before body validation, on enroll and on heartbeat."""
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.mint()
        other_enroll = {
            "protocol_version": protocol,
            "enrollment_token": minted["token"],  # renamed in that protocol
            "nonce": "n" * 20,
            "host": {"name": "h"},
        }
        refused = cp.client.post("/api/v1/agent/enroll", json=other_enroll)
        assert refused.status_code == 426, refused.text
        error = refused.json()["error"]
        assert error["code"] == code and error["component"] == "agent" and error["next_step"]
        assert minted["token"] not in refused.text
        assert cp.enroll_raw(minted["token"]).status_code == 200  # the token was not consumed

        enrolled = cp.enroll()
        other_heartbeat = {"protocol_version": protocol, "health": "ok", "uptime_s": 12}
        refused = cp.client.post(
            "/api/v1/agent/heartbeat",
            headers=cp.agent(enrolled["credential"]),
            json=other_heartbeat,
        )
        assert refused.status_code == 426, refused.text
        assert refused.json()["error"]["code"] == code
        assert refused.json()["error"]["component"] == "agent"
        assert cp.node(enrolled["node_id"])["needs_upgrade"]["code"] == code
        # A body of this protocol that is invalid is still a validation error, and a
        # credential is still checked first.
        invalid = cp.client.post(
            "/api/v1/agent/heartbeat",
            headers=cp.agent(enrolled["credential"]),
            json={"protocol_version": 1, "health": "ok"},
        )
        assert invalid.status_code == 422
        assert invalid.json()["error"]["code"] == "INVALID_REQUEST"
        anonymous = cp.client.post("/api/v1/agent/heartbeat", json=other_heartbeat)
        assert anonymous.status_code == 401


def test_readiness_fails_on_an_old_inventory(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url, inventory_max_age_seconds=3600) as cp:
        enrolled = cp.enroll()
        headers = cp.agent(enrolled["credential"])
        cp.client.put("/api/v1/agent/inventory", headers=headers, json=inventory_body("cpu"))

        def inventory_check() -> dict[str, Any]:
            cp.heartbeat(enrolled["credential"])
            checks = {c["name"]: c for c in cp.readiness(enrolled["node_id"])["checks"]}
            return dict(checks["inventory"])

        assert inventory_check()["status"] == "pass"
        cp.clock.advance(3600)
        assert inventory_check()["status"] == "pass"  # exactly at the bound
        cp.clock.advance(30 * 86400)  # connected all along, the inventory 30 days old
        check = inventory_check()
        assert check["status"] == "fail"
        assert "MODELFORGE_INVENTORY_MAX_AGE_SECONDS" in check["detail"]
        assert "PUT /api/v1/agent/inventory" in check["next_step"]
        assert cp.readiness(enrolled["node_id"])["ready"] is False
        cp.client.put("/api/v1/agent/inventory", headers=headers, json=inventory_body("cpu"))
        assert inventory_check()["status"] == "pass"  # resent: fresh again
        # Agents are told to resend it, changed or not, well within the bound.
        assert enrolled["inventory_interval_seconds"] == 900
        assert cp.heartbeat(enrolled["credential"]).json()["inventory_interval_seconds"] == 900


def _upload(cp: Any, credential: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    response = cp.client.put(
        f"/api/v1/agent/artifacts/{digest}", headers=cp.agent(credential), content=data
    )
    assert response.status_code == 201, response.text
    return digest


def test_a_node_downloads_only_its_own_artifacts(tmp_path: Path, database_url: str) -> None:
    """What it uploaded, or what its running (or recently finished) jobs name; everything else
    is answered like a digest that does not exist."""
    with control_plane(tmp_path, database_url) as cp:
        nodes = []
        for _ in range(2):
            enrolled = cp.enroll()
            headers = cp.agent(enrolled["credential"])
            cp.client.put("/api/v1/agent/inventory", headers=headers, json=inventory_body())
            cp.heartbeat(enrolled["credential"])
            nodes.append(enrolled)
        first, second = nodes
        mine = _upload(cp, first["credential"], b"made on the first node")
        model = cp.client.post("/api/v1/artifacts", headers=cp.admin, content=b"an onnx model")
        weights = cp.client.post("/api/v1/artifacts", headers=cp.admin, content=b"job weights")
        model_digest, weights_digest = model.json()["digest"], weights.json()["digest"]
        never = "sha256:" + "0" * 64

        def fetch(enrolled: dict[str, Any], digest: str) -> Any:
            return cp.client.get(
                f"/api/v1/agent/artifacts/{digest}", headers=cp.agent(enrolled["credential"])
            )

        assert fetch(first, mine).content == b"made on the first node"
        missing = fetch(second, never)
        for digest in (mine, weights_digest, model_digest):
            refused = fetch(second, digest)
            assert refused.status_code == 404
            assert refused.json()["error"]["code"] == "ARTIFACT_NOT_FOUND"
            # Indistinguishable from a digest that does not exist.
            assert (
                refused.json()["error"]["message"].replace(digest, never)
                == (missing.json()["error"]["message"])
            )
            assert refused.json()["error"]["next_step"] == missing.json()["error"]["next_step"]

        job = cp.client.post(
            "/api/v1/jobs",
            headers=cp.admin,
            json={
                "entrypoint": {"kind": "onnx", "model": model_digest},
                "inputs": {"weights": weights_digest},
            },
        ).json()
        claimed = cp.client.post(
            "/api/v1/agent/work/claim",
            headers=cp.agent(second["credential"]),
            json={"hold_seconds": 0},
        )
        assert claimed.status_code == 200 and claimed.json()["job_id"] == job["job_id"]
        assert fetch(second, weights_digest).content == b"job weights"
        assert fetch(second, model_digest).content == b"an onnx model"
        assert fetch(first, weights_digest).status_code == 404  # not the first node's job
        assert fetch(second, mine).status_code == 404

        completed = cp.client.post(
            f"/api/v1/agent/jobs/{job['job_id']}/complete",
            headers=cp.agent(second["credential"]),
            json={"state": "succeeded", "result": None, "outputs": {}},
        )
        assert completed.status_code == 200, completed.text
        cp.clock.advance(1800)
        assert fetch(second, weights_digest).status_code == 200  # finished recently
        cp.clock.advance(1801)
        assert fetch(second, weights_digest).status_code == 404  # finished over an hour ago
