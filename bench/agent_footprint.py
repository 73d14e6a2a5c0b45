"""Node agent footprint benchmark: resident memory and CPU of a running, idle node agent.

What is measured
----------------
For each heartbeat interval in ``--intervals`` (default ``1,10`` seconds) a fresh, isolated set of
processes is started in a temporary directory:

1. the control plane (``modelforge-control-plane``, SQLite, on a free loopback port) with
   ``MODELFORGE_HEARTBEAT_INTERVAL_SECONDS`` set to the interval and
   ``MODELFORGE_TELEMETRY_INTERVAL_SECONDS`` set to ``max(2, 1.5 x interval)`` (15 s at the 10 s
   interval, the defaults; 2 s at 1 s) unless ``--telemetry-interval`` is given;
2. the runtime worker (``python -m runtime_worker``) on a unix socket, so that the agent's
   per-heartbeat inventory check really talks to a worker;
3. the node agent (``python -m node_agent``, ``MODELFORGE_AGENT_ACCELERATOR_MODE=cpu``), enrolled
   with an enrollment token minted through the admin API and passed in the environment. The agent
   learns the heartbeat interval from the control plane.

Once the agent has enrolled (``identity.json`` appears in its state volume) and a warm-up of
``--warmup`` seconds (default 5) has passed, the agent process alone is observed with psutil for
``--duration`` seconds (default 60):

* RSS, sampled every second: maximum and mean (MB = 10^6 bytes);
* USS (memory unique to the process, from ``/proc/<pid>/smaps``) at the end of the window;
* CPU: (user + system) ``cpu_times`` delta over the window divided by the wall time, as a
  percentage of one core.

At the end the control plane is asked for the node: it must be ``online`` with a recent
heartbeat, otherwise the figures would describe an agent that is not doing its job.

Target (at the 10 s interval, the production default): RSS <= 50 MB and CPU <= 0.5 % of one core.
The 1 s interval is a stress figure reported alongside; no target applies to it.

Run (the editable install with the control-plane and agent extras)::

    python bench/agent_footprint.py --duration 60

The development environment also holds the dev extras, and their presence changes the agent:
``import httpx`` imports ``httpx._main`` (click, rich, pygments) whenever those are installed,
which schemathesis pulls in. To measure the agent as a node would run it, point
``--agent-python`` at an interpreter whose environment has only the agent's dependencies (the
repository root is put on its ``PYTHONPATH``; the control plane and runtime worker keep running
under this interpreter)::

    python -m venv /tmp/agent-venv
    /tmp/agent-venv/bin/pip install pydantic==2.14.4 pydantic-settings==2.16.3 httpx==0.28.1
    /tmp/agent-venv/bin/pip install nvidia-ml-py==13.615.71 psutil==7.2.2 tenacity==9.2.1
    python bench/agent_footprint.py --duration 60 --agent-python /tmp/agent-venv/bin/python

The exit status is 0 when the 10 s target holds (or no 10 s interval was measured), 1 when it
does not, 2 when a run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

import httpx
import psutil

TARGET_INTERVAL_S = 10.0
TARGET_RSS_MB = 50.0
TARGET_CPU_PERCENT = 0.5
MB = 1_000_000
MIB = 1024 * 1024
REPO_ROOT = Path(__file__).resolve().parents[1]


class BenchError(Exception):
    """A run that could not produce figures; the message says why."""


@dataclass
class Result:
    interval_s: float
    telemetry_s: float
    window_s: float
    samples: int
    rss_max_mb: float
    rss_mean_mb: float
    uss_end_mb: float
    cpu_percent: float
    node_state: str
    heartbeat_age_s: float

    @property
    def is_target_run(self) -> bool:
        return self.interval_s == TARGET_INTERVAL_S

    @property
    def meets_target(self) -> bool:
        return self.rss_max_mb <= TARGET_RSS_MB and self.cpu_percent <= TARGET_CPU_PERCENT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def control_plane_executable() -> str:
    beside = Path(sys.executable).parent / "modelforge-control-plane"
    found = str(beside) if beside.exists() else shutil.which("modelforge-control-plane")
    if not found:
        raise BenchError(
            "modelforge-control-plane is not installed (pip install -e '.[control-plane]')"
        )
    return found


def base_env() -> dict[str, str]:
    """The current environment without any MODELFORGE_* variable that could leak into a run."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}


