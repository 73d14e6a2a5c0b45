"""The native gRPC front (`modelforge-grpc-front`, native/grpc_front) as the model server runs
it: a real server process, real gRPC clients. What it answers is tested in
test_grpc_service.py; here, what is its own: compressed messages, its limit on calls at once,
its private relay, its life beside the server's, and a missing binary."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import onnxruntime as ort
import psutil
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2

from runtime_worker.serving import grpc_native
from runtime_worker.serving.http import RELAY_PREFIX
from tests.onnx_models import mlp, relu_matmul
from tests.runtime_worker.served import Served, free_port, start_server, stop_server

WEIGHTS = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.0
LIMIT = 1024 * 1024
INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("native") / "relu.onnx"
    path.write_bytes(relu_matmul(WEIGHTS))
    return path


def _serve(
    model_path: Path, *flags: str, env: dict[str, str] | None = None, name: str = "relu"
) -> tuple[Served, int]:
    port = free_port()
    flags = ("--grpc-port", str(port), "--max-request-bytes", str(LIMIT), *flags)
    return start_server(model_path, *flags, env=env, name=name), port


@pytest.fixture(scope="module")
def served(model_path: Path) -> Iterator[tuple[Served, int]]:
    assert grpc_native.BUILT.exists(), "the native gRPC front is not built: make install"
    running = _serve(model_path)
    yield running
    stop_server(running[0])


def _fronts(served: Served) -> list[psutil.Process]:
    main = psutil.Process(served.process.pid)
    return [p for p in main.children(recursive=True) if p.name() == "modelforge-grpc-front"]


def _request(x: np.ndarray) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="relu", id="z")
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


def _slow_model(folder: Path) -> Path:
    """A model whose run takes tens of milliseconds here (`_slow_request`'s 192 rows)."""
    path = folder / "slow.onnx"
    path.write_bytes(mlp((1024, 2048, 2048, 1024)))
    return path


def _slow_request() -> bytes:
    request = service_pb2.ModelInferRequest(model_name="slow")
    request.inputs.add(name="x", datatype="FP32", shape=[192, 1024])  # 768 KiB, under LIMIT
    request.raw_input_contents.append(np.ones((192, 1024), dtype=np.float32).tobytes())
    return request.SerializeToString()


def _expected(x: np.ndarray, path: Path) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["y"], {"x": x})[0])


def test_the_front_is_a_process_of_the_server_and_its_token_travels_on_no_command_line(
    served: tuple[Served, int],
) -> None:
    server, _ = served
    (front,) = _fronts(server)
    arguments, environment = " ".join(front.cmdline()), front.environ()
    assert "--listen" in arguments and "--backend" in arguments
    # The relay answers only its front: without the token, or with another, there is no route
    # (and a token is nowhere to be read from the front's arguments or environment).
    for headers in ({}, {grpc_native.TOKEN_HEADER: "0" * 32}):
        answer = httpx.post(
            f"{server.url}{RELAY_PREFIX}ServerLive", headers=headers, content=b"", timeout=10
        )
        assert answer.status_code == 404 and "no route" in answer.json()["error"]
    assert not any(
        grpc_native.TOKEN_HEADER in value or "token" in name.lower()
        for name, value in environment.items()
    )
    assert "token" not in arguments


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_messages_are_inflated_and_answered(
    served: tuple[Served, int], model_path: Path, algorithm: str
) -> None:
    _, port = served
    x = np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)
    client = triton.InferenceServerClient(url=f"127.0.0.1:{port}")
    try:
        inputs = [triton.InferInput("x", list(x.shape), "FP32")]
        inputs[0].set_data_from_numpy(x)
        result = client.infer("relu", inputs, compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("y"), _expected(x, model_path))
    finally:
        client.close()


