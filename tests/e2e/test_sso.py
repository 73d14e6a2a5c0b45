"""Single sign-on (issue 45) through a real OpenID provider on loopback (npm's oidc-provider,
pinned): its discovery document, login and consent pages, redirects, token endpoint and keys.
The control plane runs in this process on a manual clock set to now; the browser's part is
`oidc_provider.through_provider`. SQLite only: the flow's rows are one insert and one delete."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from joserfc import jwt
from joserfc.jwk import RSAKey
from pydantic import ValidationError
from sqlalchemy import update

from control_plane.access.oidc import OidcRefused
from control_plane.clock import ManualClock
from control_plane.models import OidcLogin
from control_plane.settings import Settings
from tests.e2e.oidc_provider import (
    CLIENT_ID,
    CLIENT_SECRET,
    CONSOLE,
    Provider,
    oidc_provider,
    through_provider,
)
from tests.e2e.server import LiveServer, free_port
from tests.factories import ADMIN_TOKEN, ControlPlane, control_plane, write_release_manifest

pytestmark = pytest.mark.e2e

PUBLIC_URL = "http://testserver"
PEOPLE = {
    "ada": ["ml-admins", "ml-team"],
    "olga": ["ml-team", "ml-ops"],
    "mia": ["ml-team"],
    "zed": ["somewhere-else"],
    "lena": ["ml-team"],
}
ID_TOKEN_TTL = 60
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def provider() -> Iterator[Provider]:
    redirect = f"{PUBLIC_URL}/api/v1/console/oidc/callback"
    with oidc_provider(redirect, PEOPLE, id_token_ttl=ID_TOKEN_TTL) as running:
        yield running


@pytest.fixture
def cp(tmp_path: Path, provider: Provider) -> Iterator[ControlPlane]:
    with control_plane(
        tmp_path,
        f"sqlite:///{tmp_path / 'cp.db'}",
        clock=ManualClock(datetime.now(UTC)),
        public_url=PUBLIC_URL,
        **provider.settings(),
    ) as running:
        yield running


def _begin(cp: ControlPlane) -> str:
    """Starts a sign-in; the provider's authorization URL (the verifier cookie is in cp.client)."""
    cp.client.cookies.clear()
    started = cp.client.get("/api/v1/console/oidc/login", follow_redirects=False)
    assert started.status_code == 303, started.text
    assert started.cookies.get("modelforge_oidc")
    return str(started.headers["location"])


def _callback(cp: ControlPlane, url: str) -> Any:
    parts = urlsplit(url)
    assert f"{parts.scheme}://{parts.netloc}" == PUBLIC_URL
    return cp.client.get(f"{parts.path}?{parts.query}", follow_redirects=False)


def _sign_in(cp: ControlPlane, login: str) -> Any:
    return _callback(cp, through_provider(_begin(cp), login))


def _refusal(answer: Any, code: str) -> None:
    assert answer.status_code in (400, 401, 403, 404, 409, 502), answer.text
    assert answer.headers["content-type"].startswith("text/html")
    assert code in answer.text and "Next step:" in answer.text, answer.text
    assert not answer.cookies.get("modelforge_session")


