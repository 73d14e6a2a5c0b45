"""Gateway benchmark (issue 27): the same model and load generator as bench/serving.py, direct to
one replica's URL and through the control plane's gateway (the node's tunnel), in one run.

What runs
---------
A real control plane (Granian, SQLite), two nodes on this machine (each a node agent and its
runtime worker, as the end-to-end tests start them: tests/e2e/server.py, tests/e2e/node.py) and
the issue 26 MLP 256 -> 256 -> 10 (bench/serving.py's model, bodies and `wrk` load generator,
imported, in its own process). Parts, each chosen with ``--parts`` (default: all), so a partial
feature set can still be measured; the run says which ran and why any did not:

- ``compare``: a one-replica ONNX service; `wrk` at 1 and 8 connections, binary and JSON
  tensors, straight at the replica's ``url`` and at ``{CP}/v2/models/mlp/infer`` with an access
  token (``Authorization: Bearer``, read by wrk from a file, never from its arguments).
  Requests/s, p50 and p99 as wrk saw them, and where the CPU went during each run: the control
  plane (its Granian processes), the agents, the runtime workers with their model servers, the
  load generator (each a share of one core).
- ``rollout``: that service's model changed to version 2 (``PATCH /api/v1/services/{id}``
  ``{"model": "mlp@2"}``) while wrk sends through the gateway: failed requests (non-2xx or
  socket errors) and how long until the traffic was on revision 2 (the old replica draining:
  ``--drain-seconds``, the control plane's MODELFORGE_SERVICE_DRAIN_SECONDS, default 30).
- ``cold``: a service with ``autoscale {"min": 0, "max": 1, ...}``: once it has scaled to zero,
  the time from the first request to its answer.
- ``kill``: a two-replica service on the two nodes; under load through the gateway one node's
  agent and runtime worker (with its model server) are killed with SIGKILL: failed requests.

Targets (printed, not failed): the gateway adds <= 1 ms p50 at 8 connections; its requests/s
>= 0.5x direct; zero failed requests in the rollout and the node kill; the first answer after
scale to zero within 5 s. The exit status is 1 when a direct or gateway run of ``compare`` had a
failed request or a chosen part could not run, else 0.

Run::

    python bench/gateway.py                        # about 3 minutes
    python bench/gateway.py --parts compare --duration 10 --rounds 3
    python bench/gateway.py --parts compare --gateway-front python  # the Python gateway
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serving import HEADER, SMALL, Body, Result, bodies, target, wrk_load  # noqa: E402
from tests.e2e.node import Node, wait_ready, wait_until  # noqa: E402
from tests.e2e.server import FAST, LiveServer  # noqa: E402
from tests.onnx_models import mlp  # noqa: E402

PARTS = ("compare", "rollout", "cold", "kill")
MODEL = "mlp"  # the model's name and the compared service's: /v2/models/mlp/infer either way
#: Fast liveness (tests/e2e/server.py) and no per-request debug lines.
SETTINGS = {**FAST, "MODELFORGE_LOG_LEVEL": "warning"}


class PartUnavailable(Exception):
    """A part the stack cannot run yet (an API refused, the gateway not serving): said, skipped."""


# -- the stack and its CPU --------------------------------------------------------------------


@dataclass
class Stack:
    """The control plane and the nodes; `cpu_seconds` (all of them) is what `wrk_load` reads."""

    server: LiveServer
    nodes: list[Node]
    name: str = "stack"
    clients: dict[str, str] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return self.server.port

    def groups(self) -> dict[str, list[int]]:
        live = [node for node in self.nodes if node.agent is not None]
        assert self.server.process is not None
        return {
            "control plane": [self.server.process.pid],
            "agents": [node.agent.pid for node in live if node.agent is not None],
            "workers+models": [node.worker.pid for node in live if node.worker is not None],
        }

    def cpu_by_group(self) -> dict[str, float]:
        """User and system CPU seconds of each group's process trees, as they stand now."""
        found: dict[str, float] = {}
        for group, roots in self.groups().items():
            total = 0.0
            for root in roots:
                try:
                    process = psutil.Process(root)
                    for member in (process, *process.children(recursive=True)):
                        times = member.cpu_times()
                        total += times.user + times.system
                except psutil.NoSuchProcess:
                    continue
            found[group] = total
        return found

    def cpu_seconds(self) -> float:
        return sum(self.cpu_by_group().values())

    def call(self, method: str, path: str, expect: int = 200, **kw: Any) -> Any:
        with self.server.client() as client:
            response = client.request(method, path, headers=self.server.admin, **kw)
        if response.status_code != expect:
            raise PartUnavailable(f"{method} {path}: {response.status_code} {response.text[:300]}")
        return response.json() if response.content else None

    def service(self, service_id: str) -> dict[str, Any]:
        return dict(self.call("GET", f"/api/v1/services/{service_id}"))


