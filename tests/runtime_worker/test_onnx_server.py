"""The built-in ONNX model server (WL-5b), run as a real process and spoken to by the standard
Open Inference Protocol client (`tritonclient.http`) and by plain HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from runtime_worker.serving import model as serving_model
from tests.onnx_models import relu_matmul
from tests.runtime_worker.served import NAME, Served, start_server, stop_server

WEIGHTS = np.array([[1.0, -2.0], [0.5, 1.0], [-1.0, 3.0]], dtype=np.float32)  # 3 rows, 2 columns


def _model_file(directory: Path) -> Path:
    path = directory / "relu.onnx"
    path.write_bytes(relu_matmul(WEIGHTS))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    running = start_server(_model_file(tmp_path_factory.mktemp("onnx")))
    yield running
    stop_server(running)


@pytest.fixture
def client(served: Served) -> Iterator[triton.InferenceServerClient]:
    standard = triton.InferenceServerClient(url=served.address)
    yield standard
    standard.close()


def expected(model: Path, x: np.ndarray) -> np.ndarray:
    """What onnxruntime itself computes for `x`."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["y"], {"x": x})[0])


def batch(rows: int) -> np.ndarray:
    values = np.random.default_rng(7).normal(size=(rows, WEIGHTS.shape[0]))
    return values.astype(np.float32)


def infer_json(served: Served, body: Any, model: str = NAME) -> httpx.Response:
    return httpx.post(f"{served.url}/v2/models/{model}/infer", json=body, timeout=10)


def test_standard_client_sees_server_and_model_ready(
    client: triton.InferenceServerClient,
) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(NAME)
    assert client.is_model_ready(NAME, model_version="1")
    assert not client.is_model_ready("other")
    metadata = client.get_server_metadata()
    assert "binary_tensor_data" in metadata["extensions"] and metadata["version"]


def test_model_metadata_names_inputs_and_outputs(client: triton.InferenceServerClient) -> None:
    metadata = client.get_model_metadata(NAME)
    assert metadata["name"] == NAME and metadata["platform"] == "onnxruntime_onnx"
    assert metadata["versions"] == ["1"]
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}]
    assert metadata["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]
    assert client.get_model_metadata(NAME, model_version="1") == metadata


def test_standard_client_infers_with_binary_data_by_default(
    served: Served, client: triton.InferenceServerClient
) -> None:
    x = batch(5)
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)  # binary_data=True: the client's default
    result = client.infer(NAME, [tensor])
    output = result.get_output("y")
    assert output["parameters"]["binary_data_size"] == 5 * 2 * 4  # answered as binary data
    want = expected(served.model, x)
    assert want.max() > 0 and want.min() == 0  # the relu matters for this batch
    np.testing.assert_allclose(result.as_numpy("y"), want, rtol=1e-6)


def test_standard_client_infers_with_json_tensors(
    served: Served, client: triton.InferenceServerClient
) -> None:
    x = batch(3)
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=False)
    wanted = [triton.InferRequestedOutput("y", binary_data=False)]
    result = client.infer(NAME, [tensor], outputs=wanted, request_id="req-7", model_version="1")
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_name"] == NAME
    assert "data" in result.get_output("y")  # JSON, not binary
    np.testing.assert_allclose(result.as_numpy("y"), expected(served.model, x), rtol=1e-6)


def test_standard_client_hears_a_bad_request_explained(
    client: triton.InferenceServerClient,
) -> None:
    tensor = triton.InferInput("x", [2, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((2, 4), dtype=np.float32))
    with pytest.raises(InferenceServerException) as refused:
        client.infer(NAME, [tensor])
    assert refused.value.status() == "400"
    assert "[-1, 3]" in refused.value.message()


def test_json_nested_data(served: Served) -> None:
    x = batch(2)
    body = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": x.tolist()}]}
    response = infer_json(served, body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    (output,) = response.json()["outputs"]
    assert output["name"] == "y" and output["datatype"] == "FP32" and output["shape"] == [2, 2]
    got = np.array(output["data"], dtype=np.float32).reshape(2, 2)
    np.testing.assert_allclose(got, expected(served.model, x), rtol=1e-6)


def test_binary_request_with_a_wrong_size_is_refused(served: Served) -> None:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [1, 3],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 8},
                }
            ]
        }
    ).encode()
    response = httpx.post(
        f"{served.url}/v2/models/{NAME}/infer",
        content=header + b"\0" * 8,
        headers={"Inference-Header-Content-Length": str(len(header))},
        timeout=10,
    )
    assert response.status_code == 400
    assert "takes 12" in response.json()["error"]


def test_unknown_model_is_404(served: Served) -> None:
    for response in (
        httpx.get(f"{served.url}/v2/models/other", timeout=10),
        httpx.get(f"{served.url}/v2/models/{NAME}/versions/9", timeout=10),
        infer_json(served, {"inputs": []}, model="other"),
        httpx.get(f"{served.url}/v1/anything", timeout=10),
    ):
        assert response.status_code == 404
        assert NAME in response.json()["error"] or "version 1" in response.json()["error"]


