"""gRPC stacks under the model server (issue 26's last target): its native gRPC front as shipped
against what grpcio itself costs per call, in one run.

What is measured
----------------
The small model of bench/serving.py, served two ways, each loaded by nghttp2's ``h2load``
(HTTP/2 for gRPC, HTTP/1.1 for HTTP) in its own process, at 1 and 8 connections, ``--rounds``
times alternating:

1. ``python -m runtime_worker.onnx_server`` as shipped: HTTP binary tensors (the baseline every
   ratio is against) and gRPC ``ModelInfer`` on its native front (``native/grpc_front``, the
   server's only gRPC front).
2. A bare sync ``grpc.server`` (grpcio, 4 threads) whose handler only parses the message, runs
   onnxruntime and encodes the answer: no data plane, no checks. It shows grpcio's own floor,
   what any front on grpcio would cost at least.

Then one ``ModelInfer`` of ``--big-message-mib`` MiB against the servers' 4 MiB limit
(``--max-request-bytes``), with the server's RSS growth: whether the front refuses an oversized
message before holding it. Each row: calls/s, p50 and p99, the ratio of its p50 to the model
server's HTTP p50 in the same round, and the server's CPU per call.

(Until stop 42 the model server also had a ``grpc.aio`` front, measured here with pygrpc-native
under it; both are gone, and docs/performance.md keeps their figures.)

Run::

    python bench/grpc_stacks.py                 # about a minute
    python bench/grpc_stacks.py --rounds 1 --duration 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serving import (  # noqa: E402 (the repository on the path first)
    GRPC_SERVICE,
    MODEL,
    REPO,
    SMALL,
    Result,
    Server,
    bodies,
    check_grpc,
    free_port,
    grpc_body,
    h2load_load,
    modelforge,
    write_models,
)

#: The model servers' largest message (--max-request-bytes).
LIMIT_MIB = 4

#: The bare sync grpcio server: parse, run, encode.
SYNC_SERVER = """
import sys
from concurrent import futures

import grpc
import numpy as np
import onnxruntime as ort

from runtime_worker.serving._proto import grpc_predict_v2_pb2 as pb

path, port = sys.argv[1], int(sys.argv[2])
options = ort.SessionOptions()
options.intra_op_num_threads = 1
options.add_session_config_entry("session.intra_op.allow_spinning", "0")
session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def infer(message, context):
    request = pb.ModelInferRequest.FromString(message)
    shape = tuple(request.inputs[0].shape)
    x = np.frombuffer(request.raw_input_contents[0], dtype=np.float32).reshape(shape)
    (y,) = session.run(["y"], {"x": x})
    response = pb.ModelInferResponse(model_name=request.model_name, model_version="1")
    response.outputs.add(name="y", datatype="FP32", shape=list(y.shape))
    response.raw_output_contents.append(y.tobytes())
    return response.SerializeToString()


server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
server.add_registered_method_handlers(
    "inference.GRPCInferenceService", {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)}
)
server.add_insecure_port(f"127.0.0.1:{port}")
server.start()
server.wait_for_termination()
"""


def big_message(server: Server, grpc_port: int, mib: int) -> str:
    """One ModelInfer of `mib` MiB against the `LIMIT_MIB` limit: the answer and the RSS
    growth of the server's processes."""
    import grpc

    baseline, peak, done = server.rss_bytes(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], server.rss_bytes())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options) as channel:
        infer = channel.unary_unary(f"/{GRPC_SERVICE}/ModelInfer")
        try:
            infer(bytes(mib << 20), timeout=120)
            answer = "answered"
        except grpc.RpcError as exc:
            answer = f"{exc.code().name}: {(exc.details() or '')[:70]}"
    done.set()
    watcher.join()
    return f"{answer}; the server's RSS grew {(peak[0] - baseline) / 2**20:,.0f} MiB"


def run(args: argparse.Namespace) -> int:
    if shutil.which("h2load") is None:
        raise SystemExit("h2load is missing: apt-get install nghttp2-client")
    scratch = Path(tempfile.mkdtemp(prefix="bench-grpc-stacks-"))
    servers: list[Server] = []
    failed = 0
    try:
        small_path, _ = write_models(scratch, (8, 8))
        binary = bodies(scratch, SMALL[0], 1, "small")["binary"]
        request = grpc_body(scratch, SMALL[0], 1)
        message = request.read_bytes()
        framed = scratch / "grpc.framed"
        framed.write_bytes(b"\0" + len(message).to_bytes(4, "big") + message)
        (scratch / "sync_server.py").write_text(SYNC_SERVER)

        limit = ("--max-request-bytes", str(LIMIT_MIB << 20))
        shipped, shipped_grpc = modelforge(scratch, small_path, *limit, name="native front")
        servers.append(shipped)
        sync_port = free_port()
        sync = Server(
            "sync grpcio",
            [sys.executable, str(scratch / "sync_server.py"), str(small_path), str(sync_port)],
            sync_port,
            scratch / "sync.log",
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        servers.append(sync)
        deadline = time.monotonic() + 60
        while True:
            try:
                check_grpc(sync_port, request)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        check_grpc(shipped_grpc, request)

        http_headers = [
            f"content-type: {binary.content_type}",
            f"inference-header-content-length: {binary.header_length}",
        ]
        grpc_headers = ["content-type: application/grpc", "te: trailers"]

        def load(server: Server, url: str, grpc_call: bool, connections: int) -> Result:
            return h2load_load(
                server,
                url=url,
                body=framed if grpc_call else binary.path,
                headers=grpc_headers if grpc_call else http_headers,
                connections=connections,
                duration=args.duration,
                scenario="",
                scratch=scratch,
            )

        grpc_url = "http://127.0.0.1:{}/" + GRPC_SERVICE + "/ModelInfer"
        http_url = "http://127.0.0.1:{}/v2/models/" + MODEL + "/infer"
        print(
            f"{'round':>5} {'conns':>5} {'server':<14} {'calls/s':>9} {'p50 ms':>8} "
            f"{'p99 ms':>8} {'/ HTTP p50':>10} {'cpu us/call':>11}"
        )
        for round_ in range(1, args.rounds + 1):
            for connections in (1, 8):
                http = load(shipped, http_url.format(shipped.port), False, connections)
                rows = [
                    ("HTTP binary", http),
                    (
                        "native front",
                        load(shipped, grpc_url.format(shipped_grpc), True, connections),
                    ),
                    ("sync grpcio", load(sync, grpc_url.format(sync_port), True, connections)),
                ]
                for name, result in rows:
                    failed += result.failed
                    print(
                        f"{round_:>5} {connections:>5} {name:<14} {result.rps:>9,.0f} "
                        f"{result.p50_ms:>8.3f} {result.p99_ms:>8.3f} "
                        f"{result.p50_ms / http.p50_ms:>9.2f}x {result.server_cpu_us:>11.0f}",
                        flush=True,
                    )
        mib = args.big_message_mib
        print(f"\na {mib} MiB ModelInfer against the {LIMIT_MIB} MiB limit:")
        print(f"  native front:  {big_message(shipped, shipped_grpc, mib)}")
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=3, help="seconds per run (default 3)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big-message-mib", type=int, default=300)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
