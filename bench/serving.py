"""Model serving benchmark (issue 26): ModelForge's model server against KServe's, same model,
same machine, same run.

What is measured
----------------
1. Two ONNX models are written to a scratch directory: the small MLP 256 -> 256 -> 10 (the
   issue's model; tests/onnx_models.mlp) and a bigger one, ``--big`` (default 1024 -> 2048 ->
   2048 -> 1024), on which batching pays: a batch of 32 rows costs far less than 32 runs of one.
2. The floor: bare onnxruntime runs the small model in this process, batch 1 (median of
   ``--floor-runs`` runs).
3. ModelForge: ``python -m runtime_worker.onnx_server`` (Granian, one worker; gRPC on a second
   port) serves the small model. A load generator in its own process sends one fixed request for
   ``--duration`` seconds over kept-alive connections (``--rounds`` times; the figures of the
   round with the median requests/s are shown): ``wrk`` (Debian package ``wrk``) with a
   Lua script for HTTP, at 1 and 8 connections, batch 1, JSON and binary tensor data; and
   nghttp2's ``h2load`` (Debian package ``nghttp2-client``, a C client speaking HTTP/1.1 and
   HTTP/2) for gRPC at 1 and 8 connections and, so that the two fronts are compared with the
   same client, for HTTP binary at 1 and 8 connections too; and gRPC's trivial ServerLive, which
   shows what a gRPC call costs before the front or the model do anything. h2load sees HTTP
   statuses only (a gRPC error is a 200 with a grpc-status trailer), so one gRPC call is checked
   before its runs.
4. KServe: its ``ModelServer`` (pip ``kserve``, FastAPI on uvicorn) with a thin custom
   ``kserve.Model`` around an onnxruntime session of the same file, installed in a virtual
   environment of its own (``--kserve-venv``, created with ``kserve==KSERVE_VERSION`` when
   missing: its pins clash with the project's), loaded the same way with JSON at 1 and 8
   connections (and binary at 8).
5. Batching: ModelForge serves the big model at 32 connections (binary), once with batching off
   and once with ``{"max_batch_size": 32}`` (Triton's semantics; no queue delay).

For each run: requests/s (2xx answers per second), p50 and p99 latency as the load generator saw
them, the server's CPU per request (all its processes, from /proc) and the load generator's CPU
(its share of a core). Then the issue's targets, each with whether it is met:
8 connections, batch 1, JSON >= 3x KServe's throughput; 1 connection p50 <= 0.5 ms; batching on at
32 connections >= 3x off; gRPC p50 within 1.5x of HTTP's (the same client for both; at 8
connections as the issue asks, and at 1).

The exit status is 0 when every request was answered 2xx; the targets are printed, not turned into
a failure (they depend on the machine: on a small shared one, the load generator and the server
share the cores, and anything else running skews every figure).

Run::

    python bench/serving.py                      # about 2 minutes
    python bench/serving.py --duration 10 --no-kserve
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KSERVE_VERSION = "0.21.0"
SMALL = (256, 256, 10)
MODEL = "mlp"
GRPC_SERVICE = "inference.GRPCInferenceService"

WRK_SCRIPT = r"""
local request_bytes

