"""Users, password sign-in and personal keys (issue 45), on SQLite and PostgreSQL, through the
real app: a user signs in and acts with their role; a key acts as its user within its scopes and
never beyond the role; disabling a user stops their session and keys at the next request; no
password or key is ever stored, answered or logged in clear."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tests.factories import PYTHON_JOB, ControlPlane, control_plane

PASSWORD = "correct horse battery staple"  # noqa: S105 - a test user's password
SESSION = "/api/v1/console/session"


def _ok(response: Any, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json() if response.content else None


def _code(response: Any) -> str:
    return str(response.json()["error"]["code"])


def _user(cp: ControlPlane, name: str, role: str, password: str | None = PASSWORD) -> Any:
    body = {"name": name, "role": role} | ({"password": password} if password else {})
    return _ok(cp.client.post("/api/v1/users", headers=cp.admin, json=body), 201)


def _sign_in(cp: ControlPlane, name: str, password: str = PASSWORD) -> str:
    """Signs `cp.client` in as `name` (its cookie); the CSRF token."""
    cp.client.cookies.clear()
    signed_in = _ok(cp.client.post(SESSION, json={"name": name, "password": password}), 201)
    assert signed_in["user"] == name
    return str(signed_in["csrf_token"])


def _key(cp: ControlPlane, csrf: str, *scopes: str, days: int = 90) -> str:
    body = {"name": "laptop", "scopes": list(scopes), "expires_in_days": days}
    minted = _ok(
        cp.client.post("/api/v1/me/keys", json=body, headers={"X-ModelForge-CSRF": csrf}), 201
    )
    assert minted["key"].startswith("mfk_") and minted["hint"] == minted["key"][:10]
    return str(minted["key"])


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_user_signs_in_with_a_password_and_acts_with_their_role(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        _user(cp, "vera", "viewer")
        csrf = _sign_in(cp, "vera")
        me = _ok(cp.client.get("/api/v1/me"))
        assert (me["actor"], me["via"], me["role"]) == ("user:vera", "session", "viewer")
        assert "work:read" in me["may"] and "work:change" not in me["may"]
        assert cp.client.get("/api/v1/jobs").status_code == 200  # a viewer reads the work
        refused = cp.client.post(
            "/api/v1/jobs", json=PYTHON_JOB, headers={"X-ModelForge-CSRF": csrf}
        )
        assert refused.status_code == 403 and _code(refused) == "ROLE_FORBIDDEN"
        assert "viewer" in refused.json()["error"]["message"]
        # The cookie alone changes nothing: the CSRF rule holds for a user's session too.
        assert _code(cp.client.post("/api/v1/me/keys", json={})) == "CSRF_TOKEN_MISSING"

        _user(cp, "mia", "member")
        csrf = _sign_in(cp, "mia")
        submitted = cp.client.post(
            "/api/v1/jobs", json=PYTHON_JOB, headers={"X-ModelForge-CSRF": csrf}
        )
        assert submitted.status_code == 201, submitted.text
        fleet = cp.client.post(
            "/api/v1/admin/node-enrollments",
            json={"display_name": "gpu-9"},
            headers={"X-ModelForge-CSRF": csrf},
        )
        assert fleet.status_code == 403 and _code(fleet) == "ROLE_FORBIDDEN"
        audit = cp.client.get("/api/v1/admin/audit")
        assert audit.status_code == 403  # the audit log: operators and admins

        cp.client.cookies.clear()
        entries = _ok(cp.client.get("/api/v1/admin/audit", headers=cp.admin))
        (submit,) = [e for e in entries if e["action"] == "job.submit"]
        assert submit["actor"] == "user:mia"  # the audit log names the person
        # A sign-in rotates the session: a second sign-in gets another cookie.
        first = _sign_in(cp, "mia")
        second = _sign_in(cp, "mia")
        assert first != second


def test_a_wrong_password_or_name_is_one_refusal_and_guessing_is_throttled(
    tmp_path: Path, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with control_plane(tmp_path, database_url) as cp:
        _user(cp, "oscar", "operator")
        _user(cp, "nopass", "member", password=None)
        refusals = [
            cp.client.post(SESSION, json={"name": "oscar", "password": "wrong " * 3}),
            cp.client.post(SESSION, json={"name": "nobody", "password": PASSWORD}),
            cp.client.post(SESSION, json={"name": "nopass", "password": PASSWORD}),
        ]
        assert {r.status_code for r in refusals} == {401}
        assert len({r.text for r in refusals}) == 1  # which part was wrong is not said
        assert _code(refusals[0]) == "SIGN_IN_FAILED"
        both = cp.client.post(SESSION, json={"admin_token": "x", "name": "oscar", "password": "y"})
        assert both.status_code == 422
        for _ in range(7):
            cp.client.post(SESSION, json={"name": "oscar", "password": "guess " * 3})
        throttled = cp.client.post(SESSION, json={"name": "oscar", "password": PASSWORD})
        assert throttled.status_code == 429 and _code(throttled) == "SIGN_IN_RATE_LIMITED"
        assert "passwords" in throttled.json()["error"]["message"]
        # The admin token's own count is apart: the break-glass still works from here.
        assert _ok(cp.client.get("/api/v1/me", headers=cp.admin))["via"] == "admin-token"
        assert PASSWORD not in caplog.text and "guess guess" not in caplog.text


def test_a_key_acts_as_its_user_within_its_scopes_and_never_beyond_the_role(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        _user(cp, "mia", "member")
        csrf = _sign_in(cp, "mia")
        read, deploy, admin = (_key(cp, csrf, s) for s in ("read", "deploy", "admin"))
        cp.client.cookies.clear()

        me = _ok(cp.client.get("/api/v1/me", headers=_bearer(read)))
        assert (
            me["via"] == "key"
            and me["scopes"] == ["read"]
            and me["actor"].startswith("user:mia key:")
        )
        assert cp.client.get("/api/v1/services", headers=_bearer(read)).status_code == 200
        refused = cp.client.post("/api/v1/jobs", json=PYTHON_JOB, headers=_bearer(read))
        assert refused.status_code == 403 and _code(refused) == "KEY_SCOPE_FORBIDDEN"
        _ok(cp.client.post("/api/v1/jobs", json=PYTHON_JOB, headers=_bearer(deploy)), 201)
        # A read key cannot mint another key; an admin-scoped one can, as its user.
        minted = cp.client.post(
            "/api/v1/me/keys", json={"name": "x", "scopes": ["read"]}, headers=_bearer(read)
        )
        assert _code(minted) == "KEY_SCOPE_FORBIDDEN"
        _ok(
            cp.client.post(
                "/api/v1/me/keys", json={"name": "x", "scopes": ["read"]}, headers=_bearer(admin)
            ),
            201,
        )
        # `admin` on a member's key is the member's rights, not an admin's.
        beyond = cp.client.post(
            "/api/v1/users", json={"name": "eve", "role": "admin"}, headers=_bearer(admin)
        )
        assert beyond.status_code == 403 and _code(beyond) == "ROLE_FORBIDDEN"
        fleet = cp.client.delete("/api/v1/admin/nodes/node_x", headers=_bearer(admin))
        assert _code(fleet) == "ROLE_FORBIDDEN"

        listed = _ok(cp.client.get("/api/v1/me/keys", headers=_bearer(read)))
        assert len(listed) == 4 and all("key" not in k for k in listed)
        (read_key,) = [k for k in listed if k["hint"] == read[:10]]
        _ok(cp.client.delete(f"/api/v1/me/keys/{read_key['id']}", headers=_bearer(admin)), 204)
        gone = cp.client.get("/api/v1/me", headers=_bearer(read))
        assert gone.status_code == 401 and _code(gone) == "API_KEY_INVALID"

        # Expiry, on the control plane's clock.
        csrf = _sign_in(cp, "mia")
        short = _key(cp, csrf, "read", days=1)
        cp.client.cookies.clear()
        cp.clock.advance(86_401)
        expired = cp.client.get("/api/v1/me", headers=_bearer(short))
        assert expired.status_code == 401 and _code(expired) == "API_KEY_EXPIRED"


def test_disabling_a_user_stops_their_session_and_keys_at_once(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        _user(cp, "oscar", "operator")
        csrf = _sign_in(cp, "oscar")
        key = _key(cp, csrf, "read")
        cookie = cp.client.cookies.get("modelforge_session")
        _ok(cp.client.patch("/api/v1/users/oscar", headers=cp.admin, json={"disabled": True}))
        assert _code(cp.client.get("/api/v1/me")) == "USER_DISABLED"
        cp.client.cookies.clear()
        assert _code(cp.client.get("/api/v1/me", headers=_bearer(key))) == "USER_DISABLED"
        refused = cp.client.post(SESSION, json={"name": "oscar", "password": PASSWORD})
        assert _code(refused) == "SIGN_IN_FAILED"

        _ok(cp.client.patch("/api/v1/users/oscar", headers=cp.admin, json={"disabled": False}))
        cp.client.cookies.set("modelforge_session", str(cookie))
        assert _ok(cp.client.get("/api/v1/me"))["role"] == "operator"
        _ok(cp.client.patch("/api/v1/users/oscar", headers=cp.admin, json={"role": "viewer"}))
        assert _ok(cp.client.get("/api/v1/me"))["role"] == "viewer"  # at the next request
        cp.client.cookies.clear()

        listed = _ok(cp.client.get("/api/v1/users/oscar/keys", headers=cp.admin))
        _ok(cp.client.delete(f"/api/v1/users/oscar/keys/{listed[0]['id']}", headers=cp.admin), 204)
        assert _code(cp.client.get("/api/v1/me", headers=_bearer(key))) == "API_KEY_INVALID"
        _ok(cp.client.delete("/api/v1/users/oscar", headers=cp.admin), 204)
        cp.client.cookies.set("modelforge_session", str(cookie))
        assert cp.client.get("/api/v1/me").status_code == 401  # its sessions went with it
        cp.client.cookies.clear()


def test_the_admin_token_is_the_break_glass_and_no_person(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        me = _ok(cp.client.get("/api/v1/me", headers=cp.admin))
        assert (me["actor"], me["role"], me["user"]) == ("admin-token", "admin", None)
        keys = cp.client.post(
            "/api/v1/me/keys", headers=cp.admin, json={"name": "k", "scopes": ["read"]}
        )
        assert keys.status_code == 409 and _code(keys) == "NOT_A_USER"
        taken = cp.client.post(
            "/api/v1/users", headers=cp.admin, json={"name": "ada", "role": "admin"}
        )
        assert taken.status_code == 201
        again = cp.client.post(
            "/api/v1/users", headers=cp.admin, json={"name": "ada", "role": "viewer"}
        )
        assert again.status_code == 409 and _code(again) == "USER_EXISTS"
        short = cp.client.post(
            "/api/v1/users",
            headers=cp.admin,
            json={"name": "bo", "role": "viewer", "password": "short"},
        )
        assert short.status_code == 422 and "short" not in short.text
        bad_role = cp.client.post(
            "/api/v1/users", headers=cp.admin, json={"name": "bo", "role": "root"}
        )
        assert bad_role.status_code == 422
        assert [u["name"] for u in _ok(cp.client.get("/api/v1/users", headers=cp.admin))] == ["ada"]


def test_no_password_or_key_is_kept_answered_or_audited_in_clear(
    tmp_path: Path, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with control_plane(tmp_path, database_url) as cp:
        created = _user(cp, "ada", "admin")
        assert "password" not in created and created["has_password"] is True
        csrf = _sign_in(cp, "ada")
        key = _key(cp, csrf, "admin")
        cp.client.cookies.clear()
        new_password = "another long passphrase"  # noqa: S105
        _ok(
            cp.client.patch(
                "/api/v1/users/ada", headers=_bearer(key), json={"password": new_password}
            )
        )
        _sign_in(cp, "ada", new_password)
        cp.client.cookies.clear()
        entries = _ok(cp.client.get("/api/v1/admin/audit", headers=_bearer(key)))
        assert {"user.create", "api_key.create", "user.update"} <= {e["action"] for e in entries}
        (update,) = [e for e in entries if e["action"] == "user.update"]
        assert update["actor"].startswith("user:ada key:") and update["detail"]["password"] is True
        answered = str(entries) + str(_ok(cp.client.get("/api/v1/users", headers=cp.admin)))
        engine = create_engine(cp.ctx.settings.database_url.get_secret_value())
        with engine.connect() as conn:
            stored = [
                str(row)
                for table in ("users", "api_keys", "console_sessions", "audit_log")
                for row in conn.execute(text(f"SELECT * FROM {table}"))  # noqa: S608
            ]
        engine.dispose()
        (user_row,) = [row for row in stored if "'ada'" in row and "argon2id" in row]
        assert "$argon2id$" in user_row
        for secret in (PASSWORD, new_password, key, key[4:]):
            assert secret not in answered and secret not in caplog.text
            assert all(secret not in row for row in stored)