ROW = [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    ("tensor", "explained"),
    [
        (
            {"name": "z", "shape": [1, 3], "datatype": "FP32", "data": ROW},
            ["'z'", "x (FP32 [-1, 3])"],
        ),
        ({"name": "x", "shape": [1, 4], "datatype": "FP32", "data": ROW}, ["[1, 4]", "[-1, 3]"]),
        ({"name": "x", "shape": [3], "datatype": "FP32", "data": ROW}, ["[3]", "[-1, 3]"]),
        ({"name": "x", "shape": [1, 3], "datatype": "FP64", "data": ROW}, ["'FP64'", "FP32"]),
        ({"name": "x", "shape": [2, 3], "datatype": "FP32", "data": ROW}, ["3 values", "takes 6"]),
        ({"name": "x", "shape": [1, 3], "datatype": "FP32"}, ["neither data"]),
        ({"name": "x", "shape": [1, 3], "datatype": "FP32", "data": ["a", "b", "c"]}, ["FP32"]),
        ({"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [[1.0], [2.0, 3.0]]}, ["FP32"]),
    ],
)
def test_a_wrong_input_is_400_with_what_was_expected(
    served: Served, tensor: dict[str, Any], explained: list[str]
) -> None:
    response = infer_json(served, {"inputs": [tensor]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert all(part in error for part in explained), error


def test_a_missing_input_or_unknown_output_is_400(served: Served) -> None:
    missing = infer_json(served, {"inputs": []})
    assert missing.status_code == 400 and "missing inputs x (FP32 [-1, 3])" in missing.text
    tensor = {"name": "x", "shape": [1, 3], "datatype": "FP32", "data": ROW}
    unknown = infer_json(served, {"inputs": [tensor], "outputs": [{"name": "q"}]})
    assert unknown.status_code == 400 and "y (FP32 [-1, 2])" in unknown.json()["error"]


def test_invalid_json_is_400(served: Served) -> None:
    response = httpx.post(f"{served.url}/v2/models/{NAME}/infer", content=b"{nope", timeout=10)
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]


def test_a_body_over_the_limit_is_413_and_the_flag_beats_the_environment(
    tmp_path: Path,
) -> None:
    limited = start_server(
        _model_file(tmp_path),
        "--max-request-bytes",
        "1024",
        env={"MODELFORGE_ONNX_MAX_REQUEST_BYTES": "100000000"},
    )
    try:
        small = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
        assert infer_json(limited, small).status_code == 200
        big = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "pad": "p" * 65536}]}
        response = infer_json(limited, big)
        assert response.status_code == 413
        assert "1024" in response.json()["error"]
        assert response.headers["connection"] == "close"
        assert infer_json(limited, small).status_code == 200  # still serving
    finally:
        returncode, stderr = stop_server(limited)
    assert returncode == 0, stderr


def test_sigterm_exits_0_after_logging_provider_and_port_but_no_request_data(
    tmp_path: Path,
) -> None:
    running = start_server(_model_file(tmp_path))
    marker = "request-data-marker-4711"
    try:
        assert infer_json(running, {"inputs": [{"name": marker}]}).status_code == 400
        assert httpx.get(f"{running.url}/v2/models/{marker}", timeout=10).status_code == 404
    finally:
        returncode, stderr = stop_server(running)
    assert returncode == 0, stderr
    assert "CPUExecutionProvider" in stderr or "CUDAExecutionProvider" in stderr
    assert running.address.split(":")[1] in stderr
    assert marker not in stderr


def test_an_unreadable_model_exits_1_with_the_reason(tmp_path: Path) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    command = [sys.executable, "-m", "runtime_worker.onnx_server", "--model", str(broken)]
    command += ["--port", "0", "--name", NAME, "--host", "127.0.0.1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "cannot load the ONNX model" in result.stderr and str(broken) in result.stderr


@pytest.mark.parametrize(
    ("available", "environ", "expected"),
    [
        # A GPU the service holds: CUDA first, the CPU behind it.
        (
            ["CUDAExecutionProvider", "CPUExecutionProvider"],
            {"CUDA_VISIBLE_DEVICES": "GPU-1"},
            ["CUDAExecutionProvider", "CPUExecutionProvider"],
        ),
        # Nothing set (a GPU host outside the worker's assignment): CUDA may be used.
        (
            ["CUDAExecutionProvider", "CPUExecutionProvider"],
            {},
            ["CUDAExecutionProvider", "CPUExecutionProvider"],
        ),
        # `gpus: 0`: the worker hides every GPU, so onnxruntime must not try CUDA.
        (
            ["CUDAExecutionProvider", "CPUExecutionProvider"],
            {"CUDA_VISIBLE_DEVICES": ""},
            ["CPUExecutionProvider"],
        ),
        # An onnxruntime without CUDA (the CPU image): the CPU, whatever is visible.
        (["CPUExecutionProvider"], {"CUDA_VISIBLE_DEVICES": "GPU-1"}, ["CPUExecutionProvider"]),
    ],
)
def test_cuda_is_chosen_only_with_a_visible_gpu_and_a_cuda_build(
    available: list[str], environ: dict[str, str], expected: list[str]
) -> None:
    assert serving_model.choose_providers(available, environ) == expected
