"""A service's access tokens (issue 27): minted through the real admin API (shown once, kept as a
SHA-256 digest, revocable, audited), and checked by the gateway's `GatewayAuth` over the same
database on the control plane's `ManualClock` (the grant cache's second and the token buckets
are driven by moving the clock, never by sleeping)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from control_plane.gateway.auth import GatewayAuth, GatewayDenied
from control_plane.models import ServiceAccessToken
from tests.control_plane.test_workloads import _deploy
from tests.factories import ADMIN_TOKEN, ControlPlane, control_plane

TOKEN = re.compile(r"^mfs_[A-Za-z0-9_-]{43}$")


def _mint(cp: ControlPlane, service_id: str, **body: Any) -> dict[str, Any]:
    response = cp.client.post(
        f"/api/v1/services/{service_id}/access-tokens",
        headers=cp.admin,
        json={"name": "web app", **body},
    )
    assert response.status_code == 201, response.text
    assert response.headers["Cache-Control"] == "no-store"
    return dict(response.json())


def _tokens(cp: ControlPlane, service_id: str) -> list[dict[str, Any]]:
    response = cp.client.get(f"/api/v1/services/{service_id}/access-tokens", headers=cp.admin)
    assert response.status_code == 200, response.text
    return list(response.json())


def _revoke(cp: ControlPlane, service_id: str, token_id: str) -> dict[str, Any]:
    response = cp.client.delete(
        f"/api/v1/services/{service_id}/access-tokens/{token_id}", headers=cp.admin
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def _gateway(cp: ControlPlane) -> GatewayAuth:
    return GatewayAuth(
        read_sessions=cp.ctx.read_session_factory,
        write_sessions=cp.ctx.session_factory,
        clock=cp.clock,
    )


def _denied(auth: GatewayAuth, header: str | None, service: str, kind: str = "") -> GatewayDenied:
    with pytest.raises(GatewayDenied) as refused:
        auth.authorize(header, service, kind)
    return refused.value


def test_mint_shows_the_token_once_and_keeps_only_its_digest(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        service = _deploy(cp)
        minted = _mint(cp, service["service_id"], rate_per_second=5.5)
        token = minted["token"]
        assert TOKEN.match(token)
        assert minted["hint"] == token[:10] and minted["name"] == "web app"
        assert (minted["rate_per_second"], minted["burst"]) == (5.5, 6)  # a second's worth
        assert minted["revoked_at"] is None and minted["created_by"] == "admin-token"

        listed = _tokens(cp, service["service_id"])
        assert [t["id"] for t in listed] == [minted["id"]]
        assert "token" not in listed[0] and listed[0]["hint"] == minted["hint"]
        one = cp.client.get(f"/api/v1/services/{service['service_id']}", headers=cp.admin)
        for text in (str(listed), one.text):
            assert token not in text and token[10:] not in text

        with cp.ctx.read_session_factory() as session:
            row = session.scalars(select(ServiceAccessToken)).one()
            columns = [getattr(row, c.key) for c in ServiceAccessToken.__table__.columns]
        assert row.token_hash == hashlib.sha256(token.encode()).hexdigest()
        assert not any(isinstance(v, str) and token[10:] in v for v in columns)

        second = _mint(cp, service["service_id"], name="batch")
        assert second["token"] != token and (second["rate_per_second"], second["burst"]) == (
            None,
            None,
        )


def test_a_token_opens_its_service_and_nothing_else(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        web, other = _deploy(cp), _deploy(cp, name="other")
        token = _mint(cp, web["service_id"])["token"]
        other_token = _mint(cp, other["service_id"])["token"]
        credential = cp.enroll()["credential"]
        auth = _gateway(cp)

        by_name = auth.authorize(f"Bearer {token}", "web")
        assert (by_name.service_id, by_name.service_name) == (web["service_id"], "web")
        assert auth.authorize(f"bearer  {token} ", web["service_id"]) == by_name

        missing = [_denied(auth, header, "web") for header in (None, "", "Bearer ", "Basic x")]
        wrong = [
            _denied(auth, f"Bearer {value}", "web")
            for value in (
                "mfs_" + "A" * 43,  # no such token
                token[:-1],
                other_token,  # another service's
                credential,  # a node credential
                ADMIN_TOKEN,  # the admin token
            )
        ]
        wrong.append(_denied(auth, f"Bearer {token}", "other"))  # its token, another service
        for refusal in missing + wrong:
            assert refusal.status == 401 and refusal.cause == "unauthorized"
            assert refusal.headers == {"WWW-Authenticate": 'Bearer realm="modelforge"'}
            assert refusal.body() == {"error": refusal.message}
        assert "needs an access token" in missing[0].message
        # One message for every wrong token: it tells a guesser nothing.
        assert {refusal.message for refusal in wrong} == {wrong[0].message}
        assert "not valid for this service" in wrong[0].message
        for value in (token, other_token, credential, ADMIN_TOKEN):
            assert not any(value in str(r) or value in r.message for r in missing + wrong)


def test_a_revoked_token_stops_within_a_second(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        service = _deploy(cp)
        minted = _mint(cp, service["service_id"])
        auth = _gateway(cp)
        assert auth.authorize(f"Bearer {minted['token']}", "web").token_id == minted["id"]

        revoked = _revoke(cp, service["service_id"], minted["id"])
        assert revoked["revoked_at"] is not None and "token" not in revoked
        cp.clock.advance(0.5)  # the grant read before the revoke is still held
        assert auth.authorize(f"Bearer {minted['token']}", "web").token_id == minted["id"]
        cp.clock.advance(0.5)
        assert _denied(auth, f"Bearer {minted['token']}", "web").status == 401
        # A fresh process (no cache) refuses it at once.
        assert _denied(_gateway(cp), f"Bearer {minted['token']}", "web").status == 401

        again = _revoke(cp, service["service_id"], minted["id"])
        assert again["revoked_at"] == revoked["revoked_at"]  # revoking twice changes nothing
        assert _tokens(cp, service["service_id"])[0]["revoked_at"] == revoked["revoked_at"]


def test_the_rate_limit_refuses_past_the_burst_and_refills_at_the_rate(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        service = _deploy(cp)
        limited = _mint(cp, service["service_id"], rate_per_second=2, burst=3)["token"]
        free = _mint(cp, service["service_id"], name="free")["token"]
        auth = _gateway(cp)
        header = f"Bearer {limited}"

        for _ in range(3):
            auth.authorize(header, "web")
        refused = _denied(auth, header, "web")
        assert (refused.status, refused.cause) == (429, "rate_limited")
        assert refused.headers == {"Retry-After": "1"}
        assert refused.body() == {"error": refused.message}
        assert "2 requests per second, bursts of 3" in refused.message
        assert limited not in refused.message

        cp.clock.advance(0.5)  # one request's worth at 2/s
        auth.authorize(header, "web")
        assert _denied(auth, header, "web").status == 429
        cp.clock.advance(10)  # refilled up to the burst, no further
        for _ in range(3):
            auth.authorize(header, "web")
        assert _denied(auth, header, "web").status == 429

        for _ in range(200):  # a token without a rate is never limited
            auth.authorize(f"Bearer {free}", "web")
        # Each token has a bucket of its own: the free one's use took nothing from it.
        cp.clock.advance(0.5)
        auth.authorize(header, "web")


def test_undeploying_closes_its_tokens(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        service = _deploy(cp)
        token = _mint(cp, service["service_id"])["token"]
        response = cp.client.delete(f"/api/v1/services/{service['service_id']}", headers=cp.admin)
        assert response.status_code == 200, response.text
        assert _denied(_gateway(cp), f"Bearer {token}", "web").status == 401
        refused = cp.client.post(
            f"/api/v1/services/{service['service_id']}/access-tokens",
            headers=cp.admin,
            json={"name": "late"},
        )
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "SERVICE_STOPPED"
        assert len(_tokens(cp, service["service_id"])) == 1


def test_the_gateway_on_the_event_loop_records_last_use(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        service = _deploy(cp)
        minted = _mint(cp, service["service_id"])
        auth = _gateway(cp)
        header = f"Bearer {minted['token']}"

        async def twice() -> None:
            assert auth.authorize_cached(header, "web") is None  # not read yet
            first = await auth.authorize_async(header, "web")  # read on a worker thread
            assert auth.authorize_cached(header, "web") == first  # from memory now

        asyncio.run(twice())
        assert _tokens(cp, service["service_id"])[0]["last_used_at"] is None
        assert auth.flush_last_used() == 1
        used = _tokens(cp, service["service_id"])[0]["last_used_at"]
        assert used is not None and used.startswith(cp.clock.now().isoformat()[:19])
        assert auth.flush_last_used() == 0  # nothing new


def test_mint_and_revoke_are_audited_without_the_token(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        service = _deploy(cp)
        sid = service["service_id"]
        minted = _mint(cp, sid, rate_per_second=1)
        _revoke(cp, sid, minted["id"])
        response = cp.client.get("/api/v1/admin/audit?limit=100", headers=cp.admin)
        entries = [e for e in response.json() if e["action"].startswith("service_token.")]
        assert [(e["action"], e["target"], e["outcome"]) for e in reversed(entries)] == [
            ("service_token.create", f"{sid}/{minted['id']}", "ok"),
            ("service_token.revoke", f"{sid}/{minted['id']}", "ok"),
        ]
        assert entries[-1]["detail"] == {
            "name": "web app",
            "rate_per_second": 1.0,
            "burst": None,
            "tokens_per_minute": None,
        }
        assert minted["token"] not in response.text and minted["token"][10:] not in response.text


def test_the_token_is_never_logged_nor_in_an_error(
    tmp_path: Path, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with control_plane(tmp_path, database_url) as cp:
        service = _deploy(cp)
        sid = service["service_id"]
        minted = _mint(cp, sid, rate_per_second=1, burst=1)
        token = minted["token"]
        auth = _gateway(cp)
        auth.authorize(f"Bearer {token}", "web")
        errors = [
            _denied(auth, f"Bearer {token}", "web").message,  # 429
            _denied(auth, f"Bearer {token}", "other").message,  # 401
        ]
        for body in ({"name": "x", "token": token}, {"name": token + "\n"}):
            refused = cp.client.post(
                f"/api/v1/services/{sid}/access-tokens", headers=cp.admin, json=body
            )
            assert refused.status_code == 422, refused.text
            errors.append(refused.text)
        _revoke(cp, sid, minted["id"])
        cp.clock.advance(1)
        errors.append(_denied(auth, f"Bearer {token}", "web").message)
        assert auth.flush_last_used() == 1
    assert caplog.records  # the requests above were logged
    for text in [caplog.text, *errors]:
        assert token not in text and token[10:] not in text


def test_bad_input_and_unknown_ids_change_nothing(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        service = _deploy(cp)
        other = _deploy(cp, name="other")
        sid = service["service_id"]
        for body in (
            {},
            {"name": ""},
            {"name": "x" * 101},
            {"name": "x", "rate_per_second": 0},
            {"name": "x", "rate_per_second": "5"},
            {"name": "x", "rate_per_second": 1, "burst": 0},
            {"name": "x", "burst": 5},  # a burst without a rate
        ):
            response = cp.client.post(
                f"/api/v1/services/{sid}/access-tokens", headers=cp.admin, json=body
            )
            assert response.status_code == 422, (body, response.text)
            assert response.json()["error"]["code"] == "INVALID_REQUEST"
        assert _tokens(cp, sid) == []

        for method, path in (
            ("POST", "/api/v1/services/svc_nope/access-tokens"),
            ("GET", "/api/v1/services/svc_nope/access-tokens"),
            ("DELETE", "/api/v1/services/svc_nope/access-tokens/stk_nope"),
        ):
            response = cp.client.request(method, path, headers=cp.admin, json={"name": "x"})
            assert response.status_code == 404, response.text
            assert response.json()["error"]["code"] == "SERVICE_NOT_FOUND"
        theirs = _mint(cp, other["service_id"])
        for token_id in ("stk_nope", theirs["id"]):  # unknown; another service's token
            response = cp.client.delete(
                f"/api/v1/services/{sid}/access-tokens/{token_id}", headers=cp.admin
            )
            assert response.status_code == 404, response.text
            assert response.json()["error"]["code"] == "ACCESS_TOKEN_NOT_FOUND"
        assert _tokens(cp, other["service_id"])[0]["revoked_at"] is None

        no_admin = cp.client.post(f"/api/v1/services/{sid}/access-tokens", json={"name": "x"})
        assert no_admin.status_code == 401
        assert _tokens(cp, sid) == []


def test_a_key_of_several_services_opens_those_it_names_or_every_llm(
    tmp_path: Path, database_url: str
) -> None:
    """`POST /api/v1/access-tokens` (issue 43): a key naming services opens them (named by name
    or id) and no other; a key of `llm_services` opens every service of kind `llm` and no other
    kind; listed with its scope and services, never the key; revoked, it stops within a
    second; audited."""
    with control_plane(tmp_path, database_url) as cp:
        web, other, third = _deploy(cp), _deploy(cp, name="other"), _deploy(cp, name="third")
        named = cp.client.post(
            "/api/v1/access-tokens",
            headers=cp.admin,
            json={"name": "team", "services": ["web", other["service_id"]]},
        )
        assert named.status_code == 201, named.text
        assert named.headers["Cache-Control"] == "no-store"
        key = named.json()
        assert key["scope"] == "services" and key["service_id"] is None
        assert sorted(key["services"]) == sorted([web["service_id"], other["service_id"]])
        every = cp.client.post(
            "/api/v1/access-tokens",
            headers=cp.admin,
            json={"name": "all llms", "llm_services": True, "tokens_per_minute": 1000},
        ).json()
        assert every["scope"] == "llm" and every["services"] == []
        auth = _gateway(cp)

        header = f"Bearer {key['token']}"
        for service in (web, other):
            assert auth.authorize(header, service["service_id"]).token_id == key["id"]
        assert _denied(auth, header, third["service_id"]).status == 401
        llm = f"Bearer {every['token']}"
        granted = auth.authorize(llm, third["service_id"], "llm")
        assert granted.tokens_per_minute == 1000
        assert _denied(auth, llm, third["service_id"], "command").status == 401
        assert _denied(auth, llm, third["service_id"], "onnx").status == 401

        listed = cp.client.get("/api/v1/access-tokens", headers=cp.admin)
        assert {row["id"]: row["scope"] for row in listed.json()} == {
            every["id"]: "llm",
            key["id"]: "services",
        }
        assert key["token"] not in listed.text and every["token"] not in listed.text
        assert _tokens(cp, web["service_id"]) == []  # a service's list: its own tokens only

        revoked = cp.client.delete(f"/api/v1/access-tokens/{key['id']}", headers=cp.admin)
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
        cp.clock.advance(1.0)
        assert _denied(auth, header, web["service_id"]).status == 401
        actions = [
            e["action"]
            for e in cp.client.get("/api/v1/admin/audit?limit=100", headers=cp.admin).json()
        ]
        assert actions.count("access_token.create") == 2
        assert actions.count("access_token.revoke") == 1


def test_a_bad_key_scope_is_refused_and_changes_nothing(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        web = _deploy(cp)
        service_token = _mint(cp, web["service_id"])
        for body, status, code in (
            ({"name": "k"}, 422, "INVALID_KEY_SCOPE"),
            ({"name": "k", "services": ["web"], "llm_services": True}, 422, "INVALID_KEY_SCOPE"),
            ({"name": "k", "services": ["no-such"]}, 404, "SERVICE_NOT_FOUND"),
            ({"name": "k", "services": ["web"], "burst": 3}, 422, "INVALID_REQUEST"),
            ({"name": "k", "services": "web"}, 422, None),
        ):
            refused = cp.client.post("/api/v1/access-tokens", headers=cp.admin, json=body)
            assert refused.status_code == status, (body, refused.text)
            if code is not None:
                assert refused.json()["error"]["code"] == code, refused.text
        assert cp.client.get("/api/v1/access-tokens", headers=cp.admin).json() == []
        # A service's own token is not revoked here: under its service.
        wrong = cp.client.delete(f"/api/v1/access-tokens/{service_token['id']}", headers=cp.admin)
        assert wrong.status_code == 404
        assert _tokens(cp, web["service_id"])[0]["revoked_at"] is None