def test_a_compressed_message_inflating_past_the_limit_is_resource_exhausted(
    served: tuple[Served, int],
) -> None:
    # 4 MiB of zeros compress to a few KiB: under the 1 MiB limit on the wire, over it inflated.
    _, port = served
    request = _request(np.zeros((LIMIT // 3, 3), dtype=np.float32)).SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        infer = channel.unary_unary(INFER)
        for compression in (grpc.Compression.Gzip, grpc.Compression.Deflate):
            with pytest.raises(grpc.RpcError) as caught:
                infer(request, timeout=30, compression=compression)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "inflates to more than" in (caught.value.details() or "")
        # The same message under the limit, compressed, is answered.
        small = _request(np.zeros((2, 3), dtype=np.float32)).SerializeToString()
        reply = infer(small, timeout=30, compression=grpc.Compression.Gzip)
        assert service_pb2.ModelInferResponse.FromString(reply).outputs[0].shape == [2, 4]


def test_calls_past_the_limit_at_once_are_resource_exhausted_at_once(model_path: Path) -> None:
    # 16 MiB of budget for 1 MiB messages: 16 calls at once (grpc_service.max_calls). Sixteen
    # calls relayed to a model server that does not answer yet (stopped) hold them; a
    # seventeenth, on another connection, is refused at once; once the server goes on, all are
    # answered. (Calls still sending their messages hold no place: test_grpc_floods.py.)
    server, port = _serve(model_path, "--max-inflight-bytes", str(16 * LIMIT))
    message = _request(np.ones((1, 3), dtype=np.float32)).SerializeToString()
    (front,) = _fronts(server)
    backend = int(front.cmdline()[front.cmdline().index("--backend") + 1].rpartition(":")[2])
    main = psutil.Process(server.process.pid)
    stopped = [p for p in [main, *main.children(recursive=True)] if p.pid != front.pid]

    def relayed() -> int:
        return sum(1 for c in front.net_connections("tcp") if c.raddr and c.raddr.port == backend)

    answers: list[object] = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as holding:
            infer = holding.unary_unary(INFER)
            for process in stopped:
                process.suspend()
            calls = [infer.future(message, timeout=60) for _ in range(16)]
            deadline = time.monotonic() + 10
            while relayed() < 16:  # each relayed on a connection of its own, unanswered
                assert time.monotonic() < deadline, relayed()
                time.sleep(0.02)
            # A connection of its own (channels to one address otherwise share one).
            own = [("grpc.use_local_subchannel_pool", 1)]
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=own) as other:
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as caught:
                    other.unary_unary(INFER)(message, timeout=30)
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() - started < 1.0
            for process in stopped:
                process.resume()
            answers = [call.result() for call in calls]
        assert len(answers) == 16 and all(answers)
    finally:
        for process in stopped:
            try:
                process.resume()
            except psutil.NoSuchProcess:
                pass
        stop_server(server)


def test_calls_whose_clients_give_up_are_never_run(tmp_path: Path) -> None:
    # One instance, tens of milliseconds a call: of twenty calls sent at once with a 150 ms
    # deadline, most are still queued when their clients give up; the front resets their
    # relayed requests and the model server drops them from the queue instead of running them.
    server, port = _serve(_slow_model(tmp_path), "--instances", "1", name="slow")
    try:
        message = _slow_request()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            infer = channel.unary_unary(INFER)
            calls = [infer.future(message, timeout=0.15) for _ in range(20)]
            codes = [call.exception() and call.code() for call in calls]
        assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) >= 10, codes
        time.sleep(2)  # what was queued would have run by now
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        executed = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("nv_inference_exec_count{")
        )
        # Those answered, and those that ran in the 150 ms (a few, as each takes tens of ms)
        # or were running when their clients gave up; without the drop, all twenty.
        assert executed <= 20 - codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) + 8, executed
    finally:
        stop_server(server)


def test_the_front_ends_with_the_server_stopped_or_killed(model_path: Path) -> None:
    server, port = _serve(model_path)
    (front,) = _fronts(server)
    returncode, _ = stop_server(server)
    assert returncode == 0
    front.wait(10)  # raises psutil.TimeoutExpired if it outlives the server

    server, port = _serve(model_path)
    (front,) = _fronts(server)
    main = psutil.Process(server.process.pid)
    for process in [*main.children(recursive=True), main]:
        if process.pid != front.pid:
            process.send_signal(signal.SIGKILL)
    stop_server(server)  # collects what it left
    front.wait(10)  # standard input ended with its parent: it stopped by itself
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/inference.GRPCInferenceService/ServerLive")(b"", timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_front_that_dies_ends_the_server_to_be_restarted_whole(model_path: Path) -> None:
    server, _ = _serve(model_path)
    (front,) = _fronts(server)
    front.send_signal(signal.SIGKILL)
    try:
        server.process.wait(15)
    except subprocess.TimeoutExpired:
        pytest.fail("the server went on serving without its gRPC front")
    returncode, stderr = stop_server(server)
    assert returncode != 0
    assert "the native gRPC front exited (status -9)" in stderr


def test_sigterm_to_the_server_and_its_front_lets_running_calls_finish(tmp_path: Path) -> None:
    # As a service is stopped: SIGTERM to every process of the server at once. Calls already
    # relayed (five queued on one instance, tens of milliseconds each) are answered.
    server, port = _serve(_slow_model(tmp_path), "--instances", "1", name="slow")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            infer = channel.unary_unary(INFER)
            calls = [infer.future(_slow_request(), timeout=30) for _ in range(5)]
            time.sleep(0.05)  # relayed, and queued
            main = psutil.Process(server.process.pid)
            for process in [main, *main.children(recursive=True)]:
                process.send_signal(signal.SIGTERM)
            replies = [service_pb2.ModelInferResponse.FromString(c.result()) for c in calls]
        assert [reply.outputs[0].shape for reply in replies] == [[192, 1024]] * 5
        assert server.process.wait(30) == 0
    finally:
        stop_server(server)


def test_a_missing_front_is_refused_naming_the_fix(tmp_path: Path) -> None:
    # The only gRPC front: without its binary the server does not serve gRPC some other way.
    with pytest.raises(grpc_native.FrontMissing, match="run make install") as caught:
        grpc_native.start(
            "127.0.0.1",
            0,
            free_port(),
            max_message_bytes=LIMIT,
            max_calls=16,
            grace_seconds=1,
            token="t" * 32,
            executable=tmp_path / "modelforge-grpc-front",
        )
    assert str(tmp_path) in str(caught.value)


def test_a_taken_grpc_port_ends_the_server_with_the_reason(model_path: Path) -> None:
    server, port = _serve(model_path)
    try:
        returncode, stderr = _exit_of_a_second_server(model_path, port)
        assert returncode != 0
        assert f"cannot serve gRPC on port {port}" in stderr
        assert "Address already in use" in stderr  # the front's own reason
    finally:
        stop_server(server)


def _exit_of_a_second_server(model_path: Path, grpc_port: int) -> tuple[int, str]:
    command = [sys.executable, "-m", "runtime_worker.onnx_server", "--model", str(model_path)]
    command += ["--port", str(free_port()), "--grpc-port", str(grpc_port), "--name", "relu"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return result.returncode, result.stderr