def test_people_sign_in_through_the_provider_with_the_role_their_groups_map_to(
    cp: ControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="control_plane")
    options = cp.client.get("/api/v1/console/sign-in-options").json()
    assert options == {"password": True, "sso": "Example SSO"}
    answer = _sign_in(cp, "ada")
    assert answer.status_code == 303 and answer.headers["location"] == "/"
    assert answer.cookies.get("modelforge_session")
    me = cp.client.get("/api/v1/me").json()
    assert (me["user"], me["role"], me["via"]) == ("ada", "admin", "session")
    csrf = cp.client.get("/api/v1/console/session").json()["csrf_token"]
    out = cp.client.delete("/api/v1/console/session", headers={"X-ModelForge-CSRF": csrf})
    assert out.status_code == 204
    assert cp.client.get("/api/v1/me").status_code == 401  # signed out

    assert _sign_in(cp, "olga").status_code == 303
    assert cp.client.get("/api/v1/me").json()["role"] == "operator"  # the highest of her groups
    assert _sign_in(cp, "olga").status_code == 303  # the same person the second time
    _sign_in(cp, "mia")
    assert cp.client.get("/api/v1/me").json()["role"] == "member"
    cp.client.cookies.clear()
    users = cp.client.get("/api/v1/users", headers=cp.admin).json()
    assert [(u["name"], u["role"], u["has_password"]) for u in users] == [
        ("ada", "admin", False),
        ("mia", "member", False),
        ("olga", "operator", False),
    ]
    assert all(u["created_by"] == "oidc" for u in users)
    # A disabled person is refused at the provider's return too.
    cp.client.patch("/api/v1/users/mia", headers=cp.admin, json={"disabled": True})
    _refusal(_sign_in(cp, "mia"), "USER_DISABLED")
    # Nobody whose groups map to no role gets in (no default role is set).
    _refusal(_sign_in(cp, "zed"), "OIDC_NO_ROLE")
    # A local user holds the name the provider gives: refused, the local user unchanged.
    local = {"name": "lena", "role": "viewer", "password": "lena's local passphrase"}
    assert cp.client.post("/api/v1/users", headers=cp.admin, json=local).status_code == 201
    _refusal(_sign_in(cp, "lena"), "OIDC_NAME_TAKEN")
    cp.client.cookies.clear()
    lena = cp.client.get("/api/v1/users/lena", headers=cp.admin).json()
    assert (lena["role"], lena["created_by"]) == ("viewer", "admin-token")
    assert CLIENT_SECRET not in caplog.text


def test_a_replayed_callback_a_replayed_code_and_another_browser_are_refused(
    cp: ControlPlane,
) -> None:
    back = through_provider(_begin(cp), "ada")
    assert _callback(cp, back).status_code == 303
    _refusal(_callback(cp, back), "OIDC_STATE_INVALID")  # the same answer again

    back = through_provider(_begin(cp), "ada")
    verifier = cp.client.cookies.get("modelforge_oidc")
    cp.client.cookies.clear()  # the callback reaches another browser: no verifier cookie
    _refusal(_callback(cp, back), "OIDC_STATE_INVALID")
    cp.client.cookies.set("modelforge_oidc", str(verifier), path="/api/v1/console/oidc")

    # Refused, that sign-in is used up: the right browser cannot finish it after.
    _refusal(_callback(cp, back), "OIDC_STATE_INVALID")

    # The provider refuses a code twice: asked directly, the second exchange fails.
    url = _begin(cp)
    verifier = cp.client.cookies.get("modelforge_oidc")
    back = through_provider(url, "ada")
    query = dict(part.split("=", 1) for part in urlsplit(back).query.split("&"))
    assert cp.ctx.oidc is not None and verifier
    with cp.ctx.session_factory.begin() as session:
        taken = cp.ctx.oidc.take(session, state=query["state"])
    claims = cp.ctx.oidc.finish(taken, code=query["code"], verifier=verifier)
    assert claims["preferred_username"] == "ada"
    with pytest.raises(OidcRefused) as refused:
        cp.ctx.oidc.finish(taken, code=query["code"], verifier=verifier)
    assert refused.value.code == "OIDC_CODE_REFUSED"


def test_an_expired_id_token_and_a_nonce_not_asked_for_are_refused(cp: ControlPlane) -> None:
    back = through_provider(_begin(cp), "ada")
    cp.clock.advance(ID_TOKEN_TTL + 61 + 5)  # past its exp and the leeway, not the login's life
    answer = _callback(cp, back)
    _refusal(answer, "OIDC_TOKEN_INVALID")
    assert "`exp`" in answer.text

    back = through_provider(_begin(cp), "ada")
    with cp.ctx.session_factory.begin() as session:
        session.execute(update(OidcLogin).values(nonce="not the nonce the provider was sent"))
    answer = _callback(cp, back)
    _refusal(answer, "OIDC_TOKEN_INVALID")
    assert "`nonce`" in answer.text


def _token(provider: Provider, key: RSAKey | None = None, **claims: Any) -> str:
    now = int(time.time())
    body = {
        "iss": provider.issuer,
        "aud": CLIENT_ID,
        "sub": "person-ada",
        "iat": now,
        "exp": now + 60,
        "nonce": "n-1",
    } | claims
    header = {"alg": "RS256", "kid": (key or provider.key).kid}
    return jwt.encode(header, body, key or provider.key)


