"""The model server's gRPC API (runtime_worker.serving.grpc_service) through its native front, a
real server process called by the unchanged standard client, `tritonclient.grpc`, and by
Triton's own generated stub for what that client does not send (typed contents, bad messages):
answers equal onnxruntime's, and each refusal carries its gRPC status code. What the service
holds against the server's byte budget and its queue, which a test must see inside the
process, is asked of `GrpcService` itself on its own event loop (uvloop, as under Granian)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton
import uvloop
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from runtime_worker._oip import ServingError
from runtime_worker.serving import grpc_service
from runtime_worker.serving.dataplane import DataPlane
from runtime_worker.serving.grpc_service import GrpcService
from runtime_worker.serving.http import ByteBudget
from runtime_worker.serving.model import InstancePlan, OnnxModel
from runtime_worker.serving.policy import BatchingPolicy
from tests.onnx_models import mlp, relu_matmul
from tests.runtime_worker.served import free_port, start_server, stop_server

T = TypeVar("T")
WEIGHTS = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.0
LIMIT = 1024 * 1024


class Loop:
    """An event loop on a thread of its own, as the model server's process runs one."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _dataplane(path: Path, policy: BatchingPolicy | None = None) -> DataPlane:
    plan = InstancePlan.of(instances=1, cpus=1, available=["CPUExecutionProvider"], environ={})
    dataplane = DataPlane(OnnxModel("relu", path, plan), policy or BatchingPolicy())
    dataplane.load()
    return dataplane


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("grpc") / "relu.onnx"
    path.write_bytes(relu_matmul(WEIGHTS))
    return path


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    running = Loop()
    yield running
    running.close()


@pytest.fixture(scope="module")
def address(model_path: Path) -> Iterator[str]:
    """The model server's gRPC port: its native front, which relays each call to the server's
    `GrpcService`."""
    port = free_port()
    flags = ["--grpc-port", str(port), "--max-request-bytes", str(LIMIT)]
    flags += ["--max-inflight-bytes", str(64 * LIMIT), "--instances", "1", "--cpus", "1"]
    served = start_server(model_path, *flags)
    yield f"127.0.0.1:{port}"
    stop_server(served)


def _refusal(loop: Loop, service: GrpcService, method: str, message: bytes) -> ServingError:
    """The refusal `service` answers a call with (what the front sends as the call's status)."""
    with pytest.raises(ServingError) as caught:
        loop.run(service.call(method, message))
    return caught.value


def _infer(x: np.ndarray, model: str = "relu") -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model, raw_input_contents=[x.tobytes()])
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    return request.SerializeToString()


async def _start(dataplane: DataPlane) -> None:
    dataplane.start()  # on the loop: the scheduler belongs to it


def _expected(x: np.ndarray, path: Path) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["y"], {"x": x})[0])


def _stub(address: str) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(address)
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_tritonclient_grpc_gets_health_metadata_and_onnxruntimes_answer(
    address: str, model_path: Path
) -> None:
    client = triton.InferenceServerClient(url=address)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("relu") and client.is_model_ready("relu", "1")
        server = client.get_server_metadata(as_json=True)
        assert server["name"] == "modelforge-onnx-server"
        assert "binary_tensor_data" in server["extensions"]
        metadata = client.get_model_metadata("relu", as_json=True)
        assert metadata["name"] == "relu" and metadata["versions"] == ["1"]
        assert metadata["platform"] == "onnxruntime_onnx"
        assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "3"]}]
        assert metadata["outputs"] == [{"name": "y", "datatype": "FP32", "shape": ["-1", "4"]}]

        for rows in (1, 5):
            x = np.random.default_rng(rows).standard_normal((rows, 3)).astype(np.float32)
            inputs = [triton.InferInput("x", list(x.shape), "FP32")]
            inputs[0].set_data_from_numpy(x)
            result = client.infer(
                "relu", inputs, request_id=f"r{rows}", outputs=[triton.InferRequestedOutput("y")]
            )
            y = result.as_numpy("y")
            assert y.dtype == np.float32 and y.shape == (rows, 4)
            np.testing.assert_array_equal(y, _expected(x, model_path))
            response = result.get_response()
            assert (response.id, response.model_name, response.model_version) == (
                f"r{rows}",
                "relu",
                "1",
            )
    finally:
        client.close()


def test_typed_contents_are_answered_as_raw_contents(address: str, model_path: Path) -> None:
    x = np.array([[1.5, -2.0, 3.0], [0.25, 0.5, -0.75]], dtype=np.float32)
    request = service_pb2.ModelInferRequest(model_name="relu")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2, 3])
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    channel, stub = _stub(address)
    with channel:
        response = stub.ModelInfer(request, timeout=30)
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("y", "FP32", [2, 4])
    ]
    y = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(2, 4)
    np.testing.assert_array_equal(y, _expected(x, model_path))


