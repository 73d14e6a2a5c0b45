"""An ONNX service deployed through the real control plane, node agent and runtime worker answers
the two standard Open Inference Protocol clients unchanged (issue 26's acceptance):
`tritonclient.http` at the service's `url` (binary tensors and JSON) and `tritonclient.grpc` at
its `grpc_url`, each exactly as onnxruntime run here answers the same inputs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.e2e.node import live_stack, wait_ready, wait_until
from tests.e2e.server import LiveServer
from tests.onnx_models import mlp

pytestmark = pytest.mark.e2e

FAST = {
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_TELEMETRY_INTERVAL_SECONDS": "2",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
}


def _call(server: LiveServer, method: str, path: str, **kw: Any) -> Any:
    with server.client() as client:
        response = client.request(method, path, headers=server.admin, **kw)
    assert response.is_success, f"{method} {path}: {response.status_code} {response.text}"
    return response.json() if response.content else None


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], bytes]]:
    """A healthy `onnx` service of the MLP 256 -> 256 -> 10, as the API shows it."""
    model = mlp()
    with live_stack(tmp_path_factory.mktemp("serving"), FAST) as (server, node):
        node_id = node.start_worker().start_agent().node_id()
        wait_ready(server, node_id, 30)
        digest = _call(server, "POST", "/api/v1/artifacts", content=model)["digest"]
        _call(
            server,
            "POST",
            "/api/v1/models",
            json={"name": "mlp", "version": "1", "runner": "onnx", "weights": digest},
        )
        service = _call(
            server,
            "POST",
            "/api/v1/services",
            json={"name": "mlp", "model": "mlp@1", "resources": {"cpus": 1}},
        )
        path = f"/api/v1/services/{service['service_id']}"
        try:
            wait_until(lambda: server.get(path)["state"] == "healthy", 90, "a healthy service")
        except AssertionError:
            raise AssertionError(str(server.get(f"{path}/events"))) from None
        # The agent reports both ports in the same sync; the view may lag the state by one.
        wait_until(lambda: server.get(path)["grpc_url"] is not None, 30, "the gRPC address")
        yield dict(server.get(path)), model
        _call(server, "DELETE", path)
        stopped = server.get(path)
        assert stopped["url"] is None and stopped["grpc_url"] is None


def _expected(model: bytes, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["y"], {"x": x})[0])


def test_the_service_view_shows_both_addresses(deployed: tuple[dict[str, Any], bytes]) -> None:
    service, _ = deployed
    http_host, http_port = service["url"].removeprefix("http://").rsplit(":", 1)
    grpc_host, grpc_port = service["grpc_url"].rsplit(":", 1)  # host:port, as gRPC takes it
    assert service["url"].startswith("http://") and "//" not in service["grpc_url"]
    assert grpc_host == http_host and grpc_port != http_port


def test_tritonclient_http_and_grpc_answer_as_onnxruntime(
    deployed: tuple[dict[str, Any], bytes],
) -> None:
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http

    service, model = deployed
    rng = np.random.default_rng(26)
    batches = [rng.standard_normal((rows, 256)).astype(np.float32) for rows in (1, 3, 8)]

    http = triton_http.InferenceServerClient(url=service["url"].removeprefix("http://"))
    try:
        assert http.is_server_ready() and http.is_model_ready("mlp")
        for x in batches:
            for binary in (True, False):  # the binary tensor data extension, then JSON
                inputs = [triton_http.InferInput("x", list(x.shape), "FP32")]
                inputs[0].set_data_from_numpy(x, binary_data=binary)
                outputs = [triton_http.InferRequestedOutput("y", binary_data=binary)]
                y = http.infer("mlp", inputs, outputs=outputs).as_numpy("y")
                np.testing.assert_allclose(y, _expected(model, x), rtol=1e-5, atol=1e-6)
    finally:
        http.close()

    grpc = triton_grpc.InferenceServerClient(url=service["grpc_url"])
    try:
        assert grpc.is_server_live() and grpc.is_server_ready() and grpc.is_model_ready("mlp")
        metadata = grpc.get_model_metadata("mlp", as_json=True)
        assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "256"]}]
        assert metadata["outputs"] == [{"name": "y", "datatype": "FP32", "shape": ["-1", "10"]}]
        for x in batches:
            inputs = [triton_grpc.InferInput("x", list(x.shape), "FP32")]
            inputs[0].set_data_from_numpy(x)
            result = grpc.infer("mlp", inputs, request_id="e2e")
            np.testing.assert_allclose(
                result.as_numpy("y"), _expected(model, x), rtol=1e-5, atol=1e-6
            )
            assert result.get_response().id == "e2e"
    finally:
        grpc.close()


def test_grpc_refusals_carry_their_codes(deployed: tuple[dict[str, Any], bytes]) -> None:
    import tritonclient.grpc as triton_grpc
    from tritonclient.utils import InferenceServerException

    service, _ = deployed
    grpc = triton_grpc.InferenceServerClient(url=service["grpc_url"])
    try:
        wrong = [triton_grpc.InferInput("x", [1, 255], "FP32")]
        wrong[0].set_data_from_numpy(np.zeros((1, 255), dtype=np.float32))
        with pytest.raises(InferenceServerException) as caught:
            grpc.infer("mlp", wrong)
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "256" in str(caught.value.message())  # says what the model takes
        with pytest.raises(InferenceServerException) as caught:
            grpc.get_model_metadata("other")
        assert caught.value.status() == "StatusCode.NOT_FOUND"
    finally:
        grpc.close()