@contextmanager
def started(root: Path, nodes: int, drain: float, front: str = "native") -> Iterator[Stack]:
    with ExitStack() as stack:
        settings = {
            **SETTINGS,
            "MODELFORGE_SERVICE_DRAIN_SECONDS": str(drain),
            "MODELFORGE_GATEWAY_FRONT": front,
        }
        server = stack.enter_context(
            LiveServer(root / "cp", f"sqlite:///{root / 'cp.db'}", env_overrides=settings)
        )
        started_nodes = []
        for index in range(nodes):
            node = Node(
                root / f"node{index}",
                server.url,
                token=server.mint()["token"],
            )
            stack.enter_context(node)
            node.start_worker().start_agent()
            wait_ready(server, node.node_id(), 60)
            started_nodes.append(node)
        yield Stack(server, started_nodes)


def kill_node(node: Node) -> list[subprocess.Popen[bytes]]:
    """SIGKILL the node's agent and worker with everything they started, as a dead host ends
    them: all stopped first, so that none reacts to the death of another. Returned unreaped:
    reaped during a load run, their CPU would count as the load generator's."""
    roots = [process for process in (node.agent, node.worker) if process is not None]
    members = []
    for root in roots:
        try:
            parent = psutil.Process(root.pid)
            members += [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for member in members:
            try:
                member.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    node.agent = node.worker = None
    return roots


# -- services ---------------------------------------------------------------------------------


def register_models(stack: Stack) -> None:
    """`mlp@1` and `mlp@2`: the same shapes, other weights (what a rollout moves between)."""
    for version, seed in (("1", 1), ("2", 2)):
        digest = stack.call("POST", "/api/v1/artifacts", 201, content=mlp(SMALL, seed=seed))
        body = {"name": MODEL, "version": version, "runner": "onnx", "weights": digest["digest"]}
        stack.call("POST", "/api/v1/models", 201, json=body)


def deploy(
    stack: Stack, name: str, replicas: int = 1, *, wait: bool = True, **extra: Any
) -> dict[str, Any]:
    body = {
        "name": name,
        "model": f"{MODEL}@1",
        "resources": {"cpus": 0.5},
        "replicas": replicas,
        **extra,
    }
    service = stack.call("POST", "/api/v1/services", 201, json=body)
    service_id = service["service_id"]
    if not wait:
        return dict(service)
    try:
        wait_until(lambda: warm(stack.service(service_id), replicas), 120, f"{name} healthy")
    except AssertionError:
        raise PartUnavailable(f"{name} not healthy in 120 s: {why(stack, service_id)}") from None
    return stack.service(service_id)


def why(stack: Stack, service_id: str) -> str:
    """The service's last events and its output's last lines, for a part that could not run."""
    events = stack.call("GET", f"/api/v1/services/{service_id}/events")
    tail = stack.service(service_id).get("log_tail", [])
    return f"{json.dumps(events[-6:])}; its output: {json.dumps(tail[-8:])}"


def warm(service: dict[str, Any], replicas: int, revision: int | None = None) -> bool:
    ready = [
        replica
        for replica in service.get("replicas", [])
        if replica["state"] == "healthy"
        and replica.get("ready_at")
        and (revision is None or replica["revision"] == revision)
    ]
    return service["state"] == "healthy" and len(ready) >= replicas


def token_file(stack: Stack, service_id: str, scratch: Path) -> Path:
    """A file of the request header carrying a new access token (wrk reads it; no argv)."""
    minted = stack.call(
        "POST", f"/api/v1/services/{service_id}/access-tokens", 201, json={"name": "bench"}
    )
    path = scratch / f"headers-{service_id}"
    path.touch(mode=0o600)
    path.write_text(f"Authorization: Bearer {minted['token']}\n")
    return path


def gateway_infer(
    stack: Stack, name: str, headers: Path, body: Body, timeout: float
) -> tuple[int, str]:
    """One request through the gateway, as wrk sends it: its status (0 for no answer) and why."""
    token_name, token_value = headers.read_text().strip().split(": ", 1)
    sent = {"Content-Type": body.content_type, token_name: token_value}
    if body.header_length:
        sent["Inference-Header-Content-Length"] = body.header_length
    request = urllib.request.Request(  # noqa: S310 - loopback
        f"{stack.server.url}/v2/models/{name}/infer", data=body.path.read_bytes(), headers=sent
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310
            answer.read()
            return int(answer.status), ""
    except urllib.error.HTTPError as refused:
        return int(refused.code), refused.read()[:300].decode(errors="replace")
    except OSError as failed:
        return 0, str(failed)


def wait_gateway(stack: Stack, name: str, headers: Path, body: Body, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    status, why = 0, ""
    while time.monotonic() < deadline:
        status, why = gateway_infer(stack, name, headers, body, 10)
        if status == 200:
            return
        time.sleep(0.5)
    raise PartUnavailable(f"the gateway did not serve {name} in {timeout:.0f} s: {status} {why}")


# -- the parts --------------------------------------------------------------------------------


@dataclass
class Run:
    result: Result
    cpu: dict[str, float]  # share of one core per group, the load generator's included


@dataclass
class Figures:
    runs: dict[str, Run] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    failed_runs: int = 0


def measured(stack: Stack, rounds: int, load: Callable[[], Result]) -> Run:
    """Run `load` `rounds` times; the round of median requests/s, with the CPU of its groups."""
    kept = []
    for _ in range(rounds):
        before, started_at = stack.cpu_by_group(), time.monotonic()
        result = load()
        seconds = time.monotonic() - started_at
        after = stack.cpu_by_group()
        shares = {group: (after[group] - before.get(group, 0.0)) / seconds for group in after}
        shares["load generator"] = result.client_cpu
        kept.append(Run(result, shares))
    kept.sort(key=lambda run: run.result.rps)
    return kept[len(kept) // 2]


def compare(stack: Stack, args: argparse.Namespace, scratch: Path, figures: Figures) -> str:
    service = deploy(stack, MODEL)
    headers = token_file(stack, service["service_id"], scratch)
    small = bodies(scratch, SMALL[0], 1, "small")
    wait_gateway(stack, MODEL, headers, small["binary"], 60)
    direct_url = f"{service['url']}/v2/models/{MODEL}/infer"
    gateway_url = f"{stack.server.url}/v2/models/{MODEL}/infer"
    print(f"{HEADER}   cpu share of a core: cp / agents / workers+models / generator")
    for kind, connections in (("binary", 8), ("json", 8), ("binary", 1)):
        for route, url, extra in (("direct", direct_url, None), ("gateway", gateway_url, headers)):
            stack.name = route
            load = partial(
                wrk_load, stack, small[kind], connections, args.duration, f"small http {kind}",
                scratch, url=url, headers=extra,
            )  # fmt: skip
            run = measured(stack, args.rounds, load)
            cpu = " / ".join(f"{share:.2f}" for share in run.cpu.values())
            print(f"{run.result.row()}   {cpu}", flush=True)
            figures.runs[f"{route}-{kind}{connections}"] = run
            figures.failed_runs += run.result.failed
    for kind in ("binary", "json"):
        direct, gateway = figures.runs[f"direct-{kind}8"], figures.runs[f"gateway-{kind}8"]
        added = gateway.result.p50_ms - direct.result.p50_ms
        ratio = gateway.result.rps / direct.result.rps
        figures.targets.append(
            target(f"8 conns {kind}: p50 added by the gateway, ms", added, "<= 1", added <= 1)
        )
        figures.targets.append(
            target(f"8 conns {kind}: gateway / direct req/s", ratio, ">= 0.5", ratio >= 0.5)
        )
    return str(service["service_id"])


def under_load(
    stack: Stack, args: argparse.Namespace, scratch: Path, headers: Path, name: str,
    action: Callable[[], str],
) -> tuple[Result, str]:  # fmt: skip
    """wrk through the gateway for `--event-duration` s; `action` runs a third of the way in."""
    body = bodies(scratch, SMALL[0], 1, "small")["binary"]
    url = f"{stack.server.url}/v2/models/{name}/infer"
    stack.name = "gateway"
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(
            wrk_load, stack, body, args.event_connections, args.event_duration,
            f"{name} under load", scratch, url=url, headers=headers,
        )  # fmt: skip
        time.sleep(args.event_duration / 3)
        said = action()
        return load.result(), said


def rollout(
    stack: Stack, args: argparse.Namespace, scratch: Path, figures: Figures, service_id: str
) -> None:
    headers = token_file(stack, service_id, scratch)
    changed_at: list[float] = []

    def rolled() -> bool:
        """Traffic switched: revision 2 warm, every older replica draining (or stopped)."""
        service = stack.service(service_id)
        return warm(service, 1, revision=2) and all(
            replica["revision"] == 2 or replica["state"] in ("draining", "stopped")
            for replica in service["replicas"]
        )

    def update() -> str:
        changed_at.append(time.monotonic())
        stack.call("PATCH", f"/api/v1/services/{service_id}", json={"model": f"{MODEL}@2"})
        with contextlib.suppress(AssertionError):  # the load's end; then waited for below
            wait_until(rolled, args.event_duration * 2 / 3 - 1, "the rollout")
        return f"model changed to {MODEL}@2"

    result, said = under_load(stack, args, scratch, headers, MODEL, update)
    load_ended = time.monotonic()
    try:
        wait_until(rolled, 120, "the rollout")
    except AssertionError:
        raise PartUnavailable(
            f"the rollout did not finish within 120 s of the load: {why(stack, service_id)}"
        ) from None
    done = time.monotonic()
    covered = done <= load_ended + 0.5  # polled about every 0.1 s, a call taking a little more
    when = "while the load ran" if covered else "only after the load had ended"
    figures.lines.append(
        f"rollout under load: {result.requests} requests, {said}; traffic on revision 2 (the old "
        f"replica draining) {done - changed_at[0]:.1f} s after the change, {when}"
    )
    figures.lines.append(f"  {result.row()}")
    label = "rollout under load: failed requests" + ("" if covered else " (switch not covered)")
    met = result.failed == 0 and covered
    figures.targets.append(target(label, result.failed, "0", met))


def cold(stack: Stack, args: argparse.Namespace, scratch: Path, figures: Figures) -> None:
    autoscale = {"min": 0, "max": 1, "target_in_flight": 8, "idle_seconds": args.idle_seconds}
    # Not waited for: with no request yet it may scale to zero before it is ever healthy.
    service = deploy(stack, "mlp-cold", wait=False, autoscale=autoscale)
    service_id = service["service_id"]
    headers = token_file(stack, service_id, scratch)
    body = bodies(scratch, SMALL[0], 1, "small")["binary"]
    started_at = time.monotonic()
    wait_gateway(stack, "mlp-cold", headers, body, 180)  # once: the node caches the weights
    figures.lines.append(
        f"scale from zero, the first start (weights fetched): answered after "
        f"{time.monotonic() - started_at:.2f} s"
    )
    try:
        wait_until(
            lambda: all(  # drained and stopped: its model server no longer runs
                replica["state"] == "stopped" for replica in stack.service(service_id)["replicas"]
            ),
            args.idle_seconds + 90,
            "scale to zero",
        )
    except AssertionError:
        raise PartUnavailable(f"no scale to zero within {args.idle_seconds + 90} s") from None
    started_at = time.monotonic()
    status, _ = gateway_infer(stack, "mlp-cold", headers, body, 180)
    seconds = time.monotonic() - started_at
    figures.lines.append(
        f"scale from zero, weights cached: the first request after {args.idle_seconds} s idle "
        f"answered {status} in {seconds:.2f} s"
    )
    figures.targets.append(
        target(
            "scale from zero to the first answer, s",
            seconds,
            "<= 5",
            status == 200 and seconds <= 5,
        )
    )
    stack.call("DELETE", f"/api/v1/services/{service_id}")


def kill(stack: Stack, args: argparse.Namespace, scratch: Path, figures: Figures) -> None:
    service = deploy(stack, "mlp-pair", replicas=2)
    nodes = {replica["node_id"] for replica in service["replicas"]}
    if len(nodes) != 2:
        raise PartUnavailable(f"the two replicas are not on two nodes: {sorted(nodes)}")
    headers = token_file(stack, service["service_id"], scratch)
    body = bodies(scratch, SMALL[0], 1, "small")["binary"]
    wait_gateway(stack, "mlp-pair", headers, body, 60)
    victim = stack.nodes[-1]

    killed: list[subprocess.Popen[bytes]] = []

    def sigkill() -> str:
        killed.extend(kill_node(victim))
        return f"node {victim.root.name}'s agent and worker killed (SIGKILL)"

    result, said = under_load(stack, args, scratch, headers, "mlp-pair", sigkill)
    for process in killed:
        process.wait(timeout=20)
    figures.lines.append(f"node killed under load: {result.requests} requests, {said}")
    figures.lines.append(f"  {result.row()}")
    figures.targets.append(
        target("a node killed under load: failed requests", result.failed, "0", result.failed == 0)
    )


# -- the run ----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is missing: apt-get install wrk")
    chosen = [part for part in PARTS if part in args.parts.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    figures, ran, not_run = Figures(), [], {}
    try:
        nodes = 2 if "kill" in chosen else 1
        print(f"the control plane's gateway: {args.gateway_front} (MODELFORGE_GATEWAY_FRONT)")
        with started(scratch, nodes, args.drain_seconds, args.gateway_front) as stack:
            register_models(stack)
            compared: str | None = None
            for part in chosen:
                try:
                    if part == "compare":
                        compared = compare(stack, args, scratch, figures)
                    elif part == "rollout":
                        if compared is None:
                            raise PartUnavailable("it updates the compare part's service")
                        rollout(stack, args, scratch, figures, compared)
                    elif part == "cold":
                        cold(stack, args, scratch, figures)
                    else:
                        if compared is not None:  # free its cores for the pair
                            stack.call("DELETE", f"/api/v1/services/{compared}")
                        kill(stack, args, scratch, figures)
                    ran.append(part)
                except PartUnavailable as why:
                    not_run[part] = str(why)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print()
    for line in figures.lines:
        print(line)
    print(f"\nparts run: {', '.join(ran) or 'none'}")
    for part in PARTS:
        if part not in chosen:
            print(f"  {part}: not chosen (--parts)")
        elif part in not_run:
            print(f"  {part}: could not run: {not_run[part]}")
    print("\ntargets (issue 27):")
    for line in figures.targets:
        print(line)
    return 1 if figures.failed_runs or not_run else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="of " + ",".join(PARTS))
    parser.add_argument("--duration", type=int, default=5, help="seconds per compare run")
    parser.add_argument("--rounds", type=int, default=1, help="runs each; the median's shown")
    parser.add_argument("--event-duration", type=int, default=30, help="rollout/kill load, s")
    parser.add_argument("--event-connections", type=int, default=4)
    parser.add_argument("--idle-seconds", type=int, default=10, help="autoscale's, for cold")
    parser.add_argument(
        "--drain-seconds", type=float, default=30, help="MODELFORGE_SERVICE_DRAIN_SECONDS"
    )
    parser.add_argument(
        "--gateway-front",
        choices=["native", "python"],
        default="native",
        help="the control plane's end: its native front or Python (MODELFORGE_GATEWAY_FRONT)",
    )
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
