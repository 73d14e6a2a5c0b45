"""The model server's core, against the real server process: kept-alive connections without a
stall, dynamic batching (each request gets exactly its own rows, a full queue answers 503 at
once, the queue delay bounds the wait), instances, readiness only after the warm-up, and
Triton's metric names."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from prometheus_client.parser import text_string_to_metric_families

from runtime_worker.serving.model import InstancePlan
from tests.onnx_models import relu_matmul
from tests.runtime_worker.served import NAME, Served, start_server, stop_server

WEIGHTS = np.array([[1.0, -2.0], [0.5, 1.0], [-1.0, 3.0]], dtype=np.float32)
TRITON_METRICS = [
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serving") / "relu.onnx"
    path.write_bytes(relu_matmul(WEIGHTS))
    return path


@pytest.fixture(scope="module")
def reference(model_file: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])


def rows_of(request: int, rows: int) -> np.ndarray:
    """Rows no other request has: the request's number is in every value."""
    values = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    return values + 1000.0 * request


def infer_body(x: np.ndarray) -> bytes:
    tensor = {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
    return json.dumps({"inputs": [tensor]}).encode()


def post(
    connection: http.client.HTTPConnection, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    connection.request(
        "POST",
        f"/v2/models/{NAME}/infer",
        body=body,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def output(answer: dict[str, Any]) -> np.ndarray:
    (y,) = answer["outputs"]
    return np.array(y["data"], dtype=np.float32).reshape(y["shape"])


def metrics(served: Served) -> dict[str, float]:
    """The model's sample of each metric family at /metrics."""
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    assert response.status == 200
    assert response.getheader("content-type", "").startswith("text/plain")
    text = response.read().decode()
    connection.close()
    found = {}
    for family in text_string_to_metric_families(text):  # well-formed Prometheus text
        for sample in family.samples:
            if sample.labels == {"model": NAME, "version": "1"}:
                # Triton's names exactly (the parser would add _total to a counter's sample).
                assert f'\n{family.name}{{model="{NAME}",version="1"}} ' in text
                found[family.name] = sample.value
    return found


@pytest.fixture(scope="module")
def served(model_file: Path) -> Iterator[Served]:
    running = start_server(model_file)
    yield running
    stop_server(running)


def test_100_sequential_requests_on_one_kept_alive_connection_take_under_a_second(
    served: Served, reference: ort.InferenceSession
) -> None:
    x = rows_of(1, 1)
    body, want = infer_body(x), reference.run(["y"], {"x": x})[0]
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    post(connection, body)  # connected, and the first request's costs paid
    sock = connection.sock
    started = time.perf_counter()
    for _ in range(100):
        status, answer = post(connection, body)
        assert status == 200
    elapsed = time.perf_counter() - started
    assert connection.sock is sock  # the same connection throughout: kept alive
    connection.close()
    np.testing.assert_allclose(output(answer), want, rtol=1e-6)
    # The old server stalled ~44 ms on every request of a kept-alive connection (4.4 s here).
    assert elapsed < 1.0, f"100 requests took {elapsed:.2f} s"


def test_metrics_carry_tritons_names_per_model_and_version(model_file: Path) -> None:
    running = start_server(model_file)
    try:
        connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=10)
        for request in range(3):
            assert post(connection, infer_body(rows_of(request, 2)))[0] == 200
        bad = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4}]}
        assert post(connection, json.dumps(bad).encode())[0] == 400
        connection.close()
        found = metrics(running)
    finally:
        stop_server(running)
    assert set(TRITON_METRICS) <= set(found), sorted(found)
    assert found["nv_inference_request_success"] == 3
    assert found["nv_inference_request_failure"] == 1
    assert found["nv_inference_count"] == 6  # rows
    assert found["nv_inference_exec_count"] == 3
    stages = [
        "nv_inference_queue_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
    ]
    assert found["nv_inference_compute_infer_duration_us"] > 0
    assert found["nv_inference_request_duration_us"] >= sum(found[stage] for stage in stages)


def _concurrently(served: Served, bodies: list[bytes]) -> list[tuple[int, Any, float]]:
    """Each body posted on its own connection, all at once; (status, answer, seconds)."""

    def one(body: bytes) -> tuple[int, Any, float]:
        connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
        try:
            started = time.perf_counter()
            status, answer = post(connection, body)
            return status, answer, time.perf_counter() - started
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        return list(pool.map(one, bodies))


