"""A real control plane and a simulated fleet, for the benchmarks under ``bench/``.

What lives here is what more than one benchmark needs: a dedicated PostgreSQL database (dropped and
recreated), the real ``modelforge-control-plane`` process (Granian, one worker) started on it,
nodes enrolled, heartbeating and reporting an inventory through the real API (each holds its own
credential), a lean raw-socket HTTP/1.1 reader for load generators, and CPU accounting from Linux
``/proc`` (which process took how much of a core, and how much *other* processes took).

It must never reach into the control plane's code: a benchmark measures the process from outside,
through HTTP, ``/proc`` and the database, so that it measures the same thing however the server is
written.
"""

from __future__ import annotations

import asyncio
import os
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
HEARTBEAT_BODY = (
    b'{"protocol_version":1,"agent_version":"0.1.0",'
    b'"health":{"status":"healthy","preflight":"passed"}}'
)
AGENT_VERSION = "0.1.0"
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards `wanted` (at most the hard limit); the
    processes it starts inherit it. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return int(soft)


def percentile(ordered: list[float], q: float) -> float:
    """The `q` quantile (0..1) of an already sorted list; 0.0 for an empty one."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


# -- PostgreSQL -------------------------------------------------------------------------------


class Postgres:
    def __init__(self, host: str, port: int, user: str, database: str) -> None:
        self.host, self.port, self.user, self.database = host, port, user, database

    def url(self, database: str | None = None, driver: str = "") -> str:
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{self.user}@{self.host}:{self.port}/{database or self.database}"

    def connect(self, database: str | None = None) -> Any:
        import psycopg

        return psycopg.connect(self.url(database), autocommit=True)

    def recreate(self) -> None:
        with self.connect("postgres") as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{self.database}"')

    def drop(self) -> None:
        with self.connect("postgres") as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')


# -- the control plane process ----------------------------------------------------------------


class ControlPlane:
    """`modelforge-control-plane` on `pg`, on a free port, with a fresh admin token.

    `env` adds settings (``MODELFORGE_*``). `source` runs the control plane from another checkout
    of the repository (``python -m control_plane`` with that directory first on ``PYTHONPATH``;
    e.g. ``git archive HEAD | tar -x -C DIR``) instead of the installed one, for before/after
    comparisons; the interpreter and its dependencies stay this environment's."""

    def __init__(
        self,
        pg: Postgres,
        workdir: Path,
        port: int,
        *,
        env: Mapping[str, str] | None = None,
        source: Path | None = None,
    ) -> None:
        self.port = port
        self.database = pg.database
        self.base = f"http://127.0.0.1:{port}"
        self.admin_token = "mfa_bench_" + secrets.token_urlsafe(24)
        self.log_path = workdir / "control-plane.log"
        settings = {
            "MODELFORGE_DATA_DIR": str(workdir / "data"),
            "MODELFORGE_DATABASE_URL": pg.url(driver="psycopg"),
            "MODELFORGE_ADMIN_TOKEN": self.admin_token,
            "MODELFORGE_PORT": str(port),
            "MODELFORGE_LOG_LEVEL": "warning",
            **(env or {}),
        }
        if source is None:
            exe = shutil.which("modelforge-control-plane") or str(
                Path(sys.executable).parent / "modelforge-control-plane"
            )
            command = [exe]
        else:
            command = [sys.executable, "-m", "control_plane"]
            path = os.environ.get("PYTHONPATH")
            settings["PYTHONPATH"] = str(source.resolve()) + (f":{path}" if path else "")
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            command,
            env=os.environ | settings,
            cwd=source,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 60.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"control plane exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(self.base + "/api/v1/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"control plane not healthy after {timeout:.0f} s:\n{self.log()}")

    def worker_pid(self) -> int:
        """The Granian worker process (a child of the supervisor) that runs the app."""
        children = [
            pid
            for pid in all_pids()
            if ppid(pid) == self.proc.pid and "granian" not in comm(pid).lower()
        ] or [pid for pid in all_pids() if ppid(pid) == self.proc.pid]
        return children[0] if children else self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def probe(self, credential: str) -> str:
        """One heartbeat, described: what a failing run's requests were answered."""
        import httpx

        try:
            response = httpx.post(
                self.base + HEARTBEAT_PATH,
                headers={"Authorization": f"Bearer {credential}"},
                content=HEARTBEAT_BODY,
                timeout=10.0,
            )
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return f"{response.status_code} {response.text[:300]}"

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# -- the simulated fleet, through the real API ------------------------------------------------


