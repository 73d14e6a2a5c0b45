"""A node for end-to-end tests: a real runtime worker and a real node agent as subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.nvml_substitute import SCENARIO_ENV


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:
        return subprocess.Popen(args, env=env, stdout=handle, stderr=subprocess.STDOUT)


def _stop(process: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> int | None:
    if process is None:
        return None
    if process.poll() is None:
        process.send_signal(sig)
    return process.wait(timeout=20)


@dataclass
class Node:
    root: Path
    control_plane_url: str
    token: str | None = None
    mode: str = "cpu"
    nvml_dir: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    agent: subprocess.Popen[bytes] | None = None
    worker: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.root / "worker.sock"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def agent_log(self) -> Path:
        return self.root / "agent.log"

    def env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("MODELFORGE_", "NVIDIA_", "LD_LIBRARY_PATH"))
        }
        env.update(
            MODELFORGE_AGENT_CONTROL_PLANE_URL=self.control_plane_url,
            MODELFORGE_AGENT_ACCELERATOR_MODE=self.mode,
            MODELFORGE_AGENT_STATE_VOLUME=str(self.state),
            MODELFORGE_AGENT_WORKER_SOCKET=str(self.socket),
            MODELFORGE_AGENT_SOCKET=str(self.root / "agent.sock"),
            MODELFORGE_ARTIFACT_CACHE=str(self.root / "cache"),
            MODELFORGE_WORKER_SOCKET=str(self.socket),
        )
        if self.token:
            env["MODELFORGE_AGENT_ENROLLMENT_TOKEN"] = self.token
        if self.nvml_dir is not None:
            env["LD_LIBRARY_PATH"] = str(self.nvml_dir)
            env[SCENARIO_ENV] = "healthy"
        env.update(self.extra_env)
        return env

    def start_worker(self) -> Node:
        self.root.mkdir(parents=True, exist_ok=True)
        self.worker = _spawn(
            [sys.executable, "-m", "runtime_worker"], self.env(), self.root / "worker.log"
        )
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            assert time.monotonic() < deadline, "runtime worker did not create its socket"
            time.sleep(0.05)
        return self

    def start_agent(self, *args: str) -> Node:
        self.root.mkdir(parents=True, exist_ok=True)
        self.agent = _spawn([sys.executable, "-m", "node_agent", *args], self.env(), self.agent_log)
        return self

    def stop_agent(self, sig: int = signal.SIGTERM) -> int | None:
        code = _stop(self.agent, sig)
        self.agent = None
        return code

    def wait_agent_exit(self, timeout: float) -> int:
        assert self.agent is not None
        return self.agent.wait(timeout=timeout)

    def log(self) -> str:
        return self.agent_log.read_text(errors="replace") if self.agent_log.exists() else ""

    def node_id(self, timeout: float = 20) -> str:
        import json

        path = self.state / "identity.json"
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.agent is not None and self.agent.poll() is not None:
                raise AssertionError(f"agent exited {self.agent.returncode}: {self.log()}")
            assert time.monotonic() < deadline, f"agent did not enroll: {self.log()}"
            time.sleep(0.05)
        return str(json.loads(path.read_text())["node_id"])

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: Any) -> None:
        _stop(self.agent)
        _stop(self.worker)


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