def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


def test_each_refusal_carries_its_status_code(address: str) -> None:
    channel, stub = _stub(address)
    good = np.zeros((1, 3), dtype=np.float32).tobytes()

    def infer(request: Any) -> Any:
        return lambda: stub.ModelInfer(request, timeout=30)

    def request(**fields: Any) -> Any:
        message = service_pb2.ModelInferRequest(model_name=fields.pop("model", "relu"), **fields)
        return message

    with channel:
        code, details = _code(infer(request(model="nope")))
        assert code == grpc.StatusCode.NOT_FOUND and "'relu'" in details
        code, _ = _code(
            lambda: stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="nope"), timeout=30)
        )
        assert code == grpc.StatusCode.NOT_FOUND
        code, _ = _code(
            lambda: stub.ModelReady(
                service_pb2.ModelReadyRequest(name="relu", version="7"), timeout=30
            )
        )
        assert code == grpc.StatusCode.NOT_FOUND

        x = service_pb2.ModelInferRequest.InferInputTensor
        refused = {
            "a shape the model does not take": request(
                inputs=[x(name="x", datatype="FP32", shape=[1, 4])],
                raw_input_contents=[np.zeros(4, dtype=np.float32).tobytes()],
            ),
            "a wrong datatype": request(
                inputs=[x(name="x", datatype="FP64", shape=[1, 3])],
                raw_input_contents=[np.zeros(3).tobytes()],
            ),
            "raw bytes short of the shape": request(
                inputs=[x(name="x", datatype="FP32", shape=[2, 3])], raw_input_contents=[good]
            ),
            "raw contents for some inputs only": request(
                inputs=[x(name="x", datatype="FP32", shape=[1, 3])],
                raw_input_contents=[good, good],
            ),
            "an unknown input": request(
                inputs=[x(name="z", datatype="FP32", shape=[1, 3])], raw_input_contents=[good]
            ),
            "no inputs": request(),
            "an unknown output": request(
                inputs=[x(name="x", datatype="FP32", shape=[1, 3])],
                raw_input_contents=[good],
                outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="q")],
            ),
            "typed values short of the shape": request(
                inputs=[
                    x(
                        name="x",
                        datatype="FP32",
                        shape=[1, 3],
                        contents=service_pb2.InferTensorContents(fp32_contents=[1.0]),
                    )
                ]
            ),
            "a negative size": request(
                inputs=[x(name="x", datatype="FP32", shape=[-1, 3])], raw_input_contents=[good]
            ),
        }
        for what, message in refused.items():
            code, details = _code(infer(message))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, what
            assert details, what

        # Still serving: the refusals changed nothing.
        fine = request(
            inputs=[x(name="x", datatype="FP32", shape=[1, 3])], raw_input_contents=[good]
        )
        assert stub.ModelInfer(fine, timeout=30).outputs[0].name == "y"


def test_a_message_over_the_limit_is_resource_exhausted(address: str) -> None:
    rows = LIMIT // 12 + 1  # one row of 3 FP32 values is 12 bytes: just over the limit
    x = np.zeros((rows, 3), dtype=np.float32)
    client = triton.InferenceServerClient(url=address)
    try:
        inputs = [triton.InferInput("x", list(x.shape), "FP32")]
        inputs[0].set_data_from_numpy(x)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("relu", inputs)
        assert caught.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        # Under the limit, the same client on the same channel is answered.
        small = [triton.InferInput("x", [2, 3], "FP32")]
        small[0].set_data_from_numpy(x[:2])
        assert client.infer("relu", small).as_numpy("y").shape == (2, 4)
    finally:
        client.close()


def test_unavailable_while_loading_and_when_the_byte_budget_is_spent(
    loop: Loop, model_path: Path
) -> None:
    loading = GrpcService(_dataplane(model_path))  # loaded but not started: not ready yet
    answer = loop.run(loading.call("ServerReady", b""))
    assert not service_pb2.ServerReadyResponse.FromString(answer).ready
    metadata = service_pb2.ModelMetadataRequest(name="relu").SerializeToString()
    refused = _refusal(loop, loading, "ModelMetadata", metadata)
    assert refused.grpc_code == "UNAVAILABLE" and "loading" in refused.message

    ready = _dataplane(model_path)
    loop.run(_start(ready))
    budget = ByteBudget(100)  # less than any infer request takes
    service = GrpcService(ready, budget)
    message = _infer(np.ones((1, 3), dtype=np.float32))
    assert _refusal(loop, service, "ModelInfer", message).grpc_code == "UNAVAILABLE"
    assert budget.used == 0  # nothing held after the refusal
    budget.limit = 64 * LIMIT
    answer = loop.run(service.call("ModelInfer", message))
    assert service_pb2.ModelInferResponse.FromString(answer).outputs[0].shape == [1, 4]
    assert budget.used == 0  # and nothing after an answer


