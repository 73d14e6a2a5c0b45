"""A control plane served over TLS by Granian with a certificate from a private CA. The
agent connects when given the CA (MODELFORGE_AGENT_CA_CERT_PATH) and fails with a clear
certificate error without it; turning verification off is possible only with a loud warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.node import Node, wait_until
from tests.e2e.server import LiveServer
from tests.e2e.tls import make_private_pki

pytestmark = pytest.mark.e2e


def test_agent_trusts_a_private_ca_only_when_told(tmp_path: Path) -> None:
    pki = make_private_pki(tmp_path / "pki")
    env = {"MODELFORGE_TLS_CERT": str(pki.server_cert), "MODELFORGE_TLS_KEY": str(pki.server_key)}
    with LiveServer(
        tmp_path / "cp", f"sqlite:///{tmp_path / 'cp.db'}", env_overrides=env, ca_file=pki.ca_cert
    ) as server:
        assert server.url.startswith("https://")
        token = server.mint()["token"]

        with Node(tmp_path / "untrusting", server.url, token=token) as untrusting:
            untrusting.start_agent()
            wait_until(
                lambda: "TLS certificate verification failed" in untrusting.log(),
                15,
                "the certificate error",
            )
            log = untrusting.log()
            assert "MODELFORGE_AGENT_CA_CERT_PATH" in log
            assert "ConnectError on POST /api/v1/agent/enroll (backoff 1s…16s)" in log
            assert not (untrusting.state / "identity.json").exists()

        trusting = Node(
            tmp_path / "trusting",
            server.url,
            token=token,
            extra_env={"MODELFORGE_AGENT_CA_CERT_PATH": str(pki.ca_cert)},
        )
        with trusting:
            trusting.start_worker().start_agent()
            node_id = trusting.node_id()
            wait_until(
                lambda: server.get(f"/api/v1/admin/nodes/{node_id}")["state"] == "online",
                10,
                "online over TLS",
            )
            assert "TLS certificate verification failed" not in trusting.log()


def test_disabling_verification_warns_loudly(tmp_path: Path) -> None:
    pki = make_private_pki(tmp_path / "pki")
    env = {"MODELFORGE_TLS_CERT": str(pki.server_cert), "MODELFORGE_TLS_KEY": str(pki.server_key)}
    with LiveServer(
        tmp_path / "cp", f"sqlite:///{tmp_path / 'cp.db'}", env_overrides=env, ca_file=pki.ca_cert
    ) as server:
        node = Node(
            tmp_path / "node",
            server.url,
            token=server.mint()["token"],
            extra_env={"MODELFORGE_AGENT_TLS_VERIFY": "false"},
        )
        with node:
            node.start_agent()
            node.node_id()
            assert node.log().count("MODELFORGE_AGENT_TLS_VERIFY=false") >= 3
            assert "WARNING" in node.log()
