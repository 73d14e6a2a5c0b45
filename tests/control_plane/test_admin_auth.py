"""Admin authentication and secret hygiene: the admin-token header is throttled per client address
like the console's sign-in (one shared count), responses carrying a secret are never cached,
and no object holding a secret shows it in repr() or str(). SQLite and PostgreSQL."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from control_plane.access.admin_token import resolve_admin_token
from control_plane.access.console_sessions import SignedIn
from control_plane.access.schemas import SignInRequest
from control_plane.clock import ManualClock
from control_plane.fleet import enrollments
from control_plane.fleet.schemas import EnrollmentMinted, EnrollRequest, EnrollResponse
from control_plane.settings import Settings
from tests.factories import ADMIN_TOKEN, control_plane

NODES = "/api/v1/admin/nodes"
SESSION = "/api/v1/console/session"
WRONG = {"X-ModelForge-Admin-Token": "mfa_guess_" + "g" * 24}


def test_wrong_admin_token_headers_are_slowed_down(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        for _ in range(10):
            wrong = cp.client.get(NODES, headers=WRONG)
            assert wrong.status_code == 401
            assert wrong.json()["error"]["code"] == "ADMIN_TOKEN_INVALID"
        for headers in (WRONG, cp.admin):  # even the right token waits: no oracle
            limited = cp.client.get(NODES, headers=headers)
            assert limited.status_code == 429, limited.text
            error = limited.json()["error"]
            assert error["code"] == "SIGN_IN_RATE_LIMITED"
            assert "Wait 301 s" in error["next_step"]
            assert "X-ModelForge-Admin-Token" in error["next_step"]
            assert ADMIN_TOKEN not in limited.text
        # Refused requests change nothing.
        minted = cp.client.post(
            "/api/v1/admin/node-enrollments",
            headers=cp.admin,
            json={"display_name": "x", "expires_in_seconds": 300},
        )
        assert minted.status_code == 429
        cp.clock.advance(200)
        assert cp.client.get(NODES, headers=cp.admin).status_code == 429  # "Wait 101 s" now
        cp.clock.advance(101)
        assert cp.client.get(NODES, headers=cp.admin).status_code == 200
        assert cp.client.get("/api/v1/admin/node-enrollments", headers=cp.admin).json() == []


def test_a_right_token_clears_the_count(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        for _ in range(3):
            for _ in range(9):
                assert cp.client.get(NODES, headers=WRONG).status_code == 401
            assert cp.client.get(NODES, headers=cp.admin).status_code == 200


def test_header_and_console_sign_in_share_one_count(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        for _ in range(5):
            assert cp.client.get(NODES, headers=WRONG).status_code == 401
            wrong = cp.client.post(SESSION, json={"admin_token": "mfa_guess_" + "s" * 24})
            assert wrong.status_code == 401
        signed_in = cp.client.post(SESSION, json={"admin_token": ADMIN_TOKEN})
        assert signed_in.status_code == 429
        assert "then sign in" in signed_in.json()["error"]["next_step"]
        assert cp.client.get(NODES, headers=cp.admin).status_code == 429


def test_responses_carrying_a_secret_are_never_cached(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.client.post(
            "/api/v1/admin/node-enrollments",
            headers=cp.admin,
            json={"display_name": "gpu-1", "expires_in_seconds": 300},
        )
        assert minted.status_code == 201
        assert minted.headers["cache-control"] == "no-store"
        enrolled = cp.enroll_raw(minted.json()["token"])
        assert enrolled.status_code == 200
        assert enrolled.headers["cache-control"] == "no-store"
        signed_in = cp.client.post(SESSION, json={"admin_token": ADMIN_TOKEN})
        assert signed_in.headers["cache-control"] == "no-store"
        current = cp.client.get(SESSION)
        assert current.headers["cache-control"] == "no-store"
        signed_out = cp.client.delete(
            SESSION, headers={"X-ModelForge-CSRF": signed_in.json()["csrf_token"]}
        )
        assert signed_out.status_code == 204
        assert signed_out.headers["cache-control"] == "no-store"


def _assert_hidden(holder: Any, *secret_values: str) -> None:
    for text in (repr(holder), str(holder)):
        for value in secret_values:
            assert value not in text, f"{type(holder).__name__} shows a secret: {text}"


def test_no_object_holding_a_secret_shows_it(tmp_path: Path, database_url: str) -> None:
    token = "mfe_" + secrets.token_urlsafe(32)
    nonce = secrets.token_hex(16)
    credential = "eyJ" + secrets.token_urlsafe(60)
    request = EnrollRequest(
        token=token, claim_nonce=nonce, hostname="h", protocol_version=1, agent_version="0.1.0"
    )
    assert request.token == token  # still there for the service, only never shown
    _assert_hidden(request, token, nonce)
    _assert_hidden(
        EnrollResponse(
            node_id="node_1",
            credential=credential,
            labels={},
            heartbeat_interval_seconds=10,
            telemetry_interval_seconds=15,
            inventory_interval_seconds=900,
        ),
        credential,
    )
    _assert_hidden(enrollments.ClaimResult("node_1", credential, {}), credential)
    _assert_hidden(SignInRequest(admin_token=SecretStr(ADMIN_TOKEN)), ADMIN_TOKEN)
    _assert_hidden(SignedIn(session_id=token, expires_at=ManualClock().now()), token)
    settings = Settings(data_dir=tmp_path, admin_token=SecretStr(ADMIN_TOKEN))
    _assert_hidden(settings, ADMIN_TOKEN)
    _assert_hidden(resolve_admin_token(settings), ADMIN_TOKEN)
    with control_plane(tmp_path / "cp", database_url) as cp:
        with cp.ctx.session_factory.begin() as session:
            minted = enrollments.mint_enrollment(
                session=session,
                clock=cp.clock,
                display_name="gpu-1",
                expires_in_seconds=300,
                labels={},
                production_eligible=False,
            )
            _assert_hidden(minted, minted.token)
            _assert_hidden(minted.enrollment, minted.token)
            public = EnrollmentMinted(
                enrollment_id=minted.enrollment.id,
                node_id=minted.enrollment.node_id,
                display_name="gpu-1",
                labels={},
                state="pending",
                created_at=minted.enrollment.created_at,
                expires_at=minted.enrollment.expires_at,
                claimed_at=None,
                revoked_at=None,
                production_eligible=False,
                token=minted.token,
                api_origin="http://testserver",
            )
            _assert_hidden(public, minted.token)
        enrolled = cp.enroll()
        _assert_hidden(cp.ctx.authority, enrolled["credential"])
