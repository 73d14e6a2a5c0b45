"""Scheduler benchmark (SC-3): placements/s, claim latency and control-plane CPU per placement with
a queue of jobs and a fleet of long-polling nodes.

What is measured
----------------
1. A dedicated PostgreSQL database (``--database``, default ``modelforge_bench_placement_<pid>``,
   one per size; dropped and recreated, dropped again at the end) and the real control plane
   (``modelforge-control-plane``: Granian, one worker) on it, on a free port. Nodes stay online
   for the whole run (``MODELFORGE_NODE_STALE_AFTER_SECONDS`` 3600, offline after 7200) and a
   placed job is never failed by the contact sweep (``MODELFORGE_JOB_CONTACT_TIMEOUT_SECONDS``
   3600), so nothing but the scheduler decides where a job goes.
2. ``--nodes`` nodes are enrolled through the real API (each holds its own EdDSA credential), send
   one heartbeat (which brings them online and tells the heartbeat interval) and an inventory:
   ``cpu_count`` = ``--slots``, 512 MB of memory per slot, and with ``--job-gpus N`` N GPUs per
   slot, so exactly ``--slots`` jobs fit on a node at a time.
3. ``--jobs`` jobs are queued *before the clock starts*: a minimal Python job asking for one CPU,
   512 MB and ``--job-gpus`` GPUs. ``POST /api/v1/jobs:batch`` (1,000 per request) where the
   server has it; where it answers 404/405, one ``POST /api/v1/jobs`` each over
   ``--submit-concurrency`` connections.
4. The clock starts. A *separate process* (a lean raw-socket asyncio HTTP/1.1 client; its own CPU
   is reported) holds one keep-alive connection per node slot, each a long-poll claim
   ``POST /api/v1/agent/work/claim`` ``{"hold_seconds": 25}``: on an assignment (200) it
   completes the job at once (``POST /api/v1/agent/jobs/{id}/complete``, succeeded) and claims
   again; on 204 it claims again. Like the node agent, it gives a claim up when it is not
   answered within the hold plus 15 s (and a completion after 60 s): a job the server hands to
   such a claim afterwards reaches nobody, and step 6 counts it as lost. Over a few more
   connections it sends every node's heartbeat at the interval the control plane answered. The
   run ends when every job has been placed and completed, or at ``--max-seconds``; then no new
   claim is sent, and the claims still held are waited for (and any job they bring completed),
   so that the benchmark itself never leaves a claim for the server to hand a job to.
5. Reported: placements/s (jobs placed / seconds from the clock start to the last placement);
   claim latency p50/p99/max from max(claim sent, clock start) to the claim answered with a job
   while saturated — every claim has fitting jobs waiting, so this is queueing for throughput
   (about waiting claims / placements per second), not dispatch; control-plane CPU seconds
   (Granian worker and supervisor, user + system, from ``/proc``) per 1,000 placements, up to
   the last placement; the load generator's, PostgreSQL's and every other process's CPU (a
   warning above 20 % of a core: the machine is shared).
   Then the *dispatch probe* (``--probes``, default 100), SC-3's latency literally: with the
   queue drained and every node's claim waiting again, the load generator submits one job at a
   time (``POST /api/v1/jobs``, 50 ms apart) and times "submission sent" to "a claim answered
   with that job"; p50/p99 are reported and the p99 is held against the 250 ms target.
6. Correctness, read from the database at the end: every job succeeded (in a complete run), and
   no job was handed out twice — each job has exactly one ``running`` state event in
   ``job_events``, and the load generator received each job once and every job handed out.

A run stopped by ``--max-seconds`` is reported as PARTIAL: its rate and latencies cover only the
jobs placed in time; the jobs still queued waited longer than any latency shown.

The SC-3 targets are printed, not turned into a failure: at 10,000 jobs x 1,000 nodes at least 500
placements/s and a dispatch-probe p99 below 250 ms, and control-plane CPU per placement within 1.5x
between 1,000 x 100 and 10,000 x 1,000. The exit status is non-zero only for a correctness failure:
a job lost or handed out twice, a claim answered with anything but 200 or 204 (or not in time), a
completion refused or not answered, or (in a complete run) a job that did not succeed. The latencies
of a run with claim timeouts are censored at the timeout.

``--gpu-failure [N]`` (with ``--job-gpus``, issue 28; ``bench/gpu_failure.py``): between a third
and two thirds of the jobs placed, the load generator reports up to N GPUs (default 20, one per
node, one at a time, as many as the run has room for) unhealthy with XID 79 through
``POST /api/v1/agent/gpu-health`` with their nodes' credentials, and times report sent ->
answered and report sent -> the first admin read showing the GPU unhealthy; at the end the
database must show no job placed on (or running past) a failed GPU after its report was
answered. A job that was running on such a GPU ends ``GPU_FAILED``, and its refused completion
(409 ``JOB_NOT_RUNNING``) is expected, not a correctness failure.

Run (PostgreSQL reachable with the given user)::

    python bench/placement.py --jobs 1000 --nodes 100
    python bench/placement.py --preset sc3          # both SC-3 sizes and the CPU ratio
    python bench/placement.py --jobs 3000 --nodes 1000 --job-gpus 1 --gpu-failure

``--source DIR`` runs the control plane from another checkout (e.g.
``git archive HEAD | tar -x -C /tmp/head``) for before/after comparisons.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import fleet
import gpu_failure

CLAIM_PATH = "/api/v1/agent/work/claim"
HOLD_SECONDS = 25.0
#: How much longer than the hold a claim may take to be answered (the node agent's own margin).
CLAIM_MARGIN_SECONDS = 15.0
COMPLETE_BODY = b'{"state":"succeeded","result":null}'
BATCH_PATH = "/api/v1/jobs:batch"
BATCH_SIZE = 1000
SC3_SIZES = ((1000, 100), (10000, 1000))
TARGET_RATE = 500.0
TARGET_P99_MS = 250.0
TARGET_CPU_RATIO = 1.5
OTHER_WARN_CORES = 0.2
#: Between two dispatch probes: each finds every claim waiting again.
PROBE_GAP_SECONDS = 0.05


def job_body(gpus: int) -> dict[str, Any]:
    return {
        "entrypoint": {
            "kind": "python",
            "module": "bench",
            "function": "main",
            "source": {"bench.py": "def main():\n    return 1\n"},
        },
        "resources": {"cpus": 1, "gpus": gpus, "memory_mb": 512},
    }


async def queue_jobs(
    base: str, admin_token: str, jobs: int, body: dict[str, Any], concurrency: int
) -> str:
    """Queue `jobs` copies of `body`; says how."""
    import httpx

    admin = {"X-ModelForge-Admin-Token": admin_token}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=120.0) as client:
        queued = 0
        while queued < jobs:
            count = min(BATCH_SIZE, jobs - queued)
            response = await client.post(BATCH_PATH, headers=admin, json={"jobs": [body] * count})
            if response.status_code in (404, 405) and queued == 0:
                break  # no batch endpoint on this server
            if response.status_code != 201 or len(response.json()["jobs"]) != count:
                raise SystemExit(f"batch submit: {response.status_code} {response.text[:500]}")
            queued += count
        else:
            return f"{BATCH_PATH}, {BATCH_SIZE} per request"

        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                response = await client.post("/api/v1/jobs", headers=admin, json=body)
            if response.status_code != 201:
                raise SystemExit(f"submit: {response.status_code} {response.text[:500]}")

        await asyncio.gather(*(one() for _ in range(jobs)))
    return f"one POST /api/v1/jobs each ({BATCH_PATH}: 404/405), {concurrency} connections"


# -- the load generator (a separate process) --------------------------------------------------


class LoadGenerator:
    def __init__(self, config: dict[str, Any]) -> None:
        self.port: int = config["port"]
        self.jobs: int = config["jobs"]
        self.hold: float = config["hold_seconds"]
        self.interval: float = config["heartbeat_interval_seconds"]
        self.max_seconds: float = config["max_seconds"]
        self.probes: int = config["probes"]
        self.admin_token: str = config["admin_token"]
        credentials: list[str] = config["credentials"]
        claim = json.dumps({"hold_seconds": self.hold}).encode()
        self.claims = [
            fleet.http_request("POST", CLAIM_PATH, port=self.port, body=claim, credential=c)
            for c in credentials
        ]
        self.heartbeats = [
            fleet.http_request(
                "POST",
                fleet.HEARTBEAT_PATH,
                port=self.port,
                body=fleet.HEARTBEAT_BODY,
                credential=c,
            )
            for c in credentials
        ]
        self.credentials = credentials
        self.slots = [
            (node, fleet.KeepAlive(self.port))
            for node in range(len(credentials))
            for _ in range(config["slots"])
        ]
        # About 2.5 heartbeats/s per connection, so that a slow server delays heartbeats rather
        # than leaving most nodes without one.
        lanes = max(1, min(64, -(-len(credentials) // 25)))
        self.lanes = [
            (list(range(lane, len(credentials), lanes)), fleet.KeepAlive(self.port))
            for lane in range(lanes)
        ]
        self.start = 0.0
        self.closed = False  # the measuring window is over
        self.stopping = False  # send no new claim
        self.done = asyncio.Event()
        self.received: list[str] = []
        self.unique: set[str] = set()
        self.latencies: list[float] = []
        self.last_placement = 0.0
        self.placed_after = 0
        self.completing = 0
        self.counts: Counter[str] = Counter()
        self.refusals: list[str] = []
        #: During the probe phase: when each job's claim was answered (perf_counter).
        self.probing = False
        self.probes_submitted = 0
        self.answered_at: dict[str, float] = {}
        #: When each job was placed in the window (perf_counter), and --gpu-failure's reports.
        self.placed_at: list[float] = []
        self.gpu_failures = (
            gpu_failure.Injector(self.port, self.admin_token, credentials, config["gpu_failures"])
            if config.get("gpu_failures")
            else None
        )

    async def connect(self) -> None:
        conns = [conn for _, conn in self.slots] + [conn for _, conn in self.lanes]
        for first in range(0, len(conns), 200):
            await asyncio.gather(*(conn.open() for conn in conns[first : first + 200]))

    def _refused(self, what: str, response: fleet.RawResponse) -> None:
        self.counts[f"{what} {response.status}"] += 1
        if len(self.refusals) < 5:
            self.refusals.append(f"{what}: {response.status} {response.body[:300]!r}")

    async def slot(self, node: int, conn: fleet.KeepAlive) -> None:
        claim = self.claims[node]
        while not self.stopping:
            sent = time.perf_counter()
            try:
                response = await conn.exchange(claim, self.hold + CLAIM_MARGIN_SECONDS)
            except TimeoutError:
                self.counts[f"claim timeouts ({self.hold + CLAIM_MARGIN_SECONDS:g} s)"] += 1
                continue
            except (OSError, asyncio.IncompleteReadError, ValueError):
                self.counts["claim errors"] += 1
                await asyncio.sleep(0.5)
                continue
            answered = time.perf_counter()
            if response.status == 204:
                self.counts["claims 204"] += 1
                continue
            if response.status != 200:
                self._refused("claim", response)
                await asyncio.sleep(1.0)  # a persistent refusal must not become a tight loop
                continue
            job_id = str(json.loads(response.body)["job_id"])
            self.counts["claims 200"] += 1
            self.received.append(job_id)
            if self.probing:
                self.answered_at[job_id] = answered
                await self.complete(node, conn, job_id)
                continue
            self.unique.add(job_id)
            if self.closed:
                self.placed_after += 1
            else:
                self.latencies.append(answered - max(sent, self.start))
                self.last_placement = answered
                self.placed_at.append(answered)
            await self.complete(node, conn, job_id)

    async def complete(self, node: int, conn: fleet.KeepAlive, job_id: str) -> None:
        request = fleet.http_request(
            "POST",
            f"/api/v1/agent/jobs/{job_id}/complete",
            port=self.port,
            body=COMPLETE_BODY,
            credential=self.credentials[node],
        )
        self.completing += 1
        try:
            response = await conn.exchange(request, 60.0)
            if response.status == 200:
                self.counts["completed"] += 1
            elif self.gpu_failures and self.gpu_failures.excused(node, job_id, response):
                self.counts["GPU_FAILED jobs' completions refused 409 (expected)"] += 1
            else:
                self._refused("complete", response)
        except TimeoutError:
            self.counts["complete timeouts (60 s)"] += 1
        except (OSError, asyncio.IncompleteReadError, ValueError):
            self.counts["complete errors"] += 1
        finally:
            self.completing -= 1
        if len(self.unique) >= self.jobs and self.completing == 0:
            self.done.set()

    async def lane(self, nodes: list[int], conn: fleet.KeepAlive, offset: float) -> None:
        period = self.interval / len(nodes)
        due = self.start + offset
        index = 0
        while True:
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                response = await conn.exchange(self.heartbeats[nodes[index]], 30.0)
                if response.status == 200:
                    self.counts["heartbeats 200"] += 1
                else:
                    self._refused("heartbeat", response)
            except TimeoutError:
                self.counts["heartbeat timeouts (30 s)"] += 1
            except (OSError, asyncio.IncompleteReadError, ValueError):
                self.counts["heartbeat errors"] += 1
                await asyncio.sleep(0.5)
            index = (index + 1) % len(nodes)
            # Behind schedule, the next one waits its period like an agent's would: no burst.
            due = max(due + period, time.perf_counter())

    async def run(self, received_path: Path) -> dict[str, Any]:
        await self.connect()
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        self.start = time.perf_counter()
        slots = [asyncio.create_task(self.slot(node, conn)) for node, conn in self.slots]
        lanes = [
            asyncio.create_task(self.lane(nodes, conn, self.interval * i / len(self.credentials)))
            for i, (nodes, conn) in enumerate(self.lanes)
        ]
        injecting = (
            asyncio.create_task(self.gpu_failures.run(lambda: len(self.unique)))
            if self.gpu_failures
            else None
        )
        try:
            async with asyncio.timeout(self.max_seconds):
                await self.done.wait()
        except TimeoutError:
            pass
        window_end = time.perf_counter()
        if self.gpu_failures and injecting:
            self.gpu_failures.stopping = True  # the one in flight is followed, no more are sent
            await injecting
        print("DRAINED", flush=True)
        probe_ms = await self.probe() if self.done.is_set() and self.probes else []
        self.closed = self.stopping = True
        print("END", flush=True)
        if self.done.is_set():
            for task in slots:  # nothing is queued: the claims still held can bring nothing
                task.cancel()
        else:
            # Let every claim still held be answered (a job it brings is completed): a claim
            # dropped now could still be handed a job, which nobody would ever complete.
            _, pending = await asyncio.wait(slots, timeout=self.hold + CLAIM_MARGIN_SECONDS + 5)
            self.counts["claims abandoned at the end"] += len(pending)
            for task in pending:
                task.cancel()
        for task in lanes:
            task.cancel()
        heartbeat_s = time.perf_counter() - self.start
        await asyncio.gather(*slots, *lanes, return_exceptions=True)
        for _, conn in self.slots + [(0, c) for _, c in self.lanes]:
            conn.close()
        received_path.write_text("".join(f"{job_id}\n" for job_id in self.received))
        ordered = sorted(self.latencies)
        return {
            "complete": self.done.is_set() and len(self.latencies) >= self.jobs,
            "placed": len(self.latencies),
            "placed_after": self.placed_after,
            "seconds_to_last": (self.last_placement - self.start) if self.latencies else 0.0,
            "window_s": window_end - self.start,
            "heartbeats_due": len(self.credentials) * heartbeat_s / self.interval,
            "p50_ms": 1000 * fleet.percentile(ordered, 0.50),
            "p99_ms": 1000 * fleet.percentile(ordered, 0.99),
            "max_ms": 1000 * (ordered[-1] if ordered else 0.0),
            "probe_ms": probe_ms,
            "probes_submitted": self.probes_submitted,
            "counts": dict(self.counts),
            "refusals": self.refusals,
            "gpu_failures": (
                self.gpu_failures.result(self.placed_at, self.start) if self.gpu_failures else None
            ),
        }

    async def probe(self) -> list[float]:
        """SC-3's dispatch latency, literally: with every node's claim waiting and the queue
        empty, submit one job at a time and time "job queued" (the submission sent) to "claim
        answered with it" (milliseconds, one per probe)."""
        self.probing = True
        submit = fleet.KeepAlive(self.port)
        await submit.open()
        sent: dict[str, float] = {}
        body = json.dumps(job_body(0)).encode()
        request = fleet.http_request("POST", "/api/v1/jobs", port=self.port, body=body)
        request = request.replace(
            b"Content-Type:",
            f"X-ModelForge-Admin-Token: {self.admin_token}\r\nContent-Type:".encode(),
            1,
        )
        for _ in range(self.probes):
            at = time.perf_counter()
            response = await submit.exchange(request, 30.0)
            if response.status != 201:
                self._refused("probe submit", response)
                break
            sent[str(json.loads(response.body)["job_id"])] = at
            await asyncio.sleep(PROBE_GAP_SECONDS)
        self.probes_submitted = len(sent)
        deadline = time.perf_counter() + 10
        while any(job_id not in self.answered_at for job_id in sent):
            if time.perf_counter() > deadline:
                self.counts["probes never claimed"] += sum(j not in self.answered_at for j in sent)
                break
            await asyncio.sleep(0.05)
        submit.close()
        return sorted(
            1000 * (self.answered_at[job_id] - at)
            for job_id, at in sent.items()
            if job_id in self.answered_at
        )


