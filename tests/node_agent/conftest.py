"""Fixtures for node agent tests: the substitute NVML, agent environments and processes, and a
real HTTP server that records every request it receives (to prove nothing was sent), standing in
for the control plane."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from node_agent.client import ControlPlane, connect
from tests.nvml_substitute import SCENARIO_ENV, build_fake_nvml


@pytest.fixture(scope="session")
def fake_nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))


def agent_env(
    state: Path,
    *,
    url: str = "http://127.0.0.1:9",
    mode: str = "cpu",
    token: str | None = "mfe_test-token-0123456789",
    nvml_dir: Path | None = None,
    scenario: str | None = None,
    **extra: str,
) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MODELFORGE_", "NVIDIA_", "LD_LIBRARY_PATH"))
    }
    env.update(
        MODELFORGE_AGENT_CONTROL_PLANE_URL=url,
        MODELFORGE_AGENT_ACCELERATOR_MODE=mode,
        MODELFORGE_AGENT_STATE_VOLUME=str(state),
        MODELFORGE_AGENT_WORKER_SOCKET=str(state.parent / "worker.sock"),
        MODELFORGE_AGENT_SOCKET=str(state.parent / "agent.sock"),
        MODELFORGE_ARTIFACT_CACHE=str(state.parent / "cache"),
        MODELFORGE_AGENT_PREFLIGHT_TIMEOUT_SECONDS="5",
    )
    if token:
        env["MODELFORGE_AGENT_ENROLLMENT_TOKEN"] = token
    if nvml_dir is not None:
        env["LD_LIBRARY_PATH"] = str(nvml_dir)
    if scenario is not None:
        env[SCENARIO_ENV] = scenario
    env.update(extra)
    return env


def run_agent(
    env: dict[str, str], *args: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node_agent", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def control_plane_client(url: str, stop: threading.Event | None = None) -> ControlPlane:
    """The agent's own client for `url`, as the agent builds it (plain HTTP on loopback)."""
    return connect(
        url, tls_verify=True, ca_cert_path=None, timeout=10, stop=stop or threading.Event()
    )


def start_agent(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """The agent as a long-running process, its output going to `log`."""
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "node_agent"], env=env, stdout=handle, stderr=subprocess.STDOUT
        )


def stop_agent(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return process.wait(timeout=20)


ENROLL = "/api/v1/agent/enroll"
HEARTBEAT = "/api/v1/agent/heartbeat"
TELEMETRY = "/api/v1/agent/telemetry"
INVENTORY = "/api/v1/agent/inventory"
CLAIM = "/api/v1/agent/work/claim"

#: The control plane's answer to an enrollment, with intervals short enough for tests.
ENROLLED = {
    "node_id": "node_x",
    "credential": "cred.jwt.value",
    "labels": {},
    "heartbeat_interval_seconds": 0.2,
    "telemetry_interval_seconds": 60,
}

#: A body, or raw bytes sent as `application/octet-stream`.
Answer = tuple[int, dict[str, Any] | bytes]


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: str
    #: When it arrived (time.monotonic()).
    at: float = field(default_factory=time.monotonic)


@dataclass
class RecordingServer:
    """A real HTTP server on loopback; `respond` decides each answer (default 404). A 204 is
    sent without a body; `respond` may take its time (each request has a thread)."""

    respond: Callable[[Recorded], Answer] = field(
        default=lambda _r: (404, {"error": {"code": "NOT_FOUND", "message": "", "next_step": ""}})
    )
    requests: list[Recorded] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None
    bind: str = "127.0.0.1"

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RecordingServer:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode(errors="replace")
                record = Recorded(self.command, self.path, dict(self.headers), body)
                outer.requests.append(record)
                status, answer = outer.respond(record)
                self.send_response(status)
                if status == 204:
                    self.end_headers()
                    return
                raw = isinstance(answer, bytes)
                payload = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                kind = "application/octet-stream" if raw else "application/json"
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = _handle  # noqa: N815

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer((self.bind, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def paths(self) -> list[str]:
        return [r.path for r in list(self.requests)]

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def recording_server() -> Iterator[RecordingServer]:
    server = RecordingServer().start()
    yield server
    server.stop()


def no_work(request: Recorded) -> Answer:
    """A work claim's long poll that finds nothing."""
    time.sleep(0.5)
    return 204, {}


@dataclass
class AgentProcess:
    """A real agent process, its output in `log`; `exit_code` once it was stopped."""

    process: subprocess.Popen[bytes]
    log: Path
    exit_code: int | None = None


@contextmanager
def agent_against(
    respond: Callable[[Recorded], Answer], tmp_path: Path
) -> Iterator[tuple[RecordingServer, AgentProcess]]:
    """A `RecordingServer` answering with `respond`, and a real agent (state under `tmp_path`)
    talking to it; on leaving, the agent is stopped (with SIGTERM, its exit code kept) and then
    the server."""
    server = RecordingServer(respond=respond).start()
    try:
        log = tmp_path / "agent.log"
        agent = AgentProcess(start_agent(agent_env(tmp_path / "state", url=server.url), log), log)
        try:
            yield server, agent
        finally:
            agent.exit_code = stop_agent(agent.process)
    finally:
        server.stop()
