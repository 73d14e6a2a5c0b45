"""What is the agent's relay's own (`node_agent/tunnel.py`, native/tunnel_relay): that the
credential reaches it only on its stdin, that the replicas' ports reach it as they change, its
TLS, that a relay that dies is started again, and that the agent stopping ends it. The tunnel's
whole path is tests/control_plane/test_tunnel.py's."""

from __future__ import annotations

import logging
import os
import signal
import ssl
import threading
from pathlib import Path

import httpx
import pytest

from node_agent.tunnel import RELAY, NativeTunnel

# The door server, the replica and their fixtures are test_tunnel's.
from tests.control_plane.test_tunnel import DoorServer, Replica, _wait, replica, server  # noqa: F401
from tests.e2e.tls import make_private_pki


def test_the_credential_reaches_the_relay_only_on_its_stdin_and_is_never_logged(
    server: DoorServer,  # noqa: F811 - test_tunnel's fixture
    replica: Replica,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    enrolled = server.enroll()
    credential = enrolled["credential"]
    ports = {"r1": replica.port}
    stop = threading.Event()
    tunnel = NativeTunnel(
        binary=RELAY,
        control_plane_url=server.url,
        credential=credential,
        ports=lambda: dict(ports),
        stop=stop,
    )
    caplog.set_level(logging.DEBUG, logger="modelforge.node_agent.tunnel")
    tunnel.start()
    try:
        _wait(lambda: enrolled["node_id"] in server.stats()["nodes"], "no tunnel")
        process = tunnel.process
        assert process is not None
        for view in ("cmdline", "environ"):
            assert credential.encode() not in Path(f"/proc/{process.pid}/{view}").read_bytes()
        assert credential not in repr(tunnel)
        through = f"{server.url}/_tunnel/{enrolled['node_id']}"
        assert httpx.get(f"{through}/r1/hello", timeout=30).status_code == 200

        # A replica that starts later is reachable once the agent's view has its port.
        other = Replica().start()
        try:
            assert httpx.get(f"{through}/r2/hello", timeout=30).text == "NO_SUCH_REPLICA"
            ports["r2"] = other.port
            answer = httpx.get(f"{through}/r2/hello", timeout=30)
            assert (answer.status_code, answer.text) == (200, "GET /hello None")
        finally:
            other.stop()

        # A relay that dies is started again, and the tunnel opens again.
        os.kill(process.pid, signal.SIGKILL)
        _wait(lambda: tunnel.process not in (None, process), "the relay was not restarted")
        _wait(lambda: tunnel.connections == 2 and tunnel.connected.is_set(), "no second tunnel")
        assert httpx.get(f"{through}/r1/hello", timeout=30).status_code == 200
        restarted = tunnel.process
    finally:
        stop.set()
    # The agent stopping ends the relay (its stdin closes) and the tunnel with it.
    assert restarted is not None
    assert restarted.wait(10) == 0
    _wait(lambda: enrolled["node_id"] not in server.stats()["nodes"], "the tunnel stayed open")
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "tunnel relay: tunnel open" in logged
    assert credential not in logged


def test_over_tls_the_relay_trusts_the_private_ca_and_the_names_it_vouches_for(
    tmp_path: Path,
    replica: Replica,  # noqa: F811 - test_tunnel's fixture
    caplog: pytest.LogCaptureFixture,
) -> None:
    pki = make_private_pki(tmp_path / "pki")  # the server's certificate: 127.0.0.1, localhost
    other = make_private_pki(tmp_path / "other")
    live = DoorServer(
        data_dir=tmp_path / "data",
        database_url=f"sqlite:///{tmp_path}/cp.db",
        env_overrides={
            "MODELFORGE_TLS_CERT": str(pki.server_cert),
            "MODELFORGE_TLS_KEY": str(pki.server_key),
        },
        ca_file=pki.ca_cert,
    )
    caplog.set_level(logging.INFO, logger="modelforge.node_agent.tunnel")
    with live:
        enrolled = live.enroll()

        def tunnel(host: str, **tls: object) -> tuple[NativeTunnel, threading.Event]:
            url = f"https://{host}:{live.port}"
            stop = threading.Event()
            started = NativeTunnel(
                binary=RELAY,
                control_plane_url=url,
                credential=enrolled["credential"],
                ports=lambda: {"r1": replica.port},
                stop=stop,
                **tls,  # type: ignore[arg-type]
            )
            started.start()
            return started, stop

        def refused(host: str, why: str, **tls: object) -> None:
            caplog.clear()
            untrusting, stop = tunnel(host, **tls)
            try:
                _wait(lambda: why in caplog.text, f"no TLS refusal ({why}) logged")
                assert "tunnel relay: tunnel open" not in caplog.text
                assert not untrusting.connected.is_set()
                assert enrolled["node_id"] not in live.stats()["nodes"]
            finally:
                stop.set()

        # Not told of the private CA (the system's roots do not vouch for it), or told of
        # another one: no tunnel.
        refused("127.0.0.1", "invalid peer certificate: UnknownIssuer")
        # (The other CA bears the same name: its signature, not its name, is what fails.)
        refused("127.0.0.1", "invalid peer certificate: BadSignature", ca_cert_path=other.ca_cert)
        # The right CA, but the same server reached by an address its certificate does not
        # name (127.0.0.1 as an IPv6 address): no tunnel.
        refused("[::ffff:127.0.0.1]", "not valid for name", ca_cert_path=pki.ca_cert)

        # Named by its IP address or by its DNS name, with the private CA: a tunnel.
        for host in ("127.0.0.1", "localhost"):
            trusting, stop = tunnel(host, ca_cert_path=pki.ca_cert)
            try:
                _wait(lambda: enrolled["node_id"] in live.stats()["nodes"], f"no tunnel to {host}")
                through = f"{live.url}/_tunnel/{enrolled['node_id']}/r1/hello"
                answer = httpx.get(
                    through, timeout=30, verify=ssl.create_default_context(cafile=pki.ca_cert)
                )
                assert (answer.status_code, answer.text) == (200, "GET /hello None")
            finally:
                stop.set()
            _wait(lambda: enrolled["node_id"] not in live.stats()["nodes"], "the tunnel stayed")

        # With verification turned off (the agent warns loudly at its start), nothing is checked.
        unchecking, stop = tunnel("[::ffff:127.0.0.1]", tls_verify=False)
        try:
            _wait(lambda: enrolled["node_id"] in live.stats()["nodes"], "no unchecked tunnel")
            _wait(unchecking.connected.is_set, "the agent does not know it is open")
        finally:
            stop.set()
