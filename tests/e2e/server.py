"""Run the real `modelforge-control-plane` (Granian) in a subprocess for end-to-end tests."""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.factories import ADMIN_TOKEN

#: Liveness settings that let end-to-end tests see stale and offline within seconds.
FAST = {
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_TELEMETRY_INTERVAL_SECONDS": "1",
    # Generous against a loaded 2-core machine; the tests' timing assertions are relative to these.
    "MODELFORGE_NODE_STALE_AFTER_SECONDS": "4",
    "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": "8",
    "MODELFORGE_HEARTBEAT_FLUSH_INTERVAL_SECONDS": "0.2",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
}


def control_plane_executable() -> str:
    """The console script of the environment running the tests (PATH need not include it)."""
    beside = Path(sys.executable).parent / "modelforge-control-plane"
    found = str(beside) if beside.exists() else shutil.which("modelforge-control-plane")
    assert found, "modelforge-control-plane is not installed (pip install -e .)"
    return found


#: Ports the tests' own servers listen on: each pytest-xdist worker (`PYTEST_XDIST_WORKER`,
#: gw0, gw1, ...) takes its own slice of [12000, 32000), below the kernel's ephemeral range
#: (32768 up, where bind(0), and so the product's own choices, land). Granian binds with
#: SO_REUSEPORT, so two servers handed one port by bind(0) in two workers both start and the
#: kernel splits the clients between them: a test then talks to another test's control plane.
_PORT_SLICE = 2000
_PORT_BASE = 12000 + _PORT_SLICE * (
    int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % 10
)
_port_turn = itertools.count()


def free_port() -> int:
    """A port of this worker's slice that nothing listens on now (on any address), each handed
    out once before the slice wraps around."""
    for _ in range(_PORT_SLICE):
        port = _PORT_BASE + next(_port_turn) % _PORT_SLICE
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))  # noqa: S104 - taken on any address, taken here
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_PORT_BASE}-{_PORT_BASE + _PORT_SLICE - 1}")


@dataclass
class LiveServer:
    data_dir: Path
    database_url: str
    env_overrides: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    #: With TLS: the CA file that verifies the server certificate.
    ca_file: Path | None = None
    #: The command's arguments (`--artifacts-only`, say).
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        scheme = "https" if "MODELFORGE_TLS_CERT" in self.env_overrides else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"control-plane-{self.port}.log"

    @property
    def admin(self) -> dict[str, str]:
        return {"X-ModelForge-Admin-Token": ADMIN_TOKEN}

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
        env.update(
            MODELFORGE_DATA_DIR=str(self.data_dir),
            MODELFORGE_DATABASE_URL=self.database_url,
            MODELFORGE_ADMIN_TOKEN=ADMIN_TOKEN,
            MODELFORGE_PORT=str(self.port),
            MODELFORGE_LOG_LEVEL="debug",
        )
        env.update(self.env_overrides)
        return env

    def start(self, timeout: float = 30.0) -> LiveServer:
        executable = control_plane_executable()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [executable, *self.args], env=self.env(), stdout=log, stderr=subprocess.STDOUT
            )
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()  # never leave a server behind a failed start
            raise
        return self

    def _wait_healthy(self, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"control plane exited: {self.log()}")
            try:
                health = httpx.get(f"{self.url}/api/v1/health", timeout=1, verify=self._verify())
                if health.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"control plane did not become healthy: {self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        code = self.process.wait(timeout=timeout)
        return code

    def kill(self) -> None:
        """SIGKILL the server and its Granian worker process together, as a crashed host would
        end them: nothing is flushed and no request in flight is answered. All are stopped first,
        so that none reacts to the death of another."""
        assert self.process is not None
        root = psutil.Process(self.process.pid)
        processes = [root, *root.children(recursive=True)]
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for process in processes:
                try:
                    process.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
        self.process.wait(timeout=20)
        # Dead is enough: the worker's zombie waits for whichever process reaps orphans here.
        deadline = time.monotonic() + 20
        for process in processes[1:]:
            try:
                while process.status() != psutil.STATUS_ZOMBIE:
                    assert time.monotonic() < deadline, f"process {process.pid} survived SIGKILL"
                    time.sleep(0.01)
            except psutil.NoSuchProcess:
                pass

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, verify=self._verify(), **kw)

    def _verify(self) -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=str(self.ca_file)) if self.ca_file else True

    def mint(self, **body: Any) -> dict[str, Any]:
        with self.client() as client:
            response = client.post(
                "/api/v1/admin/node-enrollments",
                headers=self.admin,
                json={"display_name": "node", "expires_in_seconds": 900, **body},
            )
        assert response.status_code == 201, response.text
        return dict(response.json())

    def enroll(self, hostname: str = "test-host") -> dict[str, Any]:
        """Mint a token and claim it as an agent would: `node_id`, `credential`, intervals."""
        token = self.mint()["token"]
        with self.client() as client:
            response = client.post(
                "/api/v1/agent/enroll",
                json={
                    "token": token,
                    "claim_nonce": secrets.token_hex(16),
                    "hostname": hostname,
                    "protocol_version": 1,
                    "agent_version": "0.1.0",
                },
            )
        assert response.status_code == 200, response.text
        return dict(response.json())

    def get(self, path: str) -> Any:
        with self.client() as client:
            response = client.get(path, headers=self.admin)
        assert response.status_code == 200, response.text
        return response.json()

    def submit_python(
        self, source: str, function: str, *, job_fields: dict[str, Any] | None = None, **params: Any
    ) -> str:
        """Submit a Python job: `function` of a module `job` holding `source`, called with
        `params`, with the job's other fields from `job_fields`. Returns the job's id."""
        body = {
            **(job_fields or {}),
            "entrypoint": {
                "kind": "python",
                "module": "job",
                "function": function,
                "source": {"job.py": source},
            },
            "params": params,
        }
        with self.client() as client:
            response = client.post("/api/v1/jobs", headers=self.admin, json=body)
        assert response.status_code == 201, response.text
        return str(response.json()["job_id"])

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.stop()
