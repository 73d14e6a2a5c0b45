"""Where a service listens (issue 27: direct mode off by default): the address its agent sends
as `host` (`127.0.0.1` when none is sent) reaches a command as `{host}` and `HOST`; the `onnx`
runner listens on it, its HTTP and gRPC ports alike, on loopback only unless told `0.0.0.0`;
a host that is not an IP address is refused and starts nothing."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from tests.onnx_models import relu_matmul
from tests.runtime_worker.test_services import Worker, service, worker  # noqa: F401 - fixture

#: Records its argv and HOST in OUT_DIR/host.json, then serves HTTP on HOST:PORT.
TELLS_HOST = """
import http.server, json, os, pathlib, sys
seen = {"argv": sys.argv[1:], "HOST": os.environ.get("HOST")}
pathlib.Path(os.environ["OUT_DIR"], "host.json").write_text(json.dumps(seen))
http.server.ThreadingHTTPServer(
    (os.environ["HOST"], int(os.environ["PORT"])), http.server.SimpleHTTPRequestHandler
).serve_forever()
"""


def listening_on(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on `port` on this machine (IPv4 and
    IPv6, an IPv4-mapped one as its IPv4 address: gRPC listens so), from /proc/net."""
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path(f"/proc/net/{table}")
        if not path.exists():
            continue
        for row in path.read_text().splitlines()[1:]:
            fields = row.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] != "0A" or int(hex_port, 16) != port:  # 0A: TCP_LISTEN
                continue
            raw = bytes.fromhex(address)
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            text = socket.inet_ntop(family, words)
            found.add(text.removeprefix("::ffff:") if "." in text else text)  # IPv4-mapped
    return found


def test_a_command_gets_the_address_to_listen_on_as_host(
    worker: Worker,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    command = [sys.executable, "-c", TELLS_HOST, "--bind", "{host}"]
    for service_id, sent, expected in (
        ("quiet", None, "127.0.0.1"),  # an agent that sends none: this node only
        ("direct", "0.0.0.0", "0.0.0.0"),  # noqa: S104 - a node with direct access on
    ):
        out = tmp_path / service_id
        out.mkdir()
        body = service(command=command, env={"OUT_DIR": str(out)})
        if sent is not None:
            body["host"] = sent
        assert worker.put(service_id, body)[0] == 201
        worker.wait_for(service_id, "healthy", state="healthy")
        seen = json.loads((out / "host.json").read_text())
        assert seen == {"argv": ["--bind", expected], "HOST": expected}
        assert listening_on(worker.status(service_id)["port"]) == {expected}
        worker.call("DELETE", f"/v1/services/{service_id}")


def test_the_onnx_runner_listens_on_loopback_unless_told_every_interface(
    worker: Worker,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    import numpy as np

    weights = tmp_path / "model.onnx"
    weights.write_bytes(relu_matmul(np.eye(2, dtype=np.float32)))
    # gRPC takes 0.0.0.0 for every interface, IPv6 included, and listens on '::'.
    every_interface = {"0.0.0.0", "::"}  # noqa: S104
    for service_id, sent, expected in (
        ("onnx-local", "127.0.0.1", {"127.0.0.1"}),
        ("onnx-direct", "0.0.0.0", every_interface),  # noqa: S104 - direct access on
    ):
        body = service(
            command=None,
            runner="onnx",
            weights_path=str(weights),
            host=sent,
            health={"interval_seconds": 0.2, "start_period_seconds": 60},
        )
        assert worker.put(service_id, body)[0] == 201
        worker.wait_for(service_id, "healthy", timeout=60, state="healthy")
        status = worker.status(service_id)
        for port in (status["port"], status["grpc_port"]):
            found = listening_on(port)
            assert found and found <= expected, (port, found, status)
        worker.call("DELETE", f"/v1/services/{service_id}")


def test_a_host_that_is_not_an_ip_address_is_refused_and_starts_nothing(
    worker: Worker,  # noqa: F811 - the fixture
) -> None:
    for bad in ("gpu-box.lan", "127.0.0.1:80", "", 1):
        status, answer = worker.put("web", service(host=bad))
        assert status == 400, answer
        assert answer["error"]["code"] == "INVALID_SERVICE"
        assert "host must be the IP address to listen on" in answer["error"]["message"]
    assert worker.call("GET", "/v1/services")[1]["services"] == []
