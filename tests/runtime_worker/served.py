"""The built-in model server run as a real process for the tests: started on a free port,
waited for until ready, stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

# The tests' one port allocator, re-exported for the serving tests.
from tests.e2e.server import free_port as free_port

NAME = "relu"


@dataclass
class Served:
    process: subprocess.Popen[str]
    address: str  # host:port, as tritonclient takes it
    model: Path
    name: str = NAME

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def rss(self) -> int:
        """The resident memory of the server's processes (Granian's main and its worker)."""
        main = psutil.Process(self.process.pid)
        return sum(process.memory_info().rss for process in [main, *main.children(True)])


def start_server(
    model: Path, *flags: str, env: dict[str, str] | None = None, name: str = NAME
) -> Served:
    port = free_port()
    command = [sys.executable, "-m", "runtime_worker.onnx_server", "--model", str(model)]
    command += ["--port", str(port), "--name", name, "--host", "127.0.0.1", *flags]
    process = subprocess.Popen(
        command, env={**os.environ, **(env or {})}, stderr=subprocess.PIPE, text=True
    )
    served = Served(process, f"127.0.0.1:{port}", model, name)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}: {process.communicate()[1]}")
        try:
            if httpx.get(f"{served.url}/v2/health/ready", timeout=1).status_code == 200:
                return served
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop_server(served)
            pytest.fail("the server did not become ready within 60 s")
        time.sleep(0.05)


def stop_server(served: Served) -> tuple[int, str]:
    """SIGTERM, then the exit status and what the server logged."""
    if served.process.poll() is None:
        served.process.send_signal(signal.SIGTERM)
    try:
        _, stderr = served.process.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        served.process.kill()
        _, stderr = served.process.communicate()
    return served.process.returncode, stderr
