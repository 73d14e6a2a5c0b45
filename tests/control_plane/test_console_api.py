"""The console's API on SQLite and PostgreSQL: the session cookie and CSRF rules,
the wizard's node setup with its manifest-entry checks, and GPU telemetry history."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from control_plane import RELEASE_VERSION
from tests.factories import (
    ADMIN_TOKEN,
    ControlPlane,
    control_plane,
    node_agent_entry,
    telemetry_body,
    write_release_manifest,
)

SESSION = "/api/v1/console/session"
ORIGIN = "http://testserver"


def sign_in(cp: ControlPlane) -> str:
    response = cp.client.post(SESSION, json={"admin_token": ADMIN_TOKEN})
    assert response.status_code == 201, response.text
    return str(response.json()["csrf_token"])


def test_sign_in_sets_a_strict_httponly_cookie_and_never_returns_the_token(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        response = cp.client.post(SESSION, json={"admin_token": ADMIN_TOKEN})
        assert response.status_code == 201
        cookie = response.headers["set-cookie"]
        assert cookie.startswith("modelforge_session=")
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
        assert "Max-Age=3600" in cookie
        assert "Secure" not in cookie  # plain http here; Secure is set when served over TLS
        assert ADMIN_TOKEN not in response.text + cookie
        assert response.headers["cache-control"] == "no-store"
        # The session (not the admin token) now reads the admin API ...
        assert cp.client.get("/api/v1/admin/nodes").status_code == 200
        # ... and a reloaded console recovers its CSRF token from the cookie alone.
        again = cp.client.get(SESSION)
        assert again.json()["csrf_token"] == response.json()["csrf_token"]


def test_secure_cookie_when_the_public_url_is_https(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url, public_url="https://cp.example:8443") as cp:
        cookie = cp.client.post(SESSION, json={"admin_token": ADMIN_TOKEN}).headers["set-cookie"]
        assert "Secure" in cookie


def test_wrong_token_is_refused_and_creates_no_session(
    tmp_path: Path, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "mfa_wrong_" + "x" * 30
    with control_plane(tmp_path, database_url) as cp:
        response = cp.client.post(SESSION, json={"admin_token": wrong})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "ADMIN_TOKEN_INVALID"
        assert "set-cookie" not in response.headers
        assert wrong not in response.text and wrong not in caplog.text
        refused = cp.client.post(SESSION, json={"admin_token": wrong, "extra": wrong})
        assert refused.status_code == 422 and wrong not in refused.text


def test_repeated_wrong_tokens_are_slowed_down(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        for _ in range(10):
            wrong = cp.client.post(SESSION, json={"admin_token": "mfa_guess_" + "g" * 20})
            assert wrong.status_code == 401
        limited = cp.client.post(SESSION, json={"admin_token": ADMIN_TOKEN})
        assert limited.status_code == 429  # even the right token waits: no oracle
        error = limited.json()["error"]
        assert error["code"] == "SIGN_IN_RATE_LIMITED" and "Wait 301 s" in error["next_step"]
        assert "set-cookie" not in limited.headers
        cp.clock.advance(301)
        assert cp.client.post(SESSION, json={"admin_token": ADMIN_TOKEN}).status_code == 201
        # A success clears the record: one more mistake is not held against the operator.
        assert (
            cp.client.post(SESSION, json={"admin_token": "mfa_typo_" + "t" * 20}).status_code == 401
        )
        assert cp.client.post(SESSION, json={"admin_token": ADMIN_TOKEN}).status_code == 201


def test_changes_through_a_session_need_the_csrf_token(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        csrf = sign_in(cp)
        body = {"display_name": "gpu-9", "expires_in_seconds": 300}
        url = "/api/v1/admin/node-enrollments"
        missing = cp.client.post(url, json=body)
        assert missing.status_code == 403
        assert missing.json()["error"]["code"] == "CSRF_TOKEN_MISSING"
        wrong = cp.client.post(url, json=body, headers={"X-ModelForge-CSRF": "0" * 64})
        assert wrong.json()["error"]["code"] == "CSRF_TOKEN_INVALID"
        odd = cp.client.post(url, json=body, headers={"X-ModelForge-CSRF": "é".encode()})
        assert odd.status_code == 403  # not a 500: any header value is just wrong
        assert odd.json()["error"]["code"] == "CSRF_TOKEN_INVALID"
        assert cp.client.get(url).json() == []  # neither refusal created anything
        ok = cp.client.post(url, json=body, headers={"X-ModelForge-CSRF": csrf})
        assert ok.status_code == 201


def test_sign_out_ends_the_session_server_side(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        csrf = sign_in(cp)
        stolen = cp.client.cookies.get("modelforge_session")
        assert cp.client.delete(SESSION).status_code == 403  # sign-out is a change: CSRF too
        out = cp.client.delete(SESSION, headers={"X-ModelForge-CSRF": csrf})
        assert out.status_code == 204
        assert 'modelforge_session=""' in out.headers["set-cookie"]
        # A copy of the cookie taken before sign-out is dead too.
        cp.client.cookies.set("modelforge_session", str(stolen))
        again = cp.client.get("/api/v1/admin/nodes")
        assert again.status_code == 401
        assert again.json()["error"]["code"] == "SESSION_INVALID"


def test_session_expires(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url, console_session_seconds=600) as cp:
        sign_in(cp)
        cp.clock.advance(601)
        expired = cp.client.get("/api/v1/admin/nodes")
        assert expired.status_code == 401
        assert expired.json()["error"]["code"] == "SESSION_EXPIRED"
        from control_plane.background.loops import prune

        assert prune(cp.ctx) >= 1  # the expired row is swept


def setup_request(
    cp: ControlPlane, enrollment_id: str, *, origin: str = ORIGIN, **body: Any
) -> Any:
    """The wizard's node-setup call from a console at `origin`. The test client's own origin,
    http://testserver, is plain http:// beyond loopback: confirmed as a trusted LAN unless the
    body says otherwise (test_plain_http_*)."""
    payload = {"api_origin": origin, "accelerator_mode": "cpu", "allow_insecure_http": True, **body}
    return cp.client.post(
        f"/api/v1/admin/node-enrollments/{enrollment_id}/node-setup",
        headers={**cp.admin, "Origin": origin},
        json=payload,
    )


def test_node_setup_renders_env_and_commands_without_secrets(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.mint(expires_in_seconds=300)
        entry = json.dumps({"images": {"modelforge-node-agent": node_agent_entry()}})
        response = setup_request(cp, minted["enrollment_id"], manifest_entry=entry)
        assert response.status_code == 200, response.text
        setup = response.json()
        assert setup["node_id"] == minted["node_id"]
        assert setup["image"] == f"modelforge-node-agent:{RELEASE_VERSION}"
        assert f"MODELFORGE_AGENT_CONTROL_PLANE_URL={ORIGIN}\n" in setup["env_file"]
        assert "TOKEN" not in setup["env_file"].replace("token at a", "")
        for text in (setup["env_file"], setup["start_command"], setup["recreate_command"]):
            assert minted["token"] not in text
        assert "--no-build" in setup["start_command"] and "--pull never" in setup["start_command"]
        assert "set +x" in setup["start_command"] and "read -rs" in setup["start_command"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tag": "modelforge-node-agent:9.9.9"}, "tag expected"),
        ({"rootfs_layers": ["sha256:" + "1" * 64, "sha256:" + "3" * 64]}, "rootfs_layers[1]"),
        ({"rootfs_layers": ["sha256:" + "1" * 64]}, "rootfs_layers (count)"),
        ({"architecture": "arm64"}, "architecture expected 'amd64'"),
        (
            {"labels": {**node_agent_entry()["labels"], "org.opencontainers.image.revision": "x"}},
            "label org.opencontainers.image.revision",
        ),
        ({"labels": {**node_agent_entry()["labels"], "extra": "1"}}, "label extra"),
    ],
)
def test_a_pasted_entry_that_differs_is_rejected_naming_the_field(
    tmp_path: Path, database_url: str, change: dict[str, Any], field: str
) -> None:
    manifest = write_release_manifest(tmp_path / "release-manifest.json")
    with control_plane(tmp_path, database_url, release_manifest=manifest) as cp:
        enrollment_id = cp.mint()["enrollment_id"]
        good = setup_request(
            cp, enrollment_id, manifest_entry=json.dumps(node_agent_entry(config_digest=None))
        )
        assert good.status_code == 200, good.text  # the build host's image ID is ignored
        assert "release-manifest.json" in good.json()["checked_against"]
        bad = setup_request(
            cp, enrollment_id, manifest_entry=json.dumps(node_agent_entry(**change))
        )
        assert bad.status_code == 422
        error = bad.json()["error"]
        assert error["code"] == "MANIFEST_ENTRY_MISMATCH"
        assert field in error["message"]
        assert "images.modelforge-node-agent" in error["next_step"]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"manifest_entry": "{not json"}, "MANIFEST_ENTRY_INVALID"),
        ({"manifest_entry": json.dumps({"tag": "x"})}, "MANIFEST_ENTRY_INVALID"),
        ({"manifest_entry": ""}, "MANIFEST_ENTRY_MISSING"),
        (
            {"manifest_entry": json.dumps(node_agent_entry(tag="modelforge-node-agent:0.0.1"))},
            "MANIFEST_ENTRY_MISMATCH",
        ),
        ({"image_source": "registry", "registry_image": "reg.example/agent:1.0"}, None),
        ({"api_origin": "http://testserver/console"}, "API_ORIGIN_INVALID"),
        ({"api_origin": "http://test$(id)server"}, "API_ORIGIN_INVALID"),
        ({"api_origin": "http://testserver:$(id)"}, "API_ORIGIN_INVALID"),
        ({"api_origin": "http://testserver:abc"}, "API_ORIGIN_INVALID"),
        ({"api_origin": "http://testserver:99999"}, "API_ORIGIN_INVALID"),
        ({"api_origin": "http://testserver:0"}, "API_ORIGIN_INVALID"),
        ({"api_origin": "http://testserver:+80"}, "API_ORIGIN_INVALID"),
        ({"api_origin": "ftp://testserver"}, "API_ORIGIN_INVALID"),
        ({"api_origin": "http://user@testserver"}, "API_ORIGIN_INVALID"),
        ({"api_origin": "http://test_server"}, "API_ORIGIN_INVALID"),
        ({"api_origin": "http://999.0.0.1"}, "API_ORIGIN_INVALID"),
        ({"api_origin": "http://[fe80::1%eth0]:8000"}, "API_ORIGIN_INVALID"),
        ({"api_origin": "http://elsewhere.example"}, "API_ORIGIN_MISMATCH"),
    ],
)
def test_bad_node_setup_input_gets_a_specific_code(
    tmp_path: Path, database_url: str, body: dict[str, Any], code: str | None
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrollment_id = cp.mint()["enrollment_id"]
        payload = {"manifest_entry": json.dumps(node_agent_entry()), **body}
        response = setup_request(cp, enrollment_id, **payload)
        assert response.status_code == 422
        assert response.json()["error"]["code"] == (code or "REGISTRY_IMAGE_NOT_PINNED")


@pytest.mark.parametrize(
    ("api_origin", "written"),
    [
        ("http://testserver", "http://testserver"),
        ("http://testserver/", "http://testserver"),
        ("HTTP://TestServer", "http://testserver"),
    ],
)
def test_a_valid_api_origin_is_written_in_canonical_form(
    tmp_path: Path, database_url: str, api_origin: str, written: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrollment_id = cp.mint()["enrollment_id"]
        response = setup_request(
            cp, enrollment_id, api_origin=api_origin, manifest_entry=json.dumps(node_agent_entry())
        )
        assert response.status_code == 200, response.text
        assert f"MODELFORGE_AGENT_CONTROL_PLANE_URL={written}\n" in response.json()["env_file"]


def test_plain_http_beyond_loopback_is_written_only_once_the_operator_confirms(
    tmp_path: Path, database_url: str
) -> None:
    entry = json.dumps(node_agent_entry())
    with control_plane(tmp_path, database_url) as cp:
        enrollment_id = cp.mint()["enrollment_id"]
        refused = setup_request(cp, enrollment_id, manifest_entry=entry, allow_insecure_http=False)
        assert refused.status_code == 422
        error = refused.json()["error"]
        assert error["code"] == "INSECURE_HTTP_NOT_CONFIRMED"
        assert "unencrypted" in error["message"] and "https://" in error["next_step"]

        confirmed = setup_request(cp, enrollment_id, manifest_entry=entry)
        assert confirmed.status_code == 200, confirmed.text
        assert confirmed.json()["insecure_http"] is True
        assert "\nMODELFORGE_AGENT_ALLOW_INSECURE_HTTP=true\n" in confirmed.json()["env_file"]

        # Loopback and https:// need no opt-in: none is written, and a confirmation is refused.
        for origin in ("http://127.0.0.1:8000", "https://cp.lan:8443", "http://[::1]:8000"):
            plain = setup_request(
                cp, enrollment_id, origin=origin, manifest_entry=entry, allow_insecure_http=False
            )
            assert plain.status_code == 200, plain.text
            assert plain.json()["insecure_http"] is False
            assert "ALLOW_INSECURE_HTTP" not in plain.json()["env_file"]
            needless = setup_request(cp, enrollment_id, origin=origin, manifest_entry=entry)
            assert needless.status_code == 422
            assert needless.json()["error"]["code"] == "INSECURE_HTTP_NOT_NEEDED"

        # A public address is no LAN: refused even when confirmed.
        public = setup_request(
            cp, enrollment_id, origin="http://8.8.8.8:8000", manifest_entry=entry
        )
        assert public.status_code == 422
        assert public.json()["error"]["code"] == "INSECURE_HTTP_PUBLIC"


#: Out of the agent's bounds, or not a whole number: each refused, naming the field.
BAD_OFFERS = [
    ("parallel", 0),
    ("parallel", 257),
    ("parallel", "3"),
    ("parallel", True),
    ("parallel", 2.5),
    ("cpus", 0),
    ("cpus", 100_001),
    ("gpus", -1),
    ("gpus", 65),
    ("ram_mb", 0),
    ("ram_mb", 2**31),
    ("max_idle_seconds", -1),
    ("max_idle_seconds", 365 * 24 * 3600 + 1),
]


def test_what_the_node_offers_reaches_the_env_file_only_when_given(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrollment_id = cp.mint()["enrollment_id"]
        entry = json.dumps(node_agent_entry())
        offer = {"parallel": 3, "cpus": 8, "gpus": 0, "ram_mb": 16000, "max_idle_seconds": 900}
        given = setup_request(cp, enrollment_id, manifest_entry=entry, **offer)
        assert given.status_code == 200, given.text
        env_file = given.json()["env_file"]
        for line in (
            "MODELFORGE_AGENT_PARALLEL=3",
            "MODELFORGE_AGENT_CPUS=8",
            "MODELFORGE_AGENT_GPUS=0",
            "MODELFORGE_AGENT_RAM_MB=16000",
            "MODELFORGE_AGENT_MAX_IDLE_SECONDS=900",
            "MODELFORGE_AGENT_RESTART=on-failure",
        ):
            assert f"\n{line}\n" in env_file
        # The start command writes that same `.env`.
        assert "\nMODELFORGE_AGENT_PARALLEL=3\n" in given.json()["start_command"]
        left_out = setup_request(cp, enrollment_id, manifest_entry=entry)
        assert left_out.status_code == 200, left_out.text
        assert "MODELFORGE_AGENT_PARALLEL" not in left_out.json()["env_file"]
        assert "MODELFORGE_AGENT_RESTART" not in left_out.json()["env_file"]

        for field, value in BAD_OFFERS:
            bad = setup_request(cp, enrollment_id, manifest_entry=entry, **{field: value})
            assert bad.status_code == 422, (field, value, bad.text)
            error = bad.json()["error"]
            assert error["code"] == "INVALID_REQUEST", (field, value)
            assert error["message"].startswith(f"The request is not valid: {field}: "), error
            assert error["next_step"]


def test_registry_image_pinned_by_digest(tmp_path: Path, database_url: str) -> None:
    image = "registry.example:5000/modelforge/node-agent@sha256:" + "f" * 64
    with control_plane(tmp_path, database_url) as cp:
        enrollment_id = cp.mint()["enrollment_id"]
        response = setup_request(cp, enrollment_id, image_source="registry", registry_image=image)
        assert response.status_code == 200, response.text
        assert response.json()["image"] == image
        assert 'docker pull "$image"' in response.json()["start_command"]


def test_telemetry_history_for_the_charts(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        headers = cp.agent(enrolled["credential"])
        for _ in range(3):
            sent = cp.client.post("/api/v1/agent/telemetry", headers=headers, json=telemetry_body())
            assert sent.status_code == 200, sent.text
            cp.clock.advance(30)
        url = f"/api/v1/admin/nodes/{enrolled['node_id']}/telemetry"
        points = cp.client.get(url, headers=cp.admin, params={"minutes": 10}).json()
        assert len(points) == 3
        assert points[0]["at"] < points[-1]["at"]
        assert points[0]["gpus"][0]["utilization_percent"] == 37.0
        assert points[0]["cpu_percent"] == 12.5
        cp.clock.advance(60)  # now t0+150: the window from t0+30 holds two samples
        recent = cp.client.get(url, headers=cp.admin, params={"minutes": 2}).json()
        assert len(recent) == 2


def test_console_pages_and_assets_are_served_with_security_headers(tmp_path: Path) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from control_plane.api.console import mount_console

    dist = tmp_path / "dist"
    (dist / "assets").mkdir(parents=True)
    (dist / "index.html").write_text("<!doctype html><title>ModelForge console</title>")
    (dist / "assets" / "index-abc.js").write_text("console.log(1)")
    app = FastAPI()
    mount_console(app, dist)
    client = TestClient(app)
    screens = ("/", "/hardware", "/nodes", "/jobs", "/services", "/models", "/artifacts")
    pages = (*screens, "/provisioning", "/audit", "/jobs/job_abc", "/services/svc_abc")
    for path in pages:
        page = client.get(path)
        assert page.status_code == 200 and "ModelForge console" in page.text
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["cache-control"] == "no-store"
    assert client.get("/assets/index-abc.js").text == "console.log(1)"
    assert client.get("/jobs/a/b").status_code == 404  # not a console route

    unbuilt = FastAPI()
    mount_console(unbuilt, tmp_path / "missing")
    page = TestClient(unbuilt).get("/")
    assert page.status_code == 503 and "make install" in page.text