class Processes:
    """Started subprocesses, stopped in reverse order with SIGTERM (then SIGKILL) on exit."""

    def __init__(self) -> None:
        self._started: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []

    def start(
        self, name: str, argv: list[str], env: dict[str, str], log: Path
    ) -> subprocess.Popen[bytes]:
        handle = log.open("wb")
        try:
            process = subprocess.Popen(
                argv, env=env, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        except BaseException:
            handle.close()
            raise
        self._started.append((name, process, handle))
        return process

    def stop_all(self, timeout: float = 15.0) -> None:
        while self._started:
            _name, process, handle = self._started.pop()
            try:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
                    try:
                        process.wait(timeout=timeout)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait(timeout=timeout)
            finally:
                handle.close()


@contextlib.contextmanager
def running(processes: Processes) -> Iterator[Processes]:
    try:
        yield processes
    finally:
        processes.stop_all()


def tail(path: Path, lines: int = 20) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_until(
    what: str, check: Callable[[], bool], timeout: float, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    detail = f"\n--- {log.name} ---\n{tail(log)}" if log is not None else ""
    raise BenchError(f"{what} within {timeout:g} s{detail}")


def measure_interval(
    interval: float,
    telemetry: float,
    duration: float,
    warmup: float,
    agent_python: str | None,
    verbose: bool,
) -> Result:
    with tempfile.TemporaryDirectory(prefix="modelforge-agent-footprint-") as tmp_name:
        tmp = Path(tmp_name)
        data_dir = tmp / "data"
        state = tmp / "state"
        data_dir.mkdir()
        state.mkdir()
        worker_socket = tmp / "worker.sock"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        admin_token = secrets.token_urlsafe(24)
        logs = {name: tmp / f"{name}.log" for name in ("control-plane", "worker", "agent")}

        with running(Processes()) as processes:
            cp_env = base_env() | {
                "MODELFORGE_DATA_DIR": str(data_dir),
                "MODELFORGE_ADMIN_TOKEN": admin_token,
                "MODELFORGE_PORT": str(port),
                "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": f"{interval:g}",
                "MODELFORGE_TELEMETRY_INTERVAL_SECONDS": f"{telemetry:g}",
                "MODELFORGE_LOG_LEVEL": "warning",
            }
            control_plane = processes.start(
                "control-plane", [control_plane_executable()], cp_env, logs["control-plane"]
            )

            def healthy() -> bool:
                if control_plane.poll() is not None:
                    raise BenchError(f"control plane exited:\n{tail(logs['control-plane'])}")
                try:
                    return httpx.get(f"{url}/api/v1/health", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_until("control plane not healthy", healthy, 60, logs["control-plane"])

            admin = httpx.Client(
                base_url=url, timeout=10, headers={"X-ModelForge-Admin-Token": admin_token}
            )
            with admin:
                minted = admin.post(
                    "/api/v1/admin/node-enrollments",
                    json={"display_name": "bench", "expires_in_seconds": 900},
                )
                if minted.status_code != 201:
                    raise BenchError(f"minting an enrollment failed: HTTP {minted.status_code}")
                token = str(minted.json()["token"])

                worker_env = base_env() | {"MODELFORGE_WORKER_SOCKET": str(worker_socket)}
                worker = processes.start(
                    "worker", [sys.executable, "-m", "runtime_worker"], worker_env, logs["worker"]
                )
                wait_until(
                    "runtime worker socket not created",
                    lambda: worker_socket.exists() or worker.poll() is not None,
                    30,
                    logs["worker"],
                )
                if worker.poll() is not None:
                    raise BenchError(f"runtime worker exited:\n{tail(logs['worker'])}")

                agent_env = base_env() | {
                    "MODELFORGE_AGENT_CONTROL_PLANE_URL": url,
                    "MODELFORGE_AGENT_ENROLLMENT_TOKEN": token,  # environment, never argv
                    "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu",
                    "MODELFORGE_AGENT_STATE_VOLUME": str(state),
                    "MODELFORGE_AGENT_WORKER_SOCKET": str(worker_socket),
                    "MODELFORGE_AGENT_SOCKET": str(worker_socket.with_name("agent.sock")),
                    "MODELFORGE_ARTIFACT_CACHE": str(state.with_name("cache")),
                }
                if agent_python is not None:
                    path = os.environ.get("PYTHONPATH")
                    agent_env["PYTHONPATH"] = os.pathsep.join(
                        [str(REPO_ROOT), *([path] if path else [])]
                    )
                agent = processes.start(
                    "agent",
                    [agent_python or sys.executable, "-m", "node_agent"],
                    agent_env,
                    logs["agent"],
                )
                identity = state / "identity.json"

                def enrolled() -> bool:
                    if agent.poll() is not None:
                        raise BenchError(
                            f"agent exited with {agent.returncode}:\n{tail(logs['agent'])}"
                        )
                    return identity.exists()

                wait_until("agent did not enroll", enrolled, 60, logs["agent"])
                node_id = str(json.loads(identity.read_text())["node_id"])
                if verbose:
                    print(
                        f"[{interval:g} s] agent pid {agent.pid} enrolled as {node_id}; "
                        f"warm-up {warmup:g} s, then {duration:g} s measured",
                        file=sys.stderr,
                    )
                time.sleep(warmup)

                observed = psutil.Process(agent.pid)
                rss: list[int] = []
                start_cpu = observed.cpu_times()
                start = time.monotonic()
                rss.append(observed.memory_info().rss)
                tick = start
                while True:
                    tick += 1.0
                    time.sleep(max(0.0, tick - time.monotonic()))
                    if agent.poll() is not None:
                        raise BenchError(f"agent exited during the window:\n{tail(logs['agent'])}")
                    rss.append(observed.memory_info().rss)
                    if tick - start >= duration:
                        break
                end_cpu = observed.cpu_times()
                wall = time.monotonic() - start
                uss = observed.memory_full_info().uss
                cpu_seconds = (end_cpu.user - start_cpu.user) + (end_cpu.system - start_cpu.system)

                node = admin.get(f"/api/v1/admin/nodes/{node_id}")
                if node.status_code != 200:
                    raise BenchError(f"reading node {node_id} failed: HTTP {node.status_code}")
                view = node.json()
                last = view.get("last_heartbeat_at")
                age = (
                    (datetime.now(UTC) - datetime.fromisoformat(last)).total_seconds()
                    if last
                    else float("inf")
                )
                if view["state"] != "online" or age > 2 * interval + 2:
                    raise BenchError(
                        f"the node is {view['state']} with its last heartbeat {age:.1f} s ago; "
                        f"the agent is not heartbeating\n{tail(logs['agent'])}"
                    )

        return Result(
            interval_s=interval,
            telemetry_s=telemetry,
            window_s=wall,
            samples=len(rss),
            rss_max_mb=max(rss) / MB,
            rss_mean_mb=sum(rss) / len(rss) / MB,
            uss_end_mb=uss / MB,
            cpu_percent=100.0 * cpu_seconds / wall,
            node_state=str(view["state"]),
            heartbeat_age_s=age,
        )


def render(results: list[Result]) -> str:
    header = (
        f"{'heartbeat':>9}  {'telemetry':>9}  {'window':>7}  {'samples':>7}  "
        f"{'RSS max':>8}  {'RSS mean':>8}  {'USS end':>8}  {'CPU':>7}  {'node':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.interval_s:>8g}s  {r.telemetry_s:>8g}s  {r.window_s:>6.1f}s  {r.samples:>7}  "
            f"{r.rss_max_mb:>5.1f} MB  {r.rss_mean_mb:>5.1f} MB  {r.uss_end_mb:>5.1f} MB  "
            f"{r.cpu_percent:>6.3f}%  {r.node_state:>6}"
        )
    return "\n".join(lines)


def parse_intervals(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of seconds: {text!r}"
        ) from None
    if not values or any(v <= 0 or v >= 30 for v in values):
        raise argparse.ArgumentTypeError(
            "intervals must be positive and below 30 s (the default stale threshold)"
        )
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--duration", type=float, default=60.0, help="measured seconds per interval (default 60)"
    )
    parser.add_argument(
        "--intervals",
        type=parse_intervals,
        default=[1.0, 10.0],
        help="comma-separated heartbeat intervals in seconds (default 1,10)",
    )
    parser.add_argument(
        "--warmup", type=float, default=5.0, help="seconds after enrollment before measuring"
    )
    parser.add_argument(
        "--telemetry-interval",
        type=float,
        default=None,
        help="telemetry interval in seconds for every run (default max(2, 1.5 x heartbeat))",
    )
    parser.add_argument(
        "--agent-python",
        default=None,
        help="interpreter to run the agent with (default: this one); the repository root is "
        "added to its PYTHONPATH",
    )
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.warmup < 0:
        parser.error("--duration must be positive and --warmup not negative")

    results: list[Result] = []
    for interval in args.intervals:
        telemetry = args.telemetry_interval or max(2.0, 1.5 * interval)
        try:
            results.append(
                measure_interval(
                    interval,
                    telemetry,
                    args.duration,
                    args.warmup,
                    args.agent_python,
                    not args.quiet,
                )
            )
        except BenchError as exc:
            print(f"agent-footprint: {interval:g} s run failed: {exc}", file=sys.stderr)
            return 2

    agent = args.agent_python or sys.executable
    print(
        f"Node agent footprint: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
        f"agent interpreter {agent}; MB = 10^6 bytes"
    )
    print(render(results))
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2))
    targets = [r for r in results if r.is_target_run]
    if not targets:
        print(f"target not evaluated: no {TARGET_INTERVAL_S:g} s interval was measured")
        return 0
    ok = all(r.meets_target for r in targets)
    for r in targets:
        print(
            f"target at {TARGET_INTERVAL_S:g} s (RSS <= {TARGET_RSS_MB:g} MB, CPU <= "
            f"{TARGET_CPU_PERCENT:g} % of one core): RSS max {r.rss_max_mb:.1f} MB "
            f"({r.rss_max_mb * MB / MIB:.1f} MiB) "
            f"{'OK' if r.rss_max_mb <= TARGET_RSS_MB else 'EXCEEDED'}, CPU "
            f"{r.cpu_percent:.3f} % {'OK' if r.cpu_percent <= TARGET_CPU_PERCENT else 'EXCEEDED'}"
            f" -> {'MET' if r.meets_target else 'NOT MET'}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