def test_batching_answers_64_concurrent_requests_of_different_sizes_with_their_own_rows(
    model_file: Path, reference: ort.InferenceSession
) -> None:
    batching = {"max_batch_size": 32, "max_queue_delay_microseconds": 20_000}
    running = start_server(model_file, "--batching", json.dumps(batching), "--instances", "2")
    try:
        inputs = [rows_of(request, 1 + request % 5) for request in range(64)]
        answers = _concurrently(running, [infer_body(x) for x in inputs])
        found = metrics(running)
    finally:
        stop_server(running)
    for x, (status, answer, _) in zip(inputs, answers, strict=True):
        assert status == 200, answer
        np.testing.assert_array_equal(output(answer), reference.run(["y"], {"x": x})[0])
    assert found["nv_inference_request_success"] == 64
    assert found["nv_inference_count"] == sum(len(x) for x in inputs)
    # Merged: fewer executions than requests (64 arrive within the 20 ms the first waits).
    assert found["nv_inference_exec_count"] < 64


def test_a_full_queue_answers_503_at_once_and_the_queue_delay_bounds_the_wait(
    model_file: Path, reference: ort.InferenceSession
) -> None:
    # Requests wait up to 3 s for a batch of 64 rows that never fills: two fill the queue.
    delay = 3.0
    batching = {
        "max_batch_size": 64,
        "max_queue_delay_microseconds": int(delay * 1e6),
        "max_queue_size": 2,
    }
    running = start_server(model_file, "--batching", json.dumps(batching))
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            waiting = [
                pool.submit(_concurrently, running, [infer_body(rows_of(r, 1))]) for r in (1, 2)
            ]
            deadline = time.monotonic() + 30
            while metrics(running)["nv_inference_pending_request_count"] < 2:
                assert time.monotonic() < deadline, "the two requests never queued"
                time.sleep(0.01)
            connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=30)
            started = time.perf_counter()
            status, answer = post(connection, infer_body(rows_of(3, 1)))
            refused_after = time.perf_counter() - started
            connection.close()
            queued = [future.result()[0] for future in waiting]
    finally:
        stop_server(running)
    assert status == 503, answer
    assert "max_queue_size" in answer["error"]
    assert refused_after < 1.0, f"refused after {refused_after:.3f} s, not at once"
    for request, (code, result, seconds) in zip((1, 2), queued, strict=True):
        assert code == 200
        want = reference.run(["y"], {"x": rows_of(request, 1)})[0]
        np.testing.assert_array_equal(output(result), want)
        # Measured: they waited for the delay (the batch never filled), and not much longer.
        assert delay * 0.9 <= seconds < delay + 3.0, f"answered after {seconds:.3f} s"


def test_a_batch_that_fills_is_sent_without_waiting_for_the_delay(model_file: Path) -> None:
    batching = {"max_batch_size": 4, "max_queue_delay_microseconds": 30_000_000}
    running = start_server(model_file, "--batching", json.dumps(batching))
    try:
        answers = _concurrently(running, [infer_body(rows_of(1, 4))])
        over = _concurrently(running, [infer_body(rows_of(2, 5))])
    finally:
        stop_server(running)
    status, _, seconds = answers[0]
    assert status == 200 and seconds < 10  # a full batch goes at once, not after 30 s
    assert over[0][0] == 400 and "max_batch_size" in over[0][1]["error"]


def test_instances_each_run_and_share_the_cores(
    model_file: Path, reference: ort.InferenceSession
) -> None:
    running = start_server(model_file, "--instances", "3", "--cpus", "6")
    try:
        inputs = [rows_of(request, 2) for request in range(24)]
        answers = _concurrently(running, [infer_body(x) for x in inputs])
    finally:
        returncode, stderr = stop_server(running)
    assert returncode == 0, stderr
    for x, (status, answer, _) in zip(inputs, answers, strict=True):
        assert status == 200
        np.testing.assert_array_equal(output(answer), reference.run(["y"], {"x": x})[0])
    assert "3 instance(s), 2 intra-op thread(s) each" in stderr
    assert "cold start" in stderr