async def enroll_nodes(base: str, admin_token: str, nodes: int, concurrency: int) -> list[str]:
    """Enroll `nodes` nodes (admin mints an enrollment, the "agent" claims it); their credentials,
    in order."""
    import httpx

    admin = {"X-ModelForge-Admin-Token": admin_token}
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, index: int) -> str:
        async with gate:
            minted = await client.post(
                "/api/v1/admin/node-enrollments",
                headers=admin,
                json={"display_name": f"bench-{index}", "expires_in_seconds": 3600},
            )
            if minted.status_code != 201:
                raise SystemExit(f"mint failed: {minted.status_code} {minted.text}")
            claimed = await client.post(
                "/api/v1/agent/enroll",
                json={
                    "token": minted.json()["token"],
                    "claim_nonce": secrets.token_hex(16),
                    "hostname": f"bench-host-{index}",
                    "protocol_version": 1,
                    "agent_version": AGENT_VERSION,
                },
            )
            if claimed.status_code != 200:
                raise SystemExit(f"enroll failed: {claimed.status_code} {claimed.text}")
            return str(claimed.json()["credential"])

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60.0) as client:
        return list(await asyncio.gather(*(one(client, i) for i in range(nodes))))


@dataclass(frozen=True)
class HeartbeatRound:
    failed: int  # not answered 200
    interval_seconds: float  # what the control plane told the nodes (0.0 if none answered)


async def heartbeat_all(base: str, credentials: list[str], concurrency: int) -> HeartbeatRound:
    """One heartbeat per node (the first brings a node online)."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    headers = {"Content-Type": "application/json"}
    intervals: list[float] = []

    async def one(client: httpx.AsyncClient, credential: str) -> bool:
        async with gate:
            response = await client.post(
                HEARTBEAT_PATH,
                headers=headers | {"Authorization": f"Bearer {credential}"},
                content=HEARTBEAT_BODY,
            )
            if response.status_code != 200:
                return False
            intervals.append(float(response.json()["heartbeat_interval_seconds"]))
            return True

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60.0) as client:
        results = await asyncio.gather(*(one(client, c) for c in credentials))
    return HeartbeatRound(
        failed=sum(1 for ok in results if not ok), interval_seconds=max(intervals, default=0.0)
    )


def inventory(index: int, *, cpus: int, memory_mb: int, gpus: int) -> dict[str, Any]:
    """What an agent reports (`PUT /api/v1/agent/inventory`), for node number `index`."""
    return {
        "hostname": f"bench-host-{index}",
        "os": "Linux",
        "agent_version": AGENT_VERSION,
        "accelerator_mode": "nvidia" if gpus else "cpu",
        "cpu_count": cpus,
        "memory_mb": memory_mb,
        "gpus": [
            {
                "index": g,
                "uuid": f"GPU-{index:08x}-bench-{g:04x}-{secrets.token_hex(6)}",
                "name": "Bench GPU",
                "memory_total_mb": 81920,
            }
            for g in range(gpus)
        ],
        "runtime_worker": {"version": AGENT_VERSION, "protocol_version": 1},
    }


async def report_inventories(
    base: str, credentials: list[str], bodies: list[dict[str, Any]], concurrency: int
) -> int:
    """`PUT /api/v1/agent/inventory` for each node; returns how many were not answered 200."""
    import httpx

    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, credential: str, body: dict[str, Any]) -> bool:
        async with gate:
            response = await client.put(
                "/api/v1/agent/inventory",
                headers={"Authorization": f"Bearer {credential}"},
                json=body,
            )
            return response.status_code == 200

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60.0) as client:
        results = await asyncio.gather(
            *(one(client, c, b) for c, b in zip(credentials, bodies, strict=True))
        )
    return sum(1 for ok in results if not ok)


# -- raw HTTP/1.1 for load generators ---------------------------------------------------------


def http_request(
    method: str, path: str, *, port: int, body: bytes = b"", credential: str | None = None
) -> bytes:
    """One complete HTTP/1.1 request (keep-alive, JSON body), ready to write to a socket."""
    auth = f"Authorization: Bearer {credential}\r\n" if credential else ""
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


@dataclass(frozen=True)
class RawResponse:
    status: int
    body: bytes
    close: bool  # the server will close the connection after this response


async def read_response(reader: asyncio.StreamReader) -> RawResponse:
    """One HTTP/1.1 response: status, body (Content-Length or chunked) and whether the server
    closes the connection. Raises `asyncio.IncompleteReadError` or `ValueError` on a broken one."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length, chunked, close = 0, False, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            close = b"close" in value.lower()
    if not chunked:
        return RawResponse(status, await reader.readexactly(length) if length else b"", close)
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers are expected
            return RawResponse(status, b"".join(parts), close)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


