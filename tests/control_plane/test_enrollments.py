"""Minting, listing, revoking and claiming enrollment tokens (SQLite and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.factories import control_plane


def _count(cp, path: str) -> int:  # type: ignore[no-untyped-def]
    response = cp.client.get(path, headers=cp.admin)
    assert response.status_code == 200
    return len(response.json())


def test_mint_returns_token_once_and_reserves_node_id(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.mint(expires_in_seconds=300, labels={"zone": "lab"})
        assert minted["token"].startswith("mfe_") and len(minted["token"]) > 40
        assert minted["node_id"].startswith("node_")
        assert minted["production_eligible"] is False
        assert minted["api_origin"] == "http://testserver"
        assert minted["labels"] == {"zone": "lab"}
        listed = cp.client.get("/api/v1/admin/node-enrollments", headers=cp.admin).json()
        got = cp.client.get(
            f"/api/v1/admin/node-enrollments/{minted['enrollment_id']}", headers=cp.admin
        ).json()
        assert minted["token"] not in str(listed) + str(got)
        assert "token" not in got and got["state"] == "pending"
        assert got["node_id"] == minted["node_id"]


@pytest.mark.parametrize("expires", [300, 900, 3600, 86400, 60])
def test_allowed_expiries(tmp_path: Path, database_url: str, expires: int) -> None:
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.mint(expires_in_seconds=expires)
        assert minted["state"] == "pending"


@pytest.mark.parametrize(
    "body",
    [
        {"display_name": "x", "expires_in_seconds": 59},
        {"display_name": "x", "expires_in_seconds": 86401},
        {"display_name": "   ", "expires_in_seconds": 300},
        {"display_name": "x", "expires_in_seconds": 300, "labels": {"Bad Key": "v"}},
        {"display_name": "x", "expires_in_seconds": 300, "surprise": 1},
        {"expires_in_seconds": 300},
    ],
)
def test_bad_mint_input_is_refused_and_changes_nothing(
    tmp_path: Path, database_url: str, body: dict[str, object]
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        response = cp.client.post("/api/v1/admin/node-enrollments", headers=cp.admin, json=body)
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["code"] == "INVALID_REQUEST"
        assert error["message"] and error["next_step"]
        assert _count(cp, "/api/v1/admin/node-enrollments") == 0


def test_admin_token_required(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        missing = cp.client.get("/api/v1/admin/nodes")
        wrong = cp.client.get("/api/v1/admin/nodes", headers={"X-ModelForge-Admin-Token": "no"})
        assert missing.status_code == wrong.status_code == 401
        assert missing.json()["error"]["code"] == "ADMIN_TOKEN_MISSING"
        assert wrong.json()["error"]["code"] == "ADMIN_TOKEN_INVALID"


def test_each_refused_token_has_its_own_code(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        unknown = cp.enroll_raw("mfe_" + "x" * 43)
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (
            401,
            "ENROLLMENT_TOKEN_UNKNOWN",
        )

        expiring = cp.mint(expires_in_seconds=300)
        cp.clock.advance(301)
        expired = cp.enroll_raw(expiring["token"])
        assert (expired.status_code, expired.json()["error"]["code"]) == (
            410,
            "ENROLLMENT_TOKEN_EXPIRED",
        )

        used_token = cp.mint()["token"]
        assert cp.enroll_raw(used_token).status_code == 200
        used = cp.enroll_raw(used_token)
        assert (used.status_code, used.json()["error"]["code"]) == (409, "ENROLLMENT_TOKEN_USED")

        revoked_enrollment = cp.mint()
        revoke = cp.client.post(
            f"/api/v1/admin/node-enrollments/{revoked_enrollment['enrollment_id']}/revoke",
            headers=cp.admin,
        )
        assert revoke.status_code == 200 and revoke.json()["state"] == "revoked"
        revoked = cp.enroll_raw(revoked_enrollment["token"])
        assert (revoked.status_code, revoked.json()["error"]["code"]) == (
            410,
            "ENROLLMENT_TOKEN_REVOKED",
        )
        for response in (unknown, expired, used, revoked):
            assert response.json()["error"]["next_step"]
        # Only the one successful claim created a node.
        assert _count(cp, "/api/v1/admin/nodes") == 1


def test_same_claim_nonce_gets_the_same_node(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.mint()
        nonce = "claimant-nonce-0123456789"
        first = cp.enroll_raw(minted["token"], nonce=nonce)
        retry = cp.enroll_raw(minted["token"], nonce=nonce)
        other = cp.enroll_raw(minted["token"], nonce="someone-else-0123456789")
        assert first.status_code == retry.status_code == 200
        assert first.json()["node_id"] == retry.json()["node_id"] == minted["node_id"]
        assert other.json()["error"]["code"] == "ENROLLMENT_TOKEN_USED"
        # Exactly one active credential: the re-issued one; the lost one is revoked.
        old, new = first.json()["credential"], retry.json()["credential"]
        assert cp.heartbeat(new).status_code == 200
        assert cp.heartbeat(old).json()["error"]["code"] == "CREDENTIAL_REVOKED"
        assert _count(cp, "/api/v1/admin/nodes") == 1


def test_revoking_a_used_token_is_refused(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.mint()
        assert cp.enroll_raw(minted["token"]).status_code == 200
        response = cp.client.post(
            f"/api/v1/admin/node-enrollments/{minted['enrollment_id']}/revoke", headers=cp.admin
        )
        assert response.status_code == 409
        error = response.json()["error"]
        assert error["code"] == "ENROLLMENT_ALREADY_CLAIMED"
        assert "credential/revoke" in error["next_step"]


def test_incompatible_agent_does_not_consume_the_token(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.mint()
        refused = cp.enroll_raw(minted["token"], protocol_version=2)
        assert refused.status_code == 426 and refused.json()["error"]["code"] == "TOO_NEW"
        assert cp.enroll_raw(minted["token"]).status_code == 200


def test_unknown_ids_give_not_found(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        for path, code in [
            ("/api/v1/admin/node-enrollments/enr_missing", "ENROLLMENT_NOT_FOUND"),
            ("/api/v1/admin/nodes/node_missing", "NODE_NOT_FOUND"),
            ("/api/v1/admin/nodes/node_missing/readiness", "NODE_NOT_FOUND"),
            ("/api/v1/admin/nodes/node_missing/events", "NODE_NOT_FOUND"),
        ]:
            response = cp.client.get(path, headers=cp.admin)
            assert response.status_code == 404
            assert response.json()["error"]["code"] == code


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        (
            "post",
            "/api/v1/admin/node-enrollments",
            {"display_name": "a\x00b", "expires_in_seconds": 300},
        ),
        (
            "post",
            "/api/v1/admin/node-enrollments",
            {"display_name": "ab", "expires_in_seconds": 300, "labels": {"zone": "x\x00"}},
        ),
        ("get", "/api/v1/admin/nodes/node%00x", None),
        (
            "post",
            "/api/v1/agent/enroll",
            {
                "token": "mfe_\x00",
                "claim_nonce": "n" * 20,
                "hostname": "h",
                "protocol_version": 1,
                "agent_version": "0.1.0",
            },
        ),
    ],
)
def test_nul_characters_are_refused_not_500(
    tmp_path: Path, database_url: str, method: str, path: str, body: object
) -> None:
    """PostgreSQL cannot store NUL in text: such input must be a 422, never a 500."""
    with control_plane(tmp_path, database_url) as cp:
        response = cp.client.request(method, path, headers=cp.admin, json=body)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["code"] == "INVALID_REQUEST"


def test_same_claimant_gets_its_node_back_after_the_token_expired(
    tmp_path: Path, database_url: str
) -> None:
    """It won the claim in time and lost our answer; the expiry bounds who may claim, not
    the winner's retry. Anyone else still gets ENROLLMENT_TOKEN_USED."""
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.mint(expires_in_seconds=300)
        nonce = "claimant-nonce-0123456789"
        first = cp.enroll_raw(minted["token"], nonce=nonce)
        assert first.status_code == 200
        cp.clock.advance(3600)
        retry = cp.enroll_raw(minted["token"], nonce=nonce)
        assert retry.status_code == 200, retry.text
        assert retry.json()["node_id"] == minted["node_id"]
        assert cp.heartbeat(retry.json()["credential"]).status_code == 200
        other = cp.enroll_raw(minted["token"], nonce="someone-else-0123456789")
        assert (other.status_code, other.json()["error"]["code"]) == (409, "ENROLLMENT_TOKEN_USED")
        assert _count(cp, "/api/v1/admin/nodes") == 1