@pytest.mark.parametrize(
    ("instances", "cpus", "environ", "plan"),
    [
        (None, 8, {"CUDA_VISIBLE_DEVICES": ""}, (1, 0, 8)),  # the CPU: one, with every core
        (4, 8, {"CUDA_VISIBLE_DEVICES": ""}, (4, 0, 2)),  # the cores shared out
        (4, 2, {"CUDA_VISIBLE_DEVICES": ""}, (4, 0, 1)),  # never below one thread
        (None, 8, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, (2, 2, 1)),  # one per GPU held
        (3, 8, {"CUDA_VISIBLE_DEVICES": "GPU-a"}, (3, 1, 1)),
    ],
)
def test_instances_default_to_one_per_gpu_and_share_the_cpu_cores(
    instances: int | None, cpus: int, environ: dict[str, str], plan: tuple[int, int, int]
) -> None:
    available = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    got = InstancePlan.of(instances=instances, cpus=cpus, available=available, environ=environ)
    assert (got.count, got.gpus, got.threads) == plan


def _reshape_to_two_rows() -> bytes:
    """y = reshape(x, [2, 3]) for x of shape [-1, 3]: runs on 2 rows, fails on the warm-up's 1."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "two_rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor("shape", TensorProto.INT64, [2], [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model.SerializeToString()


def test_a_model_that_fails_its_warm_up_is_never_ready(tmp_path: Path) -> None:
    path = tmp_path / "two_rows.onnx"
    path.write_bytes(_reshape_to_two_rows())
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.run(["y"], {"x": np.ones((2, 3), np.float32)})[0].shape == (2, 3)  # loads
    import subprocess
    import sys

    import httpx

    from tests.runtime_worker.served import free_port

    port = free_port()
    command = [sys.executable, "-m", "runtime_worker.onnx_server", "--model", str(path)]
    command += ["--port", str(port), "--name", NAME, "--host", "127.0.0.1"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    ever_ready = False
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1)
                ever_ready |= ready.status_code == 200
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, stderr
    assert not ever_ready
    assert "failed its warm-up" in stderr and str(path) in stderr
    onnx.checker.check_model(onnx.load(str(path)))  # a valid model: only its run failed


def test_a_preferred_batch_size_is_sent_as_soon_as_it_forms(model_file: Path) -> None:
    batching = {
        "max_batch_size": 16,
        "preferred_batch_size": [4],
        "max_queue_delay_microseconds": 30_000_000,
    }
    running = start_server(model_file, "--batching", json.dumps(batching))
    try:
        answers = _concurrently(running, [infer_body(rows_of(request, 2)) for request in range(2)])
        found = metrics(running)
    finally:
        stop_server(running)
    assert [status for status, _, _ in answers] == [200, 200]
    assert max(seconds for _, _, seconds in answers) < 10  # 4 rows formed: not after 30 s
    assert found["nv_inference_exec_count"] == 1  # one batch of both


def _fixed_batch_model() -> bytes:
    """y = x @ w with x of fixed shape [2, 3]: its first dimension is not dynamic."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor("w", TensorProto.FLOAT, [3, 2], WEIGHTS.ravel().tolist())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model.SerializeToString()


def test_batching_stays_off_unless_the_first_dimension_is_dynamic(tmp_path: Path) -> None:
    path = tmp_path / "fixed.onnx"
    path.write_bytes(_fixed_batch_model())
    batching = {"max_batch_size": 8, "max_queue_delay_microseconds": 200_000}
    running = start_server(path, "--batching", json.dumps(batching))
    try:
        inputs = [rows_of(request, 2) for request in range(6)]
        answers = _concurrently(running, [infer_body(x) for x in inputs])
        found = metrics(running)
    finally:
        returncode, stderr = stop_server(running)
    for x, (status, answer, _) in zip(inputs, answers, strict=True):
        assert status == 200
        np.testing.assert_allclose(output(answer), x @ WEIGHTS, rtol=1e-6)
    assert found["nv_inference_exec_count"] == 6  # each alone: never merged into [12, 3]
    assert "batching off" in stderr and "batching stays off" in stderr


