"""A service's second port (issue 26): `{grpc_port}` in a command becomes a free TCP port other
than `{port}` (also in GRPC_PORT), chosen again at each start, and the worker's status shows it;
a command without it gets none."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.runtime_worker.test_services import Worker, service, worker  # noqa: F401 - fixture

#: Records its argv and ports in OUT_DIR/ports.json, then serves HTTP on PORT.
TELLS_PORTS = """
import http.server, json, os, pathlib, sys
seen = {"argv": sys.argv[1:], "PORT": os.environ["PORT"], "GRPC_PORT": os.environ.get("GRPC_PORT")}
pathlib.Path(os.environ["OUT_DIR"], "ports.json").write_text(json.dumps(seen))
http.server.test(
    HandlerClass=http.server.SimpleHTTPRequestHandler, port=int(os.environ["PORT"]),
    bind="127.0.0.1",
)
"""


def test_grpc_port_is_a_second_free_port_shown_in_the_status(
    worker: Worker,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    command = [sys.executable, "-c", TELLS_PORTS, "--grpc-port", "{grpc_port}", "{port}"]
    body = service(command=command, env={"OUT_DIR": str(tmp_path)})
    worker.put("two-ports", body)
    worker.wait_for("two-ports", "healthy", state="healthy")
    seen = json.loads((tmp_path / "ports.json").read_text())
    status = worker.status("two-ports")
    assert seen["argv"] == ["--grpc-port", seen["GRPC_PORT"], seen["PORT"]]
    assert int(seen["GRPC_PORT"]) == status["grpc_port"] and int(seen["PORT"]) == status["port"]
    assert status["grpc_port"] != status["port"]
    worker.call("DELETE", "/v1/services/two-ports")

    plain = service(
        command=[sys.executable, "-c", TELLS_PORTS, "{port}"], env={"OUT_DIR": str(tmp_path)}
    )
    worker.put("one-port", plain)
    worker.wait_for("one-port", "healthy", state="healthy")
    assert json.loads((tmp_path / "ports.json").read_text())["GRPC_PORT"] is None
    assert worker.status("one-port")["grpc_port"] is None
    worker.call("DELETE", "/v1/services/one-port")