def test_same_claimant_cannot_undo_a_revocation(tmp_path: Path, database_url: str) -> None:
    """A retry re-issues only the credential the claimant never received: once an administrator
    revoked the node's credential (or rotated the key), the token and nonce bring nothing back."""
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.mint()
        nonce = "claimant-nonce-0123456789"
        assert cp.enroll_raw(minted["token"], nonce=nonce).status_code == 200
        revoked = cp.client.post(
            f"/api/v1/admin/nodes/{minted['node_id']}/credential/revoke", headers=cp.admin
        )
        assert revoked.json()["revoked"] == 1
        retry = cp.enroll_raw(minted["token"], nonce=nonce)
        assert (retry.status_code, retry.json()["error"]["code"]) == (409, "ENROLLMENT_TOKEN_USED")
        assert "revoked" in retry.json()["error"]["message"]
        assert retry.json()["error"]["next_step"]


def test_revoking_twice_answers_the_same(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.mint()
        url = f"/api/v1/admin/node-enrollments/{minted['enrollment_id']}/revoke"
        first = cp.client.post(url, headers=cp.admin)
        again = cp.client.post(url, headers=cp.admin)
        assert first.status_code == again.status_code == 200
        assert first.json()["state"] == again.json()["state"] == "revoked"
        assert first.json()["revoked_at"] == again.json()["revoked_at"]
        assert cp.enroll_raw(minted["token"]).json()["error"]["code"] == "ENROLLMENT_TOKEN_REVOKED"
