"""TLS in the native gateway front (issue 40): with `MODELFORGE_TLS_CERT`/`MODELFORGE_TLS_KEY`
and `MODELFORGE_GATEWAY_FRONT=native`, the front terminates TLS on the control plane's port
(a certificate from a private CA), Granian serves behind it in plain HTTP on loopback, and

- a node agent given the CA enrolls over https and opens its tunnel over wss to the front;
- a command service on that node answers `/services/{name}/...` through the tunnel, and sees
  `X-Forwarded-Proto: https`;
- the API and the console's sign-in answer over https through the front, the session cookie
  `Secure` (the app knows the request came over https though Granian saw plain HTTP);
- plain HTTP on the port gets no answer;
- a key that is not the certificate's is a start-up error naming the file and the fix.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from control_plane.cli import EXIT_CONFIG
from tests.e2e.node import Node, wait_ready, wait_until
from tests.e2e.server import ADMIN_TOKEN, LiveServer, control_plane_executable
from tests.e2e.tls import PrivatePki, make_private_pki

pytestmark = pytest.mark.e2e

#: A command service that answers any GET with its path and the X-Forwarded-Proto it was sent.
ECHO = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        out = (self.path + " " + self.headers.get("X-Forwarded-Proto", "-")).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Echo).serve_forever()
"""


def _env(pki: PrivatePki) -> dict[str, str]:
    return {
        "MODELFORGE_TLS_CERT": str(pki.server_cert),
        "MODELFORGE_TLS_KEY": str(pki.server_key),
        "MODELFORGE_GATEWAY_FRONT": "native",
        "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Node]]:
    root = tmp_path_factory.mktemp("front-tls")
    pki = make_private_pki(root / "pki")
    with LiveServer(
        root / "cp", f"sqlite:///{root / 'cp.db'}", env_overrides=_env(pki), ca_file=pki.ca_cert
    ) as server:
        node = Node(
            root / "node",
            server.url,
            token=server.mint()["token"],
            extra_env={"MODELFORGE_AGENT_CA_CERT_PATH": str(pki.ca_cert)},
        )
        with node:
            node_id = node.start_worker().start_agent().node_id()
            wait_ready(server, node_id, 60)
            yield server, node


def test_the_front_terminates_tls_and_granian_stays_on_loopback(
    stack: tuple[LiveServer, Node],
) -> None:
    server, _ = stack
    assert server.url.startswith("https://")
    log = server.log()
    assert f"the native gateway front serves https://127.0.0.1:{server.port}" in log, log
    assert "the gateway runs in Python" not in log
    with server.client() as client:
        health = client.get("/api/v1/health")
        assert health.status_code == 200, health.text
        assert health.extensions["http_version"] == b"HTTP/1.1"
    # Plain HTTP on the TLS port is not served.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{server.port}/api/v1/health", timeout=5)


def test_the_console_signs_in_over_https_with_a_secure_cookie(
    stack: tuple[LiveServer, Node],
) -> None:
    server, _ = stack
    with server.client() as client:
        signed_in = client.post("/api/v1/console/session", json={"admin_token": ADMIN_TOKEN})
        assert signed_in.status_code == 201, signed_in.text
        cookie = signed_in.headers["set-cookie"].lower()
        assert "; secure" in cookie, cookie
        assert client.get("/api/v1/console/session").status_code == 200


def test_a_service_answers_through_the_tunnel_over_https(
    stack: tuple[LiveServer, Node], tmp_path: Path
) -> None:
    server, node = stack
    echo = tmp_path / "echo.py"
    echo.write_text(ECHO)
    with server.client(headers=server.admin) as client:
        created = client.post(
            "/api/v1/services",
            json={
                "name": "echo",
                "command": [sys.executable, str(echo), "{port}"],
                "health": {"path": "/", "interval_seconds": 0.5},
                "resources": {"cpus": 0.25},
            },
        )
        assert created.status_code < 300, created.text
        path = f"/api/v1/services/{created.json()['service_id']}"

        def healthy() -> bool:
            replicas = client.get(path).json().get("replicas", [])
            return any(replica["state"] == "healthy" for replica in replicas)

        wait_until(healthy, 60, "a healthy echo replica")
        minted = client.post(f"{path}/access-tokens", json={"name": "tls", "rate_per_second": None})
        assert minted.status_code < 300, minted.text
        token = minted.json()["token"]
    bearer = {"Authorization": f"Bearer {token}"}
    with server.client() as client:
        # The front's pushed routes can lag the replica's state by a moment (issue 40).
        wait_until(
            lambda: client.get("/services/echo/", headers=bearer).status_code == 200,
            10,
            "the echo service through the front",
        )
        answered = client.get("/services/echo/over/tls?x=1", headers=bearer)
    assert answered.status_code == 200, answered.text
    assert answered.text == "/over/tls?x=1 https"
    assert "tunnel" in node.log().lower()


def test_a_key_that_is_not_the_certificates_is_a_start_up_error(tmp_path: Path) -> None:
    pki = make_private_pki(tmp_path / "pki")
    other = make_private_pki(tmp_path / "other")
    server = LiveServer(
        tmp_path / "cp",
        f"sqlite:///{tmp_path / 'cp.db'}",
        env_overrides={**_env(pki), "MODELFORGE_TLS_KEY": str(other.server_key)},
    )
    done = subprocess.run(
        [control_plane_executable()], env=server.env(), capture_output=True, timeout=60
    )
    assert done.returncode == EXIT_CONFIG, done.stderr
    err = done.stderr.decode()
    assert f"MODELFORGE_TLS_KEY {other.server_key.resolve()} cannot serve the certificate" in err
    assert "set MODELFORGE_TLS_CERT to a PEM file" in err
    assert "BEGIN" not in err  # no key material