def test_id_tokens_of_another_issuer_audience_key_or_time_are_refused(
    cp: ControlPlane, provider: Provider
) -> None:
    """Tokens signed with the provider's own key (or another), checked against the keys its
    JWKS endpoint serves: only the one with every claim right passes."""
    assert cp.ctx.oidc is not None
    check = cp.ctx.oidc.check_id_token
    assert check(_token(provider), nonce="n-1")["sub"] == "person-ada"
    stranger = RSAKey.generate_key(2048, parameters={"kid": "test-1"})
    unknown = RSAKey.generate_key(2048, parameters={"kid": "not-served"})
    wrong = {
        "iss": _token(provider, iss="https://evil.example"),
        "aud": _token(provider, aud="another-client"),
        "exp": _token(provider, iat=int(time.time()) - 600, exp=int(time.time()) - 300),
        "nonce": _token(provider, nonce="n-2"),
        "signature": _token(provider, key=stranger),
        "key": _token(provider, key=unknown),
    }
    for what, token in wrong.items():
        with pytest.raises(OidcRefused) as refused:
            check(token, nonce="n-1")
        assert refused.value.code == "OIDC_TOKEN_INVALID", what


def test_single_sign_on_settings_are_checked_at_start() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(oidc_issuer="http://idp.example", oidc_roles="team=root")
    message = str(refused.value)
    for missing in ("MODELFORGE_OIDC_CLIENT_ID", "MODELFORGE_OIDC_CLIENT_SECRET"):
        assert missing in message
    assert "MODELFORGE_PUBLIC_URL" in message and "https://" in message
    assert "group=role" in message
    good = Settings(
        oidc_issuer="https://idp.example",
        oidc_client_id="c",
        oidc_client_secret="s3cret-value",
        public_url="https://cp.example/",
        oidc_roles="a=admin, b=viewer",
    )
    assert good.oidc_redirect_uri == "https://cp.example/api/v1/console/oidc/callback"
    assert "s3cret-value" not in repr(good)


def test_without_single_sign_on_its_routes_say_so(tmp_path: Path) -> None:
    with control_plane(tmp_path, f"sqlite:///{tmp_path / 'cp.db'}") as cp:
        assert cp.client.get("/api/v1/console/sign-in-options").json()["sso"] is None
        _refusal(cp.client.get("/api/v1/console/oidc/login"), "OIDC_NOT_CONFIGURED")
        _refusal(
            cp.client.get("/api/v1/console/oidc/callback?code=x&state=y"), "OIDC_NOT_CONFIGURED"
        )


def test_single_sign_on_in_chromium(tmp_path: Path) -> None:
    """The console's button, the provider's real pages and redirects, in headless Chromium
    (control_plane/console/tests/sso-browser.mjs), against a control plane process."""
    node = shutil.which("node")
    assert node and CHROMIUM.exists(), "node and Debian's chromium (make test installs them)"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with oidc_provider(f"{url}/api/v1/console/oidc/callback", PEOPLE) as provider:
        overrides = {
            f"MODELFORGE_{name.upper()}": str(value)
            for name, value in provider.settings(public_url=url).items()
        }
        database = f"sqlite:///{tmp_path / 'cp.db'}"
        with LiveServer(tmp_path / "cp", database, overrides, port=port) as server:
            env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
            env.update(
                MODELFORGE_CONSOLE_URL=server.url,
                MODELFORGE_TEST_ADMIN_TOKEN=ADMIN_TOKEN,
                MODELFORGE_TEST_PYTHON=sys.executable,
                MODELFORGE_TEST_WORKDIR=str(tmp_path),
                MODELFORGE_TEST_MANIFEST=str(write_release_manifest(tmp_path / "manifest.json")),
                MODELFORGE_CONSOLE_SCREENSHOTS=os.environ.get(
                    "MODELFORGE_CONSOLE_SCREENSHOTS", str(tmp_path / "screenshots")
                ),
            )
            result = subprocess.run(
                [node, "--test", "--test-reporter=spec", "tests/sso-browser.mjs"],
                cwd=CONSOLE,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            log = server.log()
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert "ℹ pass 1" in report and "ℹ fail 0" in report, report
    assert CLIENT_SECRET not in log
