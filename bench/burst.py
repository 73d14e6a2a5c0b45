"""A burst of admin requests against a busy control plane (issue 24, HIGH 1): per-request latency
of the burst, and the agents' heartbeats and the health probe during it against idle.

What is measured
----------------
1. The real control plane (``modelforge-control-plane``: Granian, one worker) on SQLite (a file
   in a scratch data dir) and on PostgreSQL (a dedicated database, ``modelforge_bench_burst_<pid>``,
   dropped and recreated, dropped at the end), on a free port.
2. ``--nodes`` nodes enrolled through the real API, with an inventory; ``--jobs`` queued jobs
   that wait (each job list explains why).
3. This process probes on two threads, all along: every node's heartbeat (the agents' fast path)
   and ``GET /api/v1/health`` (what a load balancer polls), each every 0.1 s, one keep-alive
   connection each; ``--idle`` seconds of that are the idle figures.
4. The burst, from a *separate process* (so that its client work does not slow the probes): 9
   concurrent ``PUT /api/v1/admin/secrets/…`` with ``--reads`` concurrent ``GET /api/v1/jobs``
   (default 32 on SQLite, 64 on PostgreSQL: the issue's figures), then ``--concurrent``
   (default 200) concurrent ``GET /api/v1/jobs``; every request's latency and status.
5. Reported, per database: the burst's latency p50/p99/max and its non-2xx count (503 ``BUSY``
   included, by code), and heartbeat and health latency p50/p99/max idle and during the burst.

``--source DIR`` runs the control plane from another checkout (``git archive <commit> | tar -x
-C DIR``), for a before/after comparison.

The exit status is non-zero when a burst request or a probe was not answered 2xx; the latencies
are printed, not judged (they depend on the machine). Run (PostgreSQL reachable)::

    python bench/burst.py                       # both databases
    python bench/burst.py --database sqlite --concurrent 500
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import fleet
import httpx

#: The burst, run in its own process (bench/burst_load.py, shared with tests/e2e/test_burst.py).
BURST_LOAD = Path(__file__).with_name("burst_load.py")


@dataclass
class Probe:
    """One kind of probe request, sent every `every` seconds on its own connection."""

    name: str
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # started, s, status

    def window(self, start: float, end: float) -> list[tuple[float, float, int]]:
        return [s for s in self.samples if start <= s[0] <= end]


def _probe_loop(
    base: str, probe: Probe, send: object, stop: threading.Event, every: float = 0.1
) -> None:
    with httpx.Client(base_url=base, timeout=60) as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                status = send(client)  # type: ignore[operator]
            except httpx.HTTPError:
                status = 0
            probe.samples.append((started, time.monotonic() - started, status))
            stop.wait(every)


def _stats(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    if not ordered:
        return "none"
    p50, p99 = fleet.percentile(ordered, 0.50), fleet.percentile(ordered, 0.99)
    return f"p50 {p50 * 1000:8.1f} ms  p99 {p99 * 1000:8.1f} ms  max {ordered[-1] * 1000:8.1f} ms"


def run_one(database: str, args: argparse.Namespace, workdir: Path) -> bool:
    pg = fleet.Postgres(
        args.pg_host, args.pg_port, args.pg_user, f"modelforge_bench_burst_{os.getpid()}"
    )
    env = {"MODELFORGE_LOG_LEVEL": "warning"}
    if database == "sqlite":
        env["MODELFORGE_DATABASE_URL"] = ""  # unset: SQLite in the data dir
    else:
        pg.recreate()
    reads = args.reads or (64 if database == "postgresql" else 32)
    server = fleet.ControlPlane(pg, workdir, fleet.free_port(), env=env, source=args.source)
    try:
        server.wait_healthy()
        return _measure(server, database, reads, args)
    finally:
        server.stop()
        if database == "postgresql":
            pg.drop()


def _measure(
    server: fleet.ControlPlane, database: str, reads: int, args: argparse.Namespace
) -> bool:
    import asyncio

    base, admin = server.base, {"X-ModelForge-Admin-Token": server.admin_token}
    credentials = asyncio.run(fleet.enroll_nodes(base, server.admin_token, args.nodes, 4))
    bodies = [fleet.inventory(i, cpus=8, memory_mb=16384, gpus=0) for i in range(args.nodes)]
    assert asyncio.run(fleet.report_inventories(base, credentials, bodies, 4)) == 0
    with httpx.Client(base_url=base, timeout=60) as client:
        for index in range(args.jobs):
            job = {
                "entrypoint": {
                    "kind": "python",
                    "module": "m",
                    "function": "f",
                    "source": {"m.py": "def f():\n    return 1\n"},
                },
                "labels": {"batch": str(index)},  # no node carries it: the job waits
            }
            assert client.post("/api/v1/jobs", headers=admin, json=job).status_code == 201

    stop = threading.Event()
    heartbeat, health = Probe("heartbeat"), Probe("health")
    hb_headers = {"Content-Type": "application/json"}

    def send_heartbeats(client: httpx.Client) -> int:
        worst = 200
        for credential in credentials:
            response = client.post(
                fleet.HEARTBEAT_PATH,
                headers=hb_headers | {"Authorization": f"Bearer {credential}"},
                content=fleet.HEARTBEAT_BODY,
            )
            worst = response.status_code if response.status_code != 200 else worst
        return worst

    threads = [
        threading.Thread(target=_probe_loop, args=(base, heartbeat, send_heartbeats, stop)),
        threading.Thread(
            target=_probe_loop,
            args=(base, health, lambda c: c.get("/api/v1/health").status_code, stop),
        ),
    ]
    for thread in threads:
        thread.start()
    idle_start = time.monotonic()
    time.sleep(args.idle)
    burst_start = time.monotonic()
    burst = subprocess.run(  # noqa: S603 - this interpreter, this script's load generator
        [
            sys.executable,
            str(BURST_LOAD),
            base,
            server.admin_token,
            "9",
            str(reads),
            str(args.concurrent),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    burst_end = time.monotonic()
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    if burst.returncode != 0:
        print(burst.stderr[-3000:])
        return False
    answers = json.loads(burst.stdout)

    print(
        f"\n== {database}: {args.nodes} nodes heartbeating, {args.jobs} queued jobs; "
        f"burst of 9 writes + {reads} reads, then {args.concurrent} reads "
        f"({burst_end - burst_start:.1f} s)"
    )
    ok = True
    for phase, kind, label in (
        ("mixed", "write", "secret PUTs (with the reads)"),
        ("mixed", "read", f"{reads} job lists (with the writes)"),
        ("reads", "read", f"{args.concurrent} concurrent job lists"),
    ):
        rows = [a for a in answers if a[0] == phase and a[1] == kind]
        failed = Counter(f"{a[2]} {a[3]}".strip() for a in rows if not 200 <= a[2] < 300)
        ok = ok and not failed
        print(
            f"  {label:34s} {_stats([a[4] for a in rows])}  non-2xx {sum(failed.values())}"
            + (f" {dict(failed)}" if failed else "")
        )
    for probe in (heartbeat, health):
        idle = probe.window(idle_start, burst_start)
        during = probe.window(burst_start, burst_end)
        bad = sum(1 for s in idle + during if s[2] != 200)
        ok = ok and not bad
        print(f"  {probe.name:9s} idle  ({len(idle):4d}) {_stats([s[1] for s in idle])}")
        print(
            f"  {probe.name:9s} burst ({len(during):4d}) {_stats([s[1] for s in during])}"
            f"  non-200 {bad}"
        )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=30)
    parser.add_argument("--reads", type=int, default=0, help="default: 32 SQLite, 64 PostgreSQL")
    parser.add_argument("--concurrent", type=int, default=200)
    parser.add_argument("--idle", type=float, default=3.0)
    parser.add_argument(
        "--source",
        type=Path,
        help="run the control plane from this checkout (e.g. `git archive <commit> | tar -x -C "
        "DIR`) instead of the installed one, for a before/after comparison",
    )
    parser.add_argument("--pg-host", default="127.0.0.1")
    parser.add_argument("--pg-port", type=int, default=5432)
    parser.add_argument("--pg-user", default="postgres")
    args = parser.parse_args()
    fleet.raise_fd_limit(8192)
    databases = ["sqlite", "postgresql"] if args.database == "both" else [args.database]
    ok = True
    for database in databases:
        with tempfile.TemporaryDirectory(prefix=f"modelforge-bench-burst-{database}-") as scratch:
            ok = run_one(database, args, Path(scratch)) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
