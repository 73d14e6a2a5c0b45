"""`modelforge-control-plane --local-node` as `make run` starts it, for end-to-end tests: in a
directory of its own (the data dir is the default `modelforge-data` there, the admin token
generated into it), on a free port, in a process group of its own so that a test can press
Ctrl-C as a terminal does (SIGINT to the whole foreground group)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.e2e.server import control_plane_executable, free_port

#: The module each child of the local node runs as (`python -m …`).
CHILDREN = {"agent": "node_agent", "worker": "runtime_worker"}


@contextmanager
def short_directory() -> Iterator[Path]:
    """A directory with a short path: the local node's unix sockets live in the data dir, and a
    socket's path may not be longer than 107 bytes (pytest's tmp_path can be)."""
    with tempfile.TemporaryDirectory(prefix="mf-") as name:
        yield Path(name)


@dataclass
class LocalControlPlane:
    cwd: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.cwd / "modelforge-data"

    @property
    def log_path(self) -> Path:
        return self.cwd / "control-plane.log"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
        env["MODELFORGE_PORT"] = str(self.port)
        return env

    def start(self) -> LocalControlPlane:
        self.cwd.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [control_plane_executable(), "--local-node"],
                cwd=self.cwd,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def admin(self) -> dict[str, str]:
        return {"X-ModelForge-Admin-Token": (self.data_dir / "admin-token").read_text().strip()}

    def get(self, path: str) -> Any:
        response = httpx.get(f"{self.url}{path}", headers=self.admin(), timeout=10)
        assert response.status_code == 200, response.text
        return response.json()

    def wait_online_node(self, timeout: float) -> tuple[dict[str, Any], float]:
        """The one node, once online, and how long after the start it was."""
        assert self.process is not None
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            assert self.process.poll() is None, f"control plane exited: {self.log()}"
            try:
                nodes = self.get("/api/v1/admin/nodes")
            except (OSError, httpx.HTTPError, AssertionError):
                nodes = []
            online = [node for node in nodes if node["state"] == "online"]
            if online:
                assert len(nodes) == 1, nodes
                return online[0], time.monotonic() - started
            time.sleep(0.2)
        raise AssertionError(f"no node online after {timeout} s: {self.log()}\n{self.child_logs()}")

    def child_logs(self) -> str:
        root = self.data_dir / "local-node"
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')}"
            for path in sorted(root.glob("*.log"))
        )

    def children(self, timeout: float = 20) -> dict[str, psutil.Process]:
        """The agent and the worker, once each runs its module (the launcher has exec'd)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while True:
            found: dict[str, psutil.Process] = {}
            for child in psutil.Process(self.process.pid).children():
                try:
                    command = child.cmdline()
                except psutil.NoSuchProcess:
                    continue
                for name, module in CHILDREN.items():
                    if command[1:3] == ["-m", module]:
                        found[name] = child
            if len(found) == len(CHILDREN):
                return found
            assert time.monotonic() < deadline, f"children not found: {found} {self.log()}"
            time.sleep(0.1)

    def press_ctrl_c(self, timeout: float = 60) -> int:
        """SIGINT to the control plane's whole process group, as a terminal sends it."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGINT)
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the control plane and its Granian worker, as a crash ends them; the local
        node's children are left to what the kernel tells them."""
        assert self.process is not None
        local = {child.pid for child in self.children().values()}
        others = [c for c in psutil.Process(self.process.pid).children() if c.pid not in local]
        self.process.kill()
        self.process.wait(timeout=20)
        for process in others:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass

    def stop(self, timeout: float = 60) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def __enter__(self) -> LocalControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.stop()
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # and its Granian worker with it
                self.process.wait()


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