class KeepAlive:
    """One keep-alive HTTP/1.1 connection to the control plane on loopback, (re)opened on first
    use after the server closed it or an exchange failed (a failed exchange closes it: what
    the server makes of a half-read request is unknown)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def exchange(self, request: bytes, timeout: float) -> RawResponse:
        """Send one request (see `http_request`) and read its response within `timeout` s."""
        if self.writer is None or self.reader is None:
            await self.open()
        assert self.writer is not None and self.reader is not None
        try:
            self.writer.write(request)
            async with asyncio.timeout(timeout):
                response = await read_response(self.reader)
        except BaseException:
            self.close()
            raise
        if response.close:
            self.close()
        return response

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


# -- CPU accounting (Linux /proc) -------------------------------------------------------------


def all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def ppid(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else -1


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` (all its threads), 0 if it is gone."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK if fields else 0.0


def busy_s() -> float | None:
    """CPU seconds the whole machine spent busy since boot (Linux), None elsewhere."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal: busy is all but idle and iowait; steal (time
    # the hypervisor gave to other guests) counts as busy, so it shows up as "other processes".
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / CLK_TCK


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu_s() -> float:
    """CPU of this process's children that have exited and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def serves(pid: int, database: str) -> bool:
    """A PostgreSQL server process that works for `database`: its backends, or an auxiliary."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, UnicodeDecodeError):
        return False
    client = "(" in title or "[local]" in title
    return not client or f" {database} " in title


def postgres_pids(database: str) -> list[int]:
    return [pid for pid in all_pids() if comm(pid) == "postgres" and serves(pid, database)]


@dataclass(frozen=True)
class CpuSnapshot:
    at: float
    busy_s: float
    parts: dict[str, float]  # named parts of the benchmark -> CPU seconds so far
    postgres: dict[int, float] = field(default_factory=dict)


def cpu_snapshot(database: str, parts: Mapping[str, float]) -> CpuSnapshot | None:
    """The machine's busy time, the named `parts` (CPU seconds, read by the caller, e.g. with
    `cpu_s(pid)`) and PostgreSQL's processes serving `database`; None off Linux."""
    busy = busy_s()
    if busy is None:
        return None
    postgres = {pid: cpu_s(pid) for pid in postgres_pids(database)}
    return CpuSnapshot(time.monotonic(), busy, dict(parts), postgres)


@dataclass(frozen=True)
class CpuUse:
    """CPU seconds each part took between two snapshots, over `wall` seconds."""

    wall: float
    parts: dict[str, float]  # the named parts, then "PostgreSQL"
    busy: float
    other: float  # the machine's busy time that none of the parts account for

    def cores(self, seconds: float) -> float:
        return seconds / self.wall if self.wall > 0 else 0.0

    def rows(self) -> list[tuple[str, str]]:
        """CPU use in % of one core (the machine has os.cpu_count() of them)."""
        cores = os.cpu_count() or 1
        return [
            *((f"CPU, {name}", f"{100 * self.cores(s):.0f}%") for name, s in self.parts.items()),
            ("CPU, everything else", f"{100 * self.cores(self.other):.0f}%"),
            (
                f"CPU, machine busy ({cores} cores = {100 * cores}%)",
                f"{100 * self.cores(self.busy):.0f}%",
            ),
        ]


def cpu_use(before: CpuSnapshot | None, after: CpuSnapshot | None) -> CpuUse | None:
    if before is None or after is None:
        return None
    parts = {name: after.parts[name] - before.parts.get(name, 0.0) for name in after.parts}
    # A backend that started during the run counts from 0; one that ended is lost (the pools of
    # a control plane keep theirs).
    parts["PostgreSQL"] = sum(
        s - before.postgres.get(pid, 0.0) for pid, s in after.postgres.items()
    )
    busy = after.busy_s - before.busy_s
    return CpuUse(
        wall=after.at - before.at,
        parts=parts,
        busy=busy,
        other=max(0.0, busy - sum(parts.values())),
    )