def loadgen_main(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    fleet.raise_fd_limit(len(config["credentials"]) * config["slots"] + 256)

    async def run() -> dict[str, Any]:
        return await LoadGenerator(config).run(Path(config["received"]))

    try:
        import uvloop
    except ImportError:
        result = asyncio.run(run())
    else:
        result = uvloop.run(run())
    print("RESULT " + json.dumps(result), flush=True)


# -- one size ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What the database says at the end, against what the load generator received."""

    jobs: int
    states: dict[str, int]
    handed_out: int  # jobs with a `running` state event
    handed_in_window: int  # `running` state events between the clock's start and the end
    handed_twice: int  # jobs with more than one
    received: int  # distinct jobs the load generator was handed
    received_twice: int
    lost: int  # handed out by the server, never received
    phantom: int  # received, but the database shows no `running` event
    #: Ended GPU_FAILED (--gpu-failure: their GPU failed under them; `gpu_failure.check`
    #: holds them against the completions refused for it).
    gpu_failed: int = 0

    def problems(self, expected: int, complete: bool) -> list[str]:
        found = []
        if self.jobs != expected:
            found.append(f"{self.jobs} jobs in the database, {expected} queued")
        if self.handed_twice or self.received_twice:
            found.append(
                f"handed out twice: {self.handed_twice} (running events),"
                f" {self.received_twice} (received by the load generator)"
            )
        if self.lost or self.phantom:
            found.append(f"{self.lost} handed out but never received, {self.phantom} phantom")
        unfinished = self.received - self.states.get("succeeded", 0) - self.gpu_failed
        if unfinished:
            found.append(f"{unfinished} received jobs did not end succeeded (nor GPU_FAILED)")
        if complete and self.states.get("succeeded", 0) + self.gpu_failed != expected:
            found.append(f"not every job succeeded (or failed with its GPU): {self.states}")
        return found


def verify(pg: fleet.Postgres, received: list[str], window: tuple[datetime, datetime]) -> Verdict:
    with pg.connect() as conn:
        rows = conn.execute(
            "SELECT j.id, j.state, count(e.id) FROM jobs j LEFT JOIN job_events e"
            " ON e.job_id = j.id AND e.kind = 'state' AND e.data->>'state' = 'running'"
            " GROUP BY j.id, j.state"
        ).fetchall()
        gpu_failed = conn.execute(
            "SELECT count(*) FROM jobs WHERE error_code = 'GPU_FAILED'"
        ).fetchone()[0]
        in_window = conn.execute(
            "SELECT count(*) FROM job_events WHERE kind = 'state'"
            " AND data->>'state' = 'running' AND at BETWEEN %s AND %s",
            window,
        ).fetchone()[0]
    running = {str(job_id): int(n) for job_id, _, n in rows}
    handed = {job_id for job_id, n in running.items() if n > 0}
    got = Counter(received)
    return Verdict(
        jobs=len(rows),
        states=dict(Counter(str(state) for _, state, _ in rows)),
        handed_out=len(handed),
        handed_in_window=int(in_window),
        handed_twice=sum(1 for n in running.values() if n > 1),
        received=len(got),
        received_twice=sum(1 for n in got.values() if n > 1),
        lost=len(handed - got.keys()),
        phantom=len(got.keys() - handed),
        gpu_failed=int(gpu_failed),
    )


@dataclass(frozen=True)
class SizeResult:
    jobs: int
    nodes: int
    load: dict[str, Any]
    cpu: fleet.CpuUse | None
    verdict: Verdict
    rows: list[tuple[str, str]]
    problems: list[str]

    @property
    def rate(self) -> float:
        seconds = self.load["seconds_to_last"]
        return float(self.load["placed"]) / seconds if seconds > 0 else 0.0

    @property
    def server_cpu_per_1000(self) -> float | None:
        """Per job the server handed out while the clock ran (the database's count: in a run
        where claims time out the server also places jobs that reach nobody, and that is work
        too; otherwise it equals the load generator's)."""
        placed = self.verdict.handed_in_window
        if self.cpu is None or not placed:
            return None
        server = sum(s for name, s in self.cpu.parts.items() if name.startswith("control plane"))
        return 1000 * server / placed


def _expect(loadgen: subprocess.Popen[str], word: str, errors: Path) -> str:
    assert loadgen.stdout is not None
    for line in loadgen.stdout:
        if line.startswith(word):
            return line[len(word) :].strip()
    loadgen.wait()
    raise SystemExit(f"load generator ended ({loadgen.returncode}):\n{errors.read_text()[-4000:]}")


def _server_env(args: argparse.Namespace) -> dict[str, str]:
    return {
        "MODELFORGE_NODE_STALE_AFTER_SECONDS": "3600",
        "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": "7200",
        "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": str(args.heartbeat_interval),
        "MODELFORGE_JOB_CONTACT_TIMEOUT_SECONDS": "3600",
    }


def run_size(args: argparse.Namespace, jobs: int, nodes: int, database: str) -> SizeResult:
    print(f"\n== {jobs:,} jobs x {nodes:,} nodes x {args.slots} slot(s) ==")
    pg = fleet.Postgres(args.pg_host, args.pg_port, args.pg_user, database)
    concurrency = args.enroll_concurrency
    with tempfile.TemporaryDirectory(prefix="mf-bench-placement-") as tmp:
        workdir = Path(tmp)
        pg.recreate()
        server: fleet.ControlPlane | None = None
        loadgen: subprocess.Popen[str] | None = None
        try:
            server = fleet.ControlPlane(
                pg, workdir, fleet.free_port(), env=_server_env(args), source=args.source
            )
            server.wait_healthy()
            t = time.perf_counter()
            creds = asyncio.run(
                fleet.enroll_nodes(server.base, server.admin_token, nodes, concurrency)
            )
            beat = asyncio.run(fleet.heartbeat_all(server.base, creds, concurrency))
            bodies = [
                fleet.inventory(
                    i, cpus=args.slots, memory_mb=512 * args.slots, gpus=args.job_gpus * args.slots
                )
                for i in range(nodes)
            ]
            refused = asyncio.run(fleet.report_inventories(server.base, creds, bodies, concurrency))
            if beat.failed or refused:
                raise SystemExit(
                    f"{beat.failed} heartbeats and {refused} inventories not answered 200:\n"
                    + server.log()
                )
            print(
                f"enrolled, online, inventory reported: {nodes:,} nodes in"
                f" {time.perf_counter() - t:.1f} s (heartbeat every {beat.interval_seconds:g} s)"
            )
            t = time.perf_counter()
            how = asyncio.run(
                queue_jobs(
                    server.base,
                    server.admin_token,
                    jobs,
                    job_body(args.job_gpus),
                    args.submit_concurrency,
                )
            )
            print(f"queued {jobs:,} jobs in {time.perf_counter() - t:.1f} s ({how})")
            failures = (
                gpu_failure.plan(
                    args.gpu_failure, jobs, node_ids(pg, nodes), [b["gpus"] for b in bodies]
                )
                if args.gpu_failure
                else []
            )

            config = workdir / "loadgen.json"
            received = workdir / "received.txt"
            config.write_text(
                json.dumps(
                    {
                        "port": server.port,
                        "credentials": creds,
                        "slots": args.slots,
                        "jobs": jobs,
                        "hold_seconds": HOLD_SECONDS,
                        "heartbeat_interval_seconds": beat.interval_seconds,
                        "max_seconds": args.max_seconds,
                        "probes": args.probes,
                        "admin_token": server.admin_token,
                        "received": str(received),
                        "gpu_failures": failures,
                    }
                )
            )
            errors = workdir / "loadgen.err"
            with errors.open("w") as err:
                loadgen = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "_loadgen", str(config)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
            _expect(loadgen, "READY", errors)
            worker = server.worker_pid()
            supervisor = server.proc.pid
            generator = loadgen.pid

            def parts() -> dict[str, float]:
                named = {"control plane worker": fleet.cpu_s(worker)}
                if supervisor != worker:
                    named["control plane supervisor"] = fleet.cpu_s(supervisor)
                named["load generator"] = fleet.cpu_s(generator)
                named["benchmark driver"] = fleet.self_cpu_s()
                return named

            before = fleet.cpu_snapshot(pg.database, parts())
            stdin: IO[str] | None = loadgen.stdin
            assert stdin is not None
            go_at = datetime.now(UTC)
            stdin.write("GO\n")
            stdin.flush()
            print(f"clock started: {nodes * args.slots:,} long-poll claims")
            _expect(loadgen, "DRAINED", errors)
            after = fleet.cpu_snapshot(pg.database, parts())
            _expect(loadgen, "END", errors)  # after the dispatch probes
            end_at = datetime.now(UTC)
            load = json.loads(_expect(loadgen, "RESULT", errors))
            loadgen.wait()
            verdict = verify(pg, received.read_text().split(), (go_at, end_at))
            gpu_check = gpu_failure.check(pg, load["gpu_failures"]) if failures else ([], [])
            if load["refusals"]:
                print("refusals (first few):\n  " + "\n  ".join(load["refusals"]))
        finally:
            if loadgen is not None and loadgen.poll() is None:
                loadgen.kill()
                loadgen.wait()
            if server is not None:
                server.stop()
            if not args.keep:
                pg.drop()
    return summarise(jobs, nodes, args, load, fleet.cpu_use(before, after), verdict, gpu_check)


def node_ids(pg: fleet.Postgres, nodes: int) -> list[str]:
    """The enrolled nodes' ids in their credentials' order (each enrolled as bench-host-<i>)."""
    with pg.connect() as conn:
        by_host = dict(conn.execute("SELECT hostname, id FROM nodes").fetchall())
    return [str(by_host[f"bench-host-{i}"]) for i in range(nodes)]


def summarise(
    jobs: int,
    nodes: int,
    args: argparse.Namespace,
    load: dict[str, Any],
    cpu: fleet.CpuUse | None,
    verdict: Verdict,
    gpu_check: tuple[list[tuple[str, str]], list[str]] = ([], []),
) -> SizeResult:
    counts: dict[str, int] = load["counts"]
    problems = verdict.problems(jobs + load["probes_submitted"], load["complete"])
    problems += gpu_check[1]
    bad_claims = sum(
        n
        for key, n in counts.items()
        if key.startswith("claim") and key not in ("claims 200", "claims 204")
    )
    bad_completes = sum(n for key, n in counts.items() if key.startswith("complete "))
    if bad_claims:
        problems.append(f"claims answered with neither 200 nor 204, or not at all: {bad_claims}")
    if bad_completes:
        problems.append(f"completions refused or failed: {bad_completes}")
    result = SizeResult(jobs, nodes, load, cpu, verdict, [], problems)
    placed = load["placed"]
    status = (
        "complete"
        if load["complete"]
        else f"PARTIAL: stopped at --max-seconds {args.max_seconds:g}; {jobs - placed:,} jobs"
        " still queued waited at least the whole run, longer than any latency below"
    )
    rows = [
        ("size", f"{jobs:,} jobs x {nodes:,} nodes x {args.slots} slot(s)"),
        ("run", status),
        ("jobs placed", f"{placed:,} / {jobs:,} in {load['seconds_to_last']:.1f} s"),
        ("placements/s", f"{result.rate:,.1f}"),
        ("claim latency p50", f"{load['p50_ms']:,.1f} ms"),
        ("claim latency p99", f"{load['p99_ms']:,.1f} ms"),
        ("claim latency max", f"{load['max_ms']:,.1f} ms"),
    ]
    probes = load["probe_ms"]
    if probes:
        rows += [
            (
                f"dispatch probe p50 / p99 ({len(probes)} jobs)",
                f"{fleet.percentile(probes, 0.5):,.1f} / {fleet.percentile(probes, 0.99):,.1f} ms",
            ),
        ]
    per_1000 = result.server_cpu_per_1000
    if per_1000 is not None:
        rows.append(("control plane CPU per 1,000 placements", f"{per_1000:.2f} s"))
        if verdict.handed_in_window != placed:
            rows.append(
                (
                    "  (placements, server-side)",
                    f"{verdict.handed_in_window:,} handed out while the clock ran,"
                    f" {placed:,} received by the load generator while it ran",
                )
            )
    if cpu is not None:
        rows += cpu.rows()
    rows += [
        ("placed after the window (drain)", f"{load['placed_after']:,}"),
        (
            "claims answered 200 / 204",
            f"{counts.get('claims 200', 0):,} / {counts.get('claims 204', 0):,}",
        ),
        (
            "heartbeats answered 200",
            f"{counts.get('heartbeats 200', 0):,} of {load['heartbeats_due']:,.0f} due",
        ),
        (
            "other answers",
            ", ".join(
                f"{k}: {v}"
                for k, v in sorted(counts.items())
                if k not in ("claims 200", "claims 204", "heartbeats 200", "completed")
            )
            or "none",
        ),
        (
            "jobs by state (database)",
            ", ".join(f"{k} {v:,}" for k, v in sorted(verdict.states.items())),
        ),
        (
            "handed out (running events)",
            f"{verdict.handed_out:,} ({verdict.handed_in_window:,} while the clock ran),"
            f" twice: {verdict.handed_twice}",
        ),
        (
            "received by the load generator",
            f"{verdict.received:,}, twice: {verdict.received_twice}",
        ),
    ]
    rows += gpu_check[0]
    rows.append(("correctness", "ok" if not problems else "FAILED: " + "; ".join(problems)))
    return SizeResult(jobs, nodes, load, cpu, verdict, rows, problems)


def print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def print_targets(results: list[SizeResult]) -> None:
    print("\nSC-3 targets (printed, not enforced):")
    large = [r for r in results if (r.jobs, r.nodes) == SC3_SIZES[1]]
    for r in large or results:
        where = f"{r.jobs:,} x {r.nodes:,}"
        if not large:
            where += " (the target is stated for 10,000 x 1,000)"
        partial = "" if r.load["complete"] else ", PARTIAL run"
        print(
            f"  placements/s >= {TARGET_RATE:g} at {where}: {r.rate:,.1f}"
            f" -> {'met' if r.rate >= TARGET_RATE and r.load['complete'] else 'NOT met'}{partial}"
        )
        probes = r.load["probe_ms"]
        if probes:
            p99 = fleet.percentile(probes, 0.99)
            print(
                f"  fitting job queued -> claim answered, p99 < {TARGET_P99_MS:g} ms at {where}"
                f" (every claim waiting): {p99:,.1f} ms"
                f" -> {'met' if p99 < TARGET_P99_MS else 'NOT met'}"
            )
        p99 = r.load["p99_ms"]
        print(
            f"  claim sent -> answered while saturated, p99 at {where}: {p99:,.1f} ms"
            " (queueing: waiting claims / placements per second; shown, not the target)"
        )
    if len(results) >= 2:
        small, big = results[0].server_cpu_per_1000, results[-1].server_cpu_per_1000
        if small and big:
            ratio = big / small
            print(
                f"  control plane CPU per placement, {results[-1].jobs:,} x {results[-1].nodes:,}"
                f" / {results[0].jobs:,} x {results[0].nodes:,}: {big:.2f} / {small:.2f} s per"
                f" 1,000 = {ratio:.2f}x (target <= {TARGET_CPU_RATIO:g}x)"
                f" -> {'met' if ratio <= TARGET_CPU_RATIO else 'NOT met'}"
            )
    for r in results:
        if r.cpu is not None and r.cpu.cores(r.cpu.other) > OTHER_WARN_CORES:
            print(
                f"warning: other processes used {100 * r.cpu.cores(r.cpu.other):.0f}% of a core"
                f" during the {r.jobs:,} x {r.nodes:,} run; the machine was shared, so its"
                " figures are disturbed: run again on a quiet machine"
            )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=1000, help="jobs queued (default 1000)")
    parser.add_argument("--nodes", type=int, default=100, help="nodes enrolled (default 100)")
    parser.add_argument(
        "--preset", choices=["sc3"], help="sc3: 1,000 x 100 and 10,000 x 1,000, and their CPU ratio"
    )
    parser.add_argument("--slots", type=int, default=1, help="parallel claims per node (default 1)")
    parser.add_argument("--job-gpus", type=int, default=0, help="GPUs per job (default 0)")
    parser.add_argument(
        "--gpu-failure",
        type=int,
        nargs="?",
        const=gpu_failure.DEFAULT_COUNT,
        default=0,
        metavar="N",
        help="report N GPUs (default 20, one per node) failed (XID 79) while jobs are placed,"
        " timing how soon each is out of the schedule (needs --job-gpus)",
    )
    parser.add_argument("--max-seconds", type=float, default=120.0, help="per size (default 120)")
    parser.add_argument("--heartbeat-interval", type=float, default=10.0)
    parser.add_argument("--enroll-concurrency", type=int, default=8)
    parser.add_argument("--submit-concurrency", type=int, default=8)
    parser.add_argument("--source", type=Path, help="run the control plane from this checkout")
    parser.add_argument("--pg-host", default=os.environ.get("PGHOST", "127.0.0.1"))
    parser.add_argument("--pg-port", type=int, default=int(os.environ.get("PGPORT", "5432")))
    parser.add_argument("--pg-user", default=os.environ.get("PGUSER", "postgres"))
    parser.add_argument(
        "--database",
        default=f"modelforge_bench_placement_{os.getpid()}",
        help="prefix of the databases (one per size), dropped and recreated, dropped at the end",
    )
    parser.add_argument("--keep", action="store_true", help="keep the databases afterwards")
    parser.add_argument(
        "--probes",
        type=int,
        default=100,
        help="dispatch probes after the drain: single jobs submitted while every claim waits",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    if argv[:1] == ["_loadgen"]:
        loadgen_main(Path(argv[1]))
        return 0
    args = parse_args(argv)
    if args.gpu_failure and args.job_gpus < 1:
        raise SystemExit("--gpu-failure fails GPUs the jobs use: give --job-gpus 1 or more")
    sizes = list(SC3_SIZES) if args.preset == "sc3" else [(args.jobs, args.nodes)]
    # Every long poll is a connection at both ends; the server and the load generator inherit it.
    largest = max(nodes for _, nodes in sizes) * args.slots
    limit = fleet.raise_fd_limit(2 * largest + 1024)
    if limit < largest + 256:
        raise SystemExit(f"RLIMIT_NOFILE is {limit}; {largest} long polls need more (ulimit -n)")
    results = [
        run_size(args, jobs, nodes, f"{args.database}_{index}")
        for index, (jobs, nodes) in enumerate(sizes)
    ]
    for result in results:
        print()
        print_rows(result.rows)
    print_targets(results)
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