function init(args)
  local file = io.open(args[1], "rb")
  local body = file:read("*a")
  file:close()
  local headers = {["Content-Type"] = args[2]}
  if args[3] ~= "" then
    headers["Inference-Header-Content-Length"] = args[3]
  end
  -- More headers (bench/gateway.py's token), one "Name: value" a line, from a file: never argv.
  if args[4] ~= nil and args[4] ~= "" then
    local extra = io.open(args[4], "rb")
    for line in extra:lines() do
      local name, value = line:match("^([^:]+):%s*(.-)%s*$")
      if name then headers[name] = value end
    end
    extra:close()
  end
  request_bytes = wrk.format("POST", nil, headers, body)
end

function request()
  return request_bytes
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH_RESULT requests=%d duration_us=%d p50_us=%d p99_us=%d " ..
    "connect=%d read=%d write=%d status=%d timeout=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""

KSERVE_SERVER = r'''
"""A thin KServe model around an onnxruntime session (bench/serving.py)."""
import sys

import onnxruntime as ort
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer


class OnnxModel(Model):
    def __init__(self, name: str, path: str) -> None:
        super().__init__(name)
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.ready = True

    def predict(self, payload: InferRequest, headers=None) -> InferResponse:
        x = payload.inputs[0].as_numpy()
        (y,) = self.session.run(["y"], {"x": x})
        output = InferOutput(name="y", shape=list(y.shape), datatype="FP32")
        output.set_data_from_numpy(y, binary_data=False)
        return InferResponse(
            response_id=payload.id or "", model_name=self.name, infer_outputs=[output]
        )


if __name__ == "__main__":
    path, http_port, grpc_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # One worker, as ModelForge's; its per-request latency log off, to spare it that work.
    server = ModelServer(
        http_port=http_port, grpc_port=grpc_port, workers=1, enable_latency_logging=False
    )
    server.start([OnnxModel("mlp", path)])
'''


@dataclass
class Result:
    server: str
    scenario: str
    connections: int
    client: str
    requests: int
    failed: int
    rps: float
    p50_ms: float
    p99_ms: float
    server_cpu_us: float  # per request
    client_cpu: float  # share of one core

    def row(self) -> str:
        return (
            f"{self.server:<10} {self.scenario:<22} {self.connections:>5} {self.client:<7} "
            f"{self.rps:>9,.0f} {self.p50_ms:>8.3f} {self.p99_ms:>8.3f} "
            f"{self.server_cpu_us:>9.0f} {self.client_cpu:>7.2f} {self.failed:>6}"
        )


HEADER = (
    f"{'server':<10} {'scenario':<22} {'conns':>5} {'client':<7} {'req/s':>9} {'p50 ms':>8} "
    f"{'p99 ms':>8} {'cpu us/r':>9} {'gen cpu':>7} {'failed':>6}"
)


# -- models and bodies ------------------------------------------------------------------------


def write_models(scratch: Path, big: tuple[int, ...]) -> tuple[Path, Path]:
    from tests.onnx_models import mlp

    small_path, big_path = scratch / "small.onnx", scratch / "big.onnx"
    small_path.write_bytes(mlp(SMALL, seed=1))
    big_path.write_bytes(mlp(big, seed=2))
    return small_path, big_path


@dataclass(frozen=True)
class Body:
    path: Path
    content_type: str
    header_length: str  # "" for a JSON body


def bodies(scratch: Path, width: int, rows: int, tag: str) -> dict[str, Body]:
    import numpy as np

    x = np.random.default_rng(7).standard_normal((rows, width)).astype(np.float32)
    tensor = {"name": "x", "shape": [rows, width], "datatype": "FP32"}
    as_json = json.dumps({"inputs": [tensor | {"data": x.reshape(-1).tolist()}]}).encode()
    header = json.dumps(
        {
            "inputs": [tensor | {"parameters": {"binary_data_size": x.nbytes}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    found = {}
    for kind, content, content_type, length in (
        ("json", as_json, "application/json", ""),
        ("binary", header + x.tobytes(), "application/octet-stream", str(len(header))),
    ):
        path = scratch / f"{tag}-{kind}.body"
        path.write_bytes(content)
        found[kind] = Body(path, content_type, length)
    return found


def grpc_body(scratch: Path, width: int, rows: int) -> Path:
    import numpy as np

    from runtime_worker.serving._proto import grpc_predict_v2_pb2 as pb

    x = np.random.default_rng(7).standard_normal((rows, width)).astype(np.float32)
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="x", datatype="FP32", shape=[rows, width])
    request.raw_input_contents.append(x.tobytes())
    path = scratch / "grpc.body"
    path.write_bytes(request.SerializeToString())
    return path


def floor_us(path: Path, runs: int) -> float:
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.ones((1, SMALL[0]), dtype=np.float32)
    for _ in range(200):
        session.run(["y"], {"x": x})
    times = []
    for _ in range(runs):
        started = time.perf_counter_ns()
        session.run(["y"], {"x": x})
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times) / 1000


# -- servers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """A model server process (and whatever it starts) and its CPU time."""

    def __init__(self, name: str, command: list[str], port: int, log: Path, **kw: Any) -> None:
        self.name, self.port, self.log = name, port, log
        with log.open("wb") as handle:
            self.process = subprocess.Popen(
                command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True, **kw
            )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.port}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as answer:  # noqa: S310 - loopback
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(
            f"{self.name} not ready in {timeout:.0f} s:\n{self.log.read_text()[-3000:]}"
        )

    def _group(self) -> list[list[str]]:
        """/proc/PID/stat of each process of its process group (Granian's and uvicorn's
        workers too), the fields after the command's name."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.process.pid:  # its process group
                found.append(fields)
        return found

    def cpu_seconds(self) -> float:
        """User and system CPU of the process group."""
        ticks = os.sysconf("SC_CLK_TCK")
        return sum(int(fields[11]) + int(fields[12]) for fields in self._group()) / ticks

    def rss_bytes(self) -> int:
        """Resident memory of the process group."""
        page = os.sysconf("SC_PAGE_SIZE")
        return sum(int(fields[21]) for fields in self._group()) * page

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def modelforge(
    scratch: Path,
    model: Path,
    *extra: str,
    name: str = "modelforge",
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> tuple[Server, int]:
    """ModelForge's model server serving `model` (run by `python`, in `env`), ready, and its
    gRPC port."""
    port, grpc_port = free_port(), free_port()
    command = [
        python, "-m", "runtime_worker.onnx_server", "--model", str(model),
        "--port", str(port), "--grpc-port", str(grpc_port), "--name", MODEL,
        "--host", "127.0.0.1", *extra,
    ]  # fmt: skip
    log = scratch / f"{name}-{port}.log"
    server = Server(name, command, port, log, cwd=REPO, env=env)
    server.wait_ready()
    return server, grpc_port


def ensure_venv(
    venv: Path, imports: str, packages: list[str], *, prepare: Callable[[Path], None] | None = None
) -> Path:
    """The python of `venv`, created with `packages` unless it can already import `imports`
    (comma-separated); `prepare(python)` runs between the venv's creation and the install."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", f"import {imports}"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating {venv} with {' '.join(packages)} (once) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if prepare is not None:
        prepare(python)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True)
    return python


def ensure_kserve(venv: Path) -> Path:
    # The same onnxruntime and numpy as the project's worker, so only the server differs.
    packages = [f"kserve=={KSERVE_VERSION}", "onnxruntime==1.32.0", "numpy==2.4.6"]
    return ensure_venv(venv, "kserve, onnxruntime", packages)


def kserve(scratch: Path, model: Path, python: Path) -> Server:
    script = scratch / "kserve_model.py"
    script.write_text(KSERVE_SERVER)
    port = free_port()
    command = [str(python), str(script), str(model), str(port), str(free_port())]
    server = Server("kserve", command, port, scratch / "kserve.log", cwd=scratch)
    server.wait_ready()
    return server


# -- load generators --------------------------------------------------------------------------


class Measured(Protocol):
    """What a load run measures the CPU of: a `Server`, or bench/gateway.py's whole stack."""

    name: str

    @property
    def port(self) -> int: ...

    def cpu_seconds(self) -> float: ...


def wrk_load(
    server: Measured,
    body: Body,
    connections: int,
    duration: int,
    scenario: str,
    scratch: Path,
    *,
    url: str | None = None,
    headers: Path | None = None,
) -> Result:
    """`wrk` against `url` (default: the server's own infer path) with `body`; `headers`: a file
    of more request headers, one `Name: value` a line."""
    script = scratch / "infer.lua"
    script.write_text(WRK_SCRIPT)
    threads = min(connections, 2)
    url = url or f"http://127.0.0.1:{server.port}/v2/models/{MODEL}/infer"
    command = [
        "wrk", "-t", str(threads), "-c", str(connections), "-d", f"{duration}s",
        "--timeout", "10s", "-s", str(script), url,
        "--", str(body.path), body.content_type, body.header_length, str(headers or ""),
    ]  # fmt: skip
    before_cpu, before_client = server.cpu_seconds(), _children_cpu()
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    server_cpu, client_cpu = server.cpu_seconds() - before_cpu, _children_cpu() - before_client
    match = re.search(r"^BENCH_RESULT (.*)$", out.stdout, re.MULTILINE)
    if out.returncode != 0 or match is None:
        raise SystemExit(f"wrk failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    fields = {k: int(v) for k, v in (item.split("=") for item in match.group(1).split())}
    failed = sum(fields[k] for k in ("connect", "read", "write", "status", "timeout"))
    seconds = fields["duration_us"] / 1e6
    requests = fields["requests"]
    return Result(
        server=server.name,
        scenario=scenario,
        connections=connections,
        client="wrk",
        requests=requests,
        failed=failed,
        rps=(requests - fields["status"]) / seconds,
        p50_ms=fields["p50_us"] / 1000,
        p99_ms=fields["p99_us"] / 1000,
        server_cpu_us=server_cpu / max(requests, 1) * 1e6,
        client_cpu=client_cpu / seconds,
    )


def h2load_load(
    server: Server,
    *,
    url: str,
    body: Path,
    headers: list[str],
    connections: int,
    duration: int,
    scenario: str,
    scratch: Path,
) -> Result:
    """nghttp2's h2load, a C client that speaks HTTP/1.1 and HTTP/2 alike: HTTP/2 (gRPC, a
    framed message) for a gRPC method's URL, else HTTP/1.1."""
    log = scratch / "h2load.log"
    log.unlink(missing_ok=True)  # h2load appends
    protocol = [] if GRPC_SERVICE in url else ["--h1"]
    command = [
        "h2load", *protocol, "-D", str(duration), "-c", str(connections), "-m", "1", "-t", "1",
        "-d", str(body), *(item for header in headers for item in ("-H", header)),
        f"--log-file={log}", url,
    ]  # fmt: skip
    before_cpu, before_client = server.cpu_seconds(), _children_cpu()
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    server_cpu, client_cpu = server.cpu_seconds() - before_cpu, _children_cpu() - before_client
    finished = re.search(r"finished in ([\d.]+)s", out.stdout)
    if out.returncode != 0 or finished is None:
        raise SystemExit(f"h2load failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    seconds = float(finished.group(1))
    rows = [line.split("\t") for line in log.read_text().splitlines() if line]
    latencies = sorted(int(row[2]) for row in rows)
    failed = sum(1 for row in rows if not row[1].startswith("2"))
    return Result(
        server=server.name,
        scenario=scenario,
        connections=connections,
        client="h2load",
        requests=len(rows),
        failed=failed,
        rps=(len(rows) - failed) / seconds,
        p50_ms=latencies[len(latencies) // 2] / 1000 if latencies else 0.0,
        p99_ms=latencies[int(len(latencies) * 0.99)] / 1000 if latencies else 0.0,
        server_cpu_us=server_cpu / max(len(rows), 1) * 1e6,
        client_cpu=client_cpu / seconds,
    )


def check_grpc(port: int, body: Path) -> None:
    """h2load sees only HTTP statuses: a gRPC error is a 200 too, so one call is checked first."""
    import grpc

    from runtime_worker.serving._proto import grpc_predict_v2_pb2 as pb

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        infer = channel.unary_unary(f"/{GRPC_SERVICE}/ModelInfer")
        answer = pb.ModelInferResponse.FromString(infer(body.read_bytes(), timeout=30))
    if [output.name for output in answer.outputs] != ["y"]:
        raise SystemExit(f"the gRPC front answered {answer}")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- the run ----------------------------------------------------------------------------------


def target(label: str, value: float, goal: str, met: bool) -> str:
    return f"  {'MET    ' if met else 'MISSED '} {label}: {value:.2f} ({goal})"


def run(args: argparse.Namespace) -> int:
    for tool, package in (("wrk", "wrk"), ("h2load", "nghttp2-client")):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is missing: apt-get install {package}")
    big = tuple(int(size) for size in args.big.split(","))
    scratch = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    results: list[Result] = []
    try:
        small_path, big_path = write_models(scratch, big)
        small = bodies(scratch, SMALL[0], 1, "small")
        large = bodies(scratch, big[0], 1, "big")
        grpc_request = grpc_body(scratch, SMALL[0], 1)
        floor = floor_us(small_path, args.floor_runs)
        print(f"floor: bare onnxruntime, small model, batch 1: {floor:.1f} us per run\n")
        print(HEADER, flush=True)

        rounds_each = args.rounds

        def show(load: Callable[..., Result], *args: Any, **kwargs: Any) -> Result:
            """Run `load` `--rounds` times; print and keep the round of median requests/s."""
            rounds = sorted(
                (load(*args, **kwargs) for _ in range(rounds_each)), key=lambda r: r.rps
            )
            result = rounds[len(rounds) // 2]
            print(result.row(), flush=True)
            results.append(result)
            return result

        duration = args.duration
        server, grpc_port = modelforge(scratch, small_path)
        try:
            mf: dict[str, Result] = {}
            for kind in ("json", "binary"):
                for connections in (1, 8):
                    mf[f"{kind}{connections}"] = show(
                        wrk_load,
                        server,
                        small[kind],
                        connections,
                        duration,
                        f"small http {kind}",
                        scratch,
                    )
            binary = small["binary"]
            headers = [
                f"content-type: {binary.content_type}",
                f"inference-header-content-length: {binary.header_length}",
            ]
            check_grpc(grpc_port, grpc_request)
            framed = scratch / "grpc.framed"
            message = grpc_request.read_bytes()
            framed.write_bytes(b"\0" + len(message).to_bytes(4, "big") + message)
            empty = scratch / "empty.framed"  # an empty message: ServerLive's request
            empty.write_bytes(b"\0\0\0\0\0")
            grpc_headers = ["content-type: application/grpc", "te: trailers"]
            for connections in (1, 8):
                mf[f"h2-http{connections}"] = show(
                    h2load_load,
                    server,
                    url=f"http://127.0.0.1:{server.port}/v2/models/{MODEL}/infer",
                    body=binary.path,
                    headers=headers,
                    connections=connections,
                    duration=duration,
                    scenario="small http binary",
                    scratch=scratch,
                )
                mf[f"h2-grpc{connections}"] = show(
                    h2load_load,
                    server,
                    url=f"http://127.0.0.1:{grpc_port}/{GRPC_SERVICE}/ModelInfer",
                    body=framed,
                    headers=grpc_headers,
                    connections=connections,
                    duration=duration,
                    scenario="small grpc raw",
                    scratch=scratch,
                )
            # gRPC's own cost per call, without the model or the front: the trivial RPC.
            show(
                h2load_load,
                server,
                url=f"http://127.0.0.1:{grpc_port}/{GRPC_SERVICE}/ServerLive",
                body=empty,
                headers=grpc_headers,
                connections=1,
                duration=duration,
                scenario="grpc ServerLive",
                scratch=scratch,
            )
        finally:
            server.stop()

        ks: dict[str, Result] = {}
        if not args.no_kserve:
            python = ensure_kserve(Path(args.kserve_venv))
            server = kserve(scratch, small_path, python)
            try:
                for kind, connections in (("json", 1), ("json", 8), ("binary", 8)):
                    ks[f"{kind}{connections}"] = show(
                        wrk_load,
                        server,
                        small[kind],
                        connections,
                        duration,
                        f"small http {kind}",
                        scratch,
                    )
            finally:
                server.stop()

        batched: dict[str, Result] = {}
        for label, extra in (
            ("off", ()),
            ("on", ("--batching", json.dumps({"max_batch_size": 32}))),
        ):
            server, _ = modelforge(scratch, big_path, *extra)
            try:
                batched[label] = show(
                    wrk_load,
                    server,
                    large["binary"],
                    32,
                    duration,
                    f"big binary batching {label}",
                    scratch,
                )
            finally:
                server.stop()

        print("\ntargets (issue 26):")
        if ks:
            ratio = mf["json8"].rps / ks["json8"].rps
            print(target("8 conns JSON, ModelForge / KServe req/s", ratio, ">= 3", ratio >= 3))
        p50 = mf["binary1"].p50_ms
        print(target("1 conn binary p50 ms", p50, "<= 0.5", p50 <= 0.5))
        p50 = mf["json1"].p50_ms
        print(target("1 conn JSON p50 ms", p50, "<= 0.5", p50 <= 0.5))
        ratio = batched["on"].rps / batched["off"].rps
        print(target("32 conns batching on / off req/s", ratio, ">= 3", ratio >= 3))
        for connections in (8, 1):
            ratio = mf[f"h2-grpc{connections}"].p50_ms / mf[f"h2-http{connections}"].p50_ms
            label = f"{connections} conns gRPC / HTTP binary p50 (same client)"
            print(target(label, ratio, "<= 1.5", ratio <= 1.5))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if any(result.failed for result in results) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per run (default 5)")
    parser.add_argument(
        "--kserve-venv",
        default=str(Path(tempfile.gettempdir()) / "kserve-venv"),
        help="KServe's own virtual environment, created when missing",
    )
    parser.add_argument("--no-kserve", action="store_true", help="skip KServe's runs")
    parser.add_argument("--big", default="1024,2048,2048,1024", help="the batching model's sizes")
    parser.add_argument("--floor-runs", type=int, default=20000)
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of each load; the median's figures are shown"
    )
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