def test_a_0_row_request_with_batching_on_is_answered_beside_others(
    model_file: Path, reference: ort.InferenceSession
) -> None:
    batching = {"max_batch_size": 8}  # no delay: a request alone runs at once, inline
    running = start_server(model_file, "--batching", json.dumps(batching))
    try:
        connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=30)
        alone = post(connection, infer_body(np.zeros((0, 3), np.float32)))
        connection.close()
        inputs = [rows_of(request, request % 3) for request in range(24)]  # a third 0 rows
        answers = _concurrently(running, [infer_body(x) for x in inputs])
        after = _concurrently(running, [infer_body(rows_of(99, 2))])
    finally:
        stop_server(running)
    assert alone[0] == 200, alone[1]
    assert alone[1]["outputs"][0]["shape"] == [0, 2]  # as onnxruntime answers it
    for x, (status, answer, _) in zip(inputs, answers, strict=True):
        assert status == 200, answer
        np.testing.assert_array_equal(output(answer), reference.run(["y"], {"x": x})[0])
    assert after[0][0] == 200  # the scheduler still serves


def test_a_failed_request_counts_as_a_failure_not_in_the_durations(served: Served) -> None:
    durations = [
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
    ]
    before = metrics(served)
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    wrong = {"inputs": [{"name": "x", "shape": [2000, 4], "datatype": "FP32", "data": [1] * 8000}]}
    assert post(connection, json.dumps(wrong).encode())[0] == 400  # refused decoding it
    connection.close()
    after = metrics(served)
    assert after["nv_inference_request_failure"] == before["nv_inference_request_failure"] + 1
    assert {name: after[name] for name in durations} == {name: before[name] for name in durations}


def _any_shape_relu() -> bytes:
    """y = relu(x) for x of any [rows, columns]: both dimensions dynamic."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "any_shape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model.SerializeToString()


def test_a_shape_with_a_0_and_a_huge_size_is_400(tmp_path: Path) -> None:
    path = tmp_path / "any_shape.onnx"
    path.write_bytes(_any_shape_relu())
    running = start_server(path)
    try:
        connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=30)
        answers = []
        for shape in ([0, 2**62], [2**40, 0], [0, 2**31]):
            for tensor in ({"data": []}, {"parameters": {"binary_data_size": 0}}):
                body = {"inputs": [{"name": "x", "shape": shape, "datatype": "FP32", **tensor}]}
                header = json.dumps(body).encode()
                length = {"Inference-Header-Content-Length": str(len(header))}
                answers.append((shape, *post(connection, header, length)))
        fine = post(connection, infer_body(np.ones((0, 2**31 - 1), np.float32)))
        connection.close()
    finally:
        stop_server(running)
    for shape, status, answer in answers:
        assert status == 400, (shape, answer)
        assert "size over 2147483647" in answer["error"], answer
    assert fine[0] == 200, fine[1]


def test_requests_whose_clients_hang_up_are_never_run(tmp_path: Path) -> None:
    # One instance, tens of milliseconds a request: of twenty sent at once by clients that
    # wait 150 ms, most are still queued when their clients hang up; they leave the queue
    # instead of being run for nobody.
    import httpx

    from tests.onnx_models import mlp

    path = tmp_path / "slow.onnx"
    path.write_bytes(mlp((1024, 2048, 2048, 1024)))
    served = start_server(path, "--instances", "1", name="slow")
    try:
        raw = np.ones((256, 1024), dtype=np.float32).tobytes()
        tensor = {"name": "x", "datatype": "FP32", "shape": [256, 1024]}
        header = json.dumps({"inputs": [tensor | {"parameters": {"binary_data_size": len(raw)}}]})
        headers = {"inference-header-content-length": str(len(header))}

        def call(_: int) -> bool:
            try:
                url = f"{served.url}/v2/models/slow/infer"
                httpx.post(url, content=header.encode() + raw, headers=headers, timeout=0.15)
                return True
            except httpx.TimeoutException:
                return False

        with ThreadPoolExecutor(20) as pool:
            answered = list(pool.map(call, range(20)))
        assert answered.count(False) >= 10, answered
        time.sleep(2)  # what was queued would have run by now
        metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
        executed = sum(
            family.samples[0].value
            for family in text_string_to_metric_families(metrics)
            if family.name == "nv_inference_exec_count"
        )
        # Those answered, and those that ran in the 150 ms (a few, as each takes tens of ms)
        # or were running when their clients gave up; without the drop, all twenty.
        assert executed <= answered.count(True) + 8, executed
    finally:
        stop_server(served)
