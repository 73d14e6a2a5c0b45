"""A node for end-to-end tests: a real runtime worker and a real node agent as subprocesses, or
in place of the worker a stand-in process that answers its health endpoint with another
protocol (a runtime worker of another release, as the agent sees it at the socket)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.e2e.server import LiveServer
from tests.nvml_substitute import SCENARIO_ENV


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:
        return subprocess.Popen(args, env=env, stdout=handle, stderr=subprocess.STDOUT)


#: A process answering `GET /v1/health` on a unix socket as a runtime worker of another release
#: would: `python -c FAKE_WORKER <socket> <protocol> <version>`.
FAKE_WORKER = """
import signal, sys
from pathlib import Path
from modelforge_contracts.ipc import JsonHandler, UnixHTTPServer, serve_unix

socket_path, protocol, version = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


class Handler(JsonHandler):
    def do_GET(self):
        if self.path != "/v1/health":
            self.send_error_json(404, "NOT_FOUND", self.path)
            return
        self.send_json(
            200,
            {"component": "runtime-worker", "version": version,
             "protocol_version": protocol, "healthy": True},
        )


server = serve_unix(socket_path, Handler, UnixHTTPServer)
signal.signal(signal.SIGTERM, lambda *_: (socket_path.unlink(missing_ok=True), sys.exit(0)))
server.serve_forever(poll_interval=0.2)
"""


#: Run `python -m runtime_worker` where unshare(2) is refused with EPERM, as on a host (or under
#: Docker's default seccomp profile) without unprivileged user namespaces: a seccomp filter,
#: inherited by everything the worker starts.
NO_USER_NAMESPACES = """
import ctypes, os, platform, struct, sys

unshare = {"x86_64": 272, "aarch64": 97}[platform.machine()]
load, jump_eq, ret = 0x20, 0x15, 0x06
program = b"".join(
    struct.pack("HBBI", *instruction)
    for instruction in (
        (load, 0, 0, 0),  # the system call number
        (jump_eq, 0, 1, unshare),
        (ret, 0, 0, 0x00050000 | 1),  # SECCOMP_RET_ERRNO | EPERM
        (ret, 0, 0, 0x7FFF0000),  # SECCOMP_RET_ALLOW
    )
)
buffer = ctypes.create_string_buffer(program)


class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


libc = ctypes.CDLL(None, use_errno=True)
ulong = ctypes.c_ulong
assert libc.prctl(38, ulong(1), ulong(0), ulong(0), ulong(0)) == 0  # PR_SET_NO_NEW_PRIVS
filter_program = Program(4, ctypes.addressof(buffer))
assert libc.prctl(22, ulong(2), ctypes.byref(filter_program), ulong(0), ulong(0)) == 0
os.execv(sys.executable, [sys.executable, "-m", "runtime_worker"])
"""


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
        return self._start_worker([sys.executable, "-m", "runtime_worker"])

    def start_worker_without_user_namespaces(self) -> Node:
        return self._start_worker([sys.executable, "-c", NO_USER_NAMESPACES])

    def start_fake_worker(self, protocol: int, version: str = "9.9.9") -> Node:
        """A stand-in worker answering its health endpoint with `protocol` and `version`."""
        return self._start_worker(
            [sys.executable, "-c", FAKE_WORKER, str(self.socket), str(protocol), version]
        )

    def _start_worker(self, args: list[str]) -> Node:
        self.root.mkdir(parents=True, exist_ok=True)
        # A worker killed with SIGKILL leaves its socket file: wait for the new one.
        self.socket.unlink(missing_ok=True)
        self.worker = _spawn(args, self.env(), self.root / "worker.log")
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            assert self.worker.poll() is None, f"worker exited: {self.worker_log()}"
            assert time.monotonic() < deadline, "runtime worker did not create its socket"
            time.sleep(0.05)
        return self

    def stop_worker(self, sig: int = signal.SIGTERM) -> int | None:
        code = _stop(self.worker, sig)
        self.worker = None
        return code

    def worker_log(self) -> str:
        path = self.root / "worker.log"
        return path.read_text(errors="replace") if path.exists() else ""

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


@contextmanager
def live_stack(
    root: Path, env_overrides: dict[str, str], **node_options: Any
) -> Iterator[tuple[LiveServer, Node]]:
    """A control plane on SQLite (`root/cp`, `root/cp.db`) and a node (`root/node`) given a fresh
    enrollment token, its processes not started yet; on leaving, node and server are stopped."""
    with LiveServer(
        root / "cp", f"sqlite:///{root / 'cp.db'}", env_overrides=env_overrides
    ) as server:
        with Node(root / "node", server.url, token=server.mint()["token"], **node_options) as node:
            yield server, node


def wait_ready(
    server: LiveServer, node_id: str, timeout: float, what: str = "node readiness"
) -> float:
    """Wait until the control plane calls the node ready (every readiness check passes)."""
    return wait_until(
        lambda: server.get(f"/api/v1/admin/nodes/{node_id}/readiness")["ready"], timeout, what
    )