def test_typed_contents_are_counted_as_what_decoding_them_takes(
    loop: Loop, model_path: Path
) -> None:
    # 3,000 FP32 values: 12 KB on the wire either way; as typed contents they may take 16x that
    # once parsed and decoded, which this budget does not hold, while raw contents fit.
    ready = _dataplane(model_path)
    loop.run(_start(ready))
    budget = ByteBudget(150 * 1024)
    service = GrpcService(ready, budget)
    x = np.random.default_rng(3).standard_normal((1000, 3)).astype(np.float32)
    typed = service_pb2.ModelInferRequest(model_name="relu")
    tensor = typed.inputs.add(name="x", datatype="FP32", shape=[1000, 3])
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    answer = service_pb2.ModelInferResponse.FromString(
        loop.run(service.call("ModelInfer", _infer(x)))
    )
    y = np.frombuffer(answer.raw_output_contents[0], dtype="<f4").reshape(1000, 4)
    np.testing.assert_array_equal(y, _expected(x, model_path))
    refused = _refusal(loop, service, "ModelInfer", typed.SerializeToString())
    assert refused.grpc_code == "UNAVAILABLE" and "retry later" in refused.message
    assert budget.used == 0


def test_a_full_queue_is_unavailable_at_once(loop: Loop, tmp_path: Path) -> None:
    # One instance busy for tens of milliseconds per request and room for one waiting request:
    # of twelve sent together, most find the queue full and are refused without waiting.
    path = tmp_path / "slow.onnx"
    path.write_bytes(mlp((1024, 2048, 2048, 1024)))
    slow = _dataplane(path, BatchingPolicy(max_queue_size=1))
    loop.run(_start(slow))
    service = GrpcService(slow)
    message = _infer(np.ones((64, 1024), dtype=np.float32))

    async def twelve() -> list[bytes | BaseException]:
        calls = (service.call("ModelInfer", message) for _ in range(12))
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = loop.run(twelve())
    answered = [o for o in outcomes if isinstance(o, bytes)]
    refused = [o for o in outcomes if not isinstance(o, bytes)]
    assert answered and refused, outcomes
    for error in refused:
        assert isinstance(error, ServingError), error
        assert error.grpc_code == "UNAVAILABLE" and "retry later" in error.message
    answer = service_pb2.ModelInferResponse.FromString(
        loop.run(service.call("ModelInfer", message))
    )
    assert answer.outputs[0].name == "y"  # still serving


def _failures(dataplane: DataPlane) -> float:
    text = dataplane.metrics_text().decode()
    (line,) = [row for row in text.splitlines() if row.startswith("nv_inference_request_failure{")]
    return float(line.rsplit(" ", 1)[1])


def test_requests_refused_while_decoding_count_as_failures(loop: Loop, model_path: Path) -> None:
    dataplane = _dataplane(model_path)
    loop.run(_start(dataplane))
    service = GrpcService(dataplane)
    wrong_shape = _infer(np.zeros((1, 4), dtype=np.float32))
    assert _refusal(loop, service, "ModelInfer", wrong_shape).grpc_code == "INVALID_ARGUMENT"
    assert _failures(dataplane) == 1
    other = service_pb2.ModelInferRequest(model_name="other").SerializeToString()
    assert _refusal(loop, service, "ModelInfer", other).grpc_code == "NOT_FOUND"
    assert _failures(dataplane) == 1  # another model's request is not this one's


