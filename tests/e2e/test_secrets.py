"""No secret (admin token, enrollment token, node credential, signing key) appears in logs,
HTTP error bodies, process arguments or `repr()` — checked over a full flow against Granian."""

from __future__ import annotations

import secrets
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from control_plane.settings import Settings
from tests.e2e.server import LiveServer, control_plane_executable
from tests.factories import ADMIN_TOKEN, heartbeat_body, inventory_body, telemetry_body

pytestmark = pytest.mark.e2e


def test_full_flow_leaks_no_secret(tmp_path: Path, database_url: str) -> None:
    secrets_seen: list[str] = [ADMIN_TOKEN]
    error_bodies: list[str] = []

    def record(response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            error_bodies.append(response.text)
        return response

    with LiveServer(tmp_path / "data", database_url) as server, server.client() as client:
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()  # type: ignore[union-attr]
        admin = server.admin
        tokens = []
        for _ in range(4):
            minted = record(
                client.post(
                    "/api/v1/admin/node-enrollments",
                    headers=admin,
                    json={"display_name": "s", "expires_in_seconds": 300},
                )
            )
            tokens.append(minted.json())
        secrets_seen += [t["token"] for t in tokens]
        nonce = secrets.token_hex(16)
        secrets_seen.append(nonce)

        def enroll(token: str, **extra: object) -> httpx.Response:
            body = {
                "token": token,
                "claim_nonce": nonce,
                "hostname": "h",
                "protocol_version": 1,
                "agent_version": "0.1.0",
                **extra,
            }
            return record(client.post("/api/v1/agent/enroll", json=body))

        enrolled = enroll(tokens[0]["token"]).json()
        credential = enrolled["credential"]
        secrets_seen.append(credential)
        auth = {"Authorization": f"Bearer {credential}"}
        record(client.post("/api/v1/agent/heartbeat", headers=auth, json=heartbeat_body()))
        record(client.put("/api/v1/agent/inventory", headers=auth, json=inventory_body()))
        record(client.post("/api/v1/agent/telemetry", headers=auth, json=telemetry_body()))
        # Refusals that carry secrets in the request.
        enroll(tokens[0]["token"].upper())  # unknown
        enroll(tokens[0]["token"], claim_nonce=secrets.token_hex(16))  # used
        record(
            client.post(
                f"/api/v1/admin/node-enrollments/{tokens[1]['enrollment_id']}/revoke", headers=admin
            )
        )
        enroll(tokens[1]["token"])  # revoked
        enroll(tokens[2]["token"], protocol_version="x")  # 426
        enroll(tokens[2]["token"] * 10)  # too long: 422
        enroll(tokens[2]["token"], hostname="has space")  # 422 with a token inside
        record(client.post("/api/v1/agent/heartbeat", headers=auth, json={"token": credential}))
        record(
            client.post(
                "/api/v1/agent/heartbeat",
                headers={"Authorization": credential},
                json=heartbeat_body(),
            )
        )
        record(
            client.post(
                "/api/v1/agent/heartbeat",
                headers={"Authorization": f"Bearer {credential}x"},
                json=heartbeat_body(),
            )
        )
        record(
            client.get(
                "/api/v1/admin/nodes", headers={"X-ModelForge-Admin-Token": tokens[3]["token"]}
            )
        )
        record(
            client.get(
                "/api/v1/admin/nodes", headers={"X-ModelForge-Admin-Token": ADMIN_TOKEN + "x"}
            )
        )
        record(
            client.post(
                f"/api/v1/admin/nodes/{enrolled['node_id']}/credential/revoke", headers=admin
            )
        )
        record(client.post("/api/v1/agent/heartbeat", headers=auth, json=heartbeat_body()))
        record(client.post("/api/v1/admin/signing-key/rotate", headers=admin))
        record(client.get(f"/api/v1/admin/nodes/{enrolled['node_id']}", headers=admin))
        record(client.get("/api/v1/admin/node-enrollments", headers=admin))
    log = server.log()
    key = (tmp_path / "data" / "signing-key.pem").read_text()
    secrets_seen.append(key.splitlines()[1])  # the base64 body of the private key

    assert len(error_bodies) >= 12
    assert "CREDENTIAL_REVOKED" in "".join(error_bodies)
    assert "request" in log.lower() or "granian" in log.lower()  # the log was captured
    for secret in secrets_seen:
        assert secret not in log
        assert secret.encode() not in cmdline
        for body in error_bodies:
            assert secret not in body


def test_generated_admin_token_file(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    server = LiveServer(data_dir, f"sqlite:///{tmp_path / 'cp.db'}")
    env = server.env()
    del env["MODELFORGE_ADMIN_TOKEN"]
    executable = control_plane_executable()
    log_path = tmp_path / "log.txt"
    with log_path.open("w") as log:
        process = subprocess.Popen([executable], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{server.url}/api/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        token_file = data_dir / "admin-token"
        token = token_file.read_text().strip()
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        ok = httpx.get(
            f"{server.url}/api/v1/admin/nodes", headers={"X-ModelForge-Admin-Token": token}
        )
        assert ok.status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)
    output = log_path.read_text()
    assert str(token_file) in output
    assert f"http://127.0.0.1:{server.port}" in output
    assert token not in output


def test_settings_repr_hides_secrets(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        admin_token=SecretStr("mfa_super-secret-admin-token"),
        database_url=SecretStr("postgresql+psycopg://u:db-password@127.0.0.1/x"),
    )
    shown = repr(settings) + str(settings) + str(settings.model_dump())
    assert "super-secret" not in shown and "db-password" not in shown
