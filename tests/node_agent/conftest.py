"""Fixtures for node agent tests: the substitute NVML, agent environments and processes, and a
real HTTP server that records every request it receives (to prove nothing was sent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

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


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: str


@dataclass
class RecordingServer:
    """A real HTTP server on loopback; `respond` decides each answer (default 404)."""

    respond: Callable[[Recorded], tuple[int, dict[str, Any]]] = field(
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
                record = Recorded(
                    self.command, self.path, dict(self.headers), self.rfile.read(length).decode()
                )
                outer.requests.append(record)
                status, body = outer.respond(record)
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = _handle  # noqa: N815

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer((self.bind, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def recording_server() -> Iterator[RecordingServer]:
    server = RecordingServer().start()
    yield server
    server.stop()