def test_messages_that_are_not_infer_requests_are_refused(address: str) -> None:
    # Sent as bytes: a truncated field and a wire type protobuf never uses are no message at
    # all; 100,000 nested unknown fields are skipped unparsed (the protocol has no recursive
    # message), leaving a request for no model.
    nested = b""
    for _ in range(100_000):
        nested = b"\x7a" + _varint(len(nested)) + nested  # field 15, length-delimited
    messages = {
        b"\x0a\x10relu": grpc.StatusCode.INVALID_ARGUMENT,  # a name cut short
        b"\x0f": grpc.StatusCode.INVALID_ARGUMENT,  # wire type 7
        nested: grpc.StatusCode.NOT_FOUND,
    }
    with grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for message, expected in messages.items():
            code, _ = _code(lambda message=message: infer(message, timeout=30))
            assert code == expected, message[:8]
        # Still serving.
        live = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
        assert live(b"", timeout=30) == b"\x08\x01"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_scalar_fields_and_too_many_tensors_are_refused_before_being_scanned(
    address: str,
) -> None:
    # Every field of a ModelInferRequest is length-delimited and the model has one input and
    # one output: a message of scalar fields, or of many (empty) tensors, parameters or raw
    # contents, is refused at its first field past what it may carry (scanning it whole in
    # Python took ~0.5 s a MiB on the event loop; parsing it took up to 44x its size).
    pairs = (LIMIT - 64) // 2
    messages = {
        b"\x18\x00" * pairs: "wire type 0",  # field 3 (id) as varints
        b"\x2a\x00" * pairs: "more inputs than the model's 1",
        b"\x32\x00" * pairs: "more requested outputs than the model's 1",
        b"\x3a\x00" * pairs: "more raw_input_contents than the model's 1",
        b"\x22\x00" * pairs: "more than 64 request parameters",
        b"\x0a\x00" * pairs: "more than 16 fields",
        b"\x2a\x02\x18\x00" * 1: None,  # one input, its shape unpacked: a valid message
        b"\x2a" + _varint(2 * pairs - 8) + b"\x18\x00" * (pairs - 4): "more than 136 fields",
    }
    with grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for message, problem in messages.items():
            code, details = _code(lambda message=message: infer(message, timeout=60))
            if problem is None:
                assert code == grpc.StatusCode.NOT_FOUND  # no model named: parsed, then looked up
                continue
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (problem, details)
            assert problem in details, details


def test_a_shape_with_a_zero_and_a_huge_size_is_invalid_argument(address: str) -> None:
    x = service_pb2.ModelInferRequest.InferInputTensor
    channel, stub = _stub(address)
    with channel:
        for shape in ([0, 2**62], [0, 2**31 - 1, 2**31 - 1, 2**31 - 1], [1] * 65):
            for raw in (True, False):
                request = service_pb2.ModelInferRequest(
                    model_name="relu", inputs=[x(name="x", datatype="FP32", shape=shape)]
                )
                if raw:
                    request.raw_input_contents.append(b"")
                code, details = _code(lambda request=request: stub.ModelInfer(request, timeout=30))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (shape, raw, details)
        good = np.zeros((1, 3), dtype=np.float32).tobytes()
        fine = service_pb2.ModelInferRequest(
            model_name="relu",
            inputs=[x(name="x", datatype="FP32", shape=[1, 3])],
            raw_input_contents=[good],
        )
        assert stub.ModelInfer(fine, timeout=30).outputs[0].name == "y"  # still serving


def test_messages_of_many_empty_tensors_are_refused_without_memory_growing(
    model_path: Path,
) -> None:
    # The real server process: 16 MiB of empty inputs (44x that once parsed by upb, charged 2x
    # before) and of empty requested outputs (24x) are refused at once; the server's memory
    # grows by no more than gRPC's buffers for the message (68 MiB measured; 1.1 GiB before,
    # each message parsed for 9-13 s on the event loop), and it still answers.
    from tests.runtime_worker.test_serving_hostile import PeakRss

    grpc_port = free_port()
    running = start_server(model_path, "--grpc-port", str(grpc_port))
    try:
        baseline = running.rss()
        pairs = 8 * 1024 * 1024
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            for message in (b"\x2a\x00" * pairs, b"\x32\x00" * pairs):
                with PeakRss(running) as memory:
                    code, _ = _code(lambda message=message: infer(message, timeout=60))
                grown = memory.peak - baseline
                assert grown < 200 * 1024 * 1024, f"RSS grew by {grown / 2**20:.0f} MiB"
                assert code in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.UNAVAILABLE,
                ), code
            client_x = service_pb2.ModelInferRequest.InferInputTensor
            fine = service_pb2.ModelInferRequest(
                model_name="relu",
                inputs=[client_x(name="x", datatype="FP32", shape=[1, 3])],
                raw_input_contents=[np.zeros((1, 3), dtype=np.float32).tobytes()],
            )
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ModelInfer(fine, timeout=30).outputs[0].name == "y"
    finally:
        stop_server(running)


def test_the_calls_at_once_are_what_the_budget_holds_in_messages() -> None:
    # A call's whole message arrives before the budget counts it, so the front takes only as
    # many calls at once as the budget holds messages of the largest size, at least 16 (the
    # native front refusing the one past them: test_grpc_native.py).
    assert grpc_service.max_calls(512 * LIMIT, 64 * LIMIT) == grpc_service.MIN_CALLS == 16
    assert grpc_service.max_calls(512 * LIMIT, 4 * LIMIT) == 128
    assert grpc_service.max_calls(0, LIMIT) is None  # no budget: unbounded
