"""The one data plane both fronts call (KServe's `dataplane.py`): liveness, readiness,
metadata in the Open Inference Protocol's shape, and `infer` on a request the front has already
decoded (`runtime_worker._oip.InferRequest`), answered with numpy arrays.

Every refusal is a `ServingError` carrying both the HTTP status and the gRPC status code
(unknown model: 404 / NOT_FOUND; bad input: 400 / INVALID_ARGUMENT; not ready or queue full:
503 / UNAVAILABLE), so the fronts map nothing themselves. Each request is timed the Triton way
into `metrics`. It knows no transport, and never logs request data.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from runtime_worker import WORKER_VERSION
from runtime_worker._oip import _NUMPY, MODEL_VERSION, InferRequest, ServingError, TensorSpec
from runtime_worker.serving.batcher import Scheduler
from runtime_worker.serving.metrics import ModelMetrics, render
from runtime_worker.serving.model import OnnxModel
from runtime_worker.serving.policy import BatchingPolicy

log = logging.getLogger("modelforge.onnx_server")

SERVER_NAME = "modelforge-onnx-server"
EXTENSIONS = ["binary_tensor_data"]


class ModelLoadFailed(Exception):
    """The model could not be loaded or warmed up; the message says which and why."""


class DataPlane:
    """One model, its scheduler and its metrics. `load()` (slow: run it off the event loop),
    then everything else on the event loop."""

    def __init__(self, model: OnnxModel, policy: BatchingPolicy) -> None:
        self.model, self.policy = model, policy
        self.metrics = ModelMetrics(model.name, MODEL_VERSION)
        self.scheduler: Scheduler | None = None

    def load(self) -> None:
        """Create the sessions (`ModelLoadFailed`), then warm each up (`WarmUpFailed`)."""
        try:
            self.model.load()
        except Exception as exc:  # onnxruntime's errors share no base class but Exception
            raise ModelLoadFailed(f"cannot load the ONNX model {self.model.path}: {exc}") from None
        try:
            self.model.warm_up()
        except Exception as exc:
            raise ModelLoadFailed(
                f"the ONNX model {self.model.path} failed its warm-up (one inference on zeros "
                f"of each input's shape), so it is never ready: {exc}"
            ) from None

    def start(self) -> None:
        """After `load`, on the event loop: ready from now on."""
        self.scheduler = Scheduler(self.model, self.policy, self.metrics)

    # -- health and metadata ---------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """True only once every instance has run one inference (the warm-up)."""
        return self.scheduler is not None

    def model_ready(self, name: str, version: str | None = None) -> bool:
        self.check_model(name, version)
        return self.ready()

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": WORKER_VERSION, "extensions": EXTENSIONS}

    def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        self.check_model(name, version)
        self._check_ready()
        return {
            "name": self.model.name,
            "versions": [MODEL_VERSION],
            "platform": "onnxruntime_onnx",
            "inputs": [asdict(spec) | {"shape": list(spec.shape)} for spec in self.model.inputs],
            "outputs": [asdict(spec) | {"shape": list(spec.shape)} for spec in self.model.outputs],
        }

    def inputs(self, name: str, version: str | None = None) -> list[TensorSpec]:
        """The model's inputs, for a front decoding a request against them."""
        self.check_model(name, version)
        self._check_ready()
        return self.model.inputs

    def outputs(self, name: str, version: str | None = None) -> list[TensorSpec]:
        self.check_model(name, version)
        self._check_ready()
        return self.model.outputs

    def metrics_text(self) -> bytes:
        return render([self.metrics])

    def check_model(self, name: str, version: str | None) -> None:
        """A `ServingError` 404 unless `name` (and `version`, when given) is this model's."""
        served = self.model.name
        if name != served:
            raise ServingError(404, f"unknown model {name!r}; this server serves {served!r}")
        if version not in (None, "", MODEL_VERSION):
            raise ServingError(404, f"model {name!r} has only version {MODEL_VERSION}")

    def _check_ready(self) -> Scheduler:
        if self.scheduler is None:
            raise ServingError(
                503,
                f"model {self.model.name!r} is still loading; poll GET /v2/health/ready",
            )
        return self.scheduler

    # -- inference -------------------------------------------------------------------------

    def request_failed(self) -> None:
        """Count a request to this model that a front refused before `infer` (one it could
        not decode), as Triton counts every failed request (in the failures only, not the
        durations)."""
        self.metrics.failed()

    async def infer(
        self,
        name: str,
        version: str | None,
        request: InferRequest,
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> list[np.ndarray]:
        """The outputs `request.outputs` names, in that order; a `ServingError` otherwise, or
        `CallerGone` once `gone()` completes while the request waits (`Scheduler.submit`)."""
        self.check_model(name, version)
        scheduler = self._check_ready()
        started = time.perf_counter_ns()
        try:
            _check_feeds(request.feeds, self.model.inputs)
            names = [output for output, _ in request.outputs]
            arrays, times = await scheduler.submit(request.feeds, names, gone)
        except BaseException:
            self.metrics.failed()
            raise
        rows = _batch_rows(request.feeds) if self.model.batch_dimension_dynamic else 1
        self.metrics.succeeded(rows, time.perf_counter_ns() - started, times)
        return arrays


def _check_feeds(feeds: dict[str, np.ndarray], inputs: list[TensorSpec]) -> None:
    """Every input present with its type and a shape it takes (a front decoding with
    `_oip.decode_infer_request` has checked this already; gRPC's raw tensors may not have)."""
    if len(feeds) != len(inputs):
        raise ServingError(400, f"the model takes exactly the inputs {_described(inputs)}")
    for spec in inputs:
        array = feeds.get(spec.name)
        if (
            array is None
            or array.dtype != _NUMPY.get(spec.datatype)
            or len(array.shape) != len(spec.shape)
        ):
            raise ServingError(400, f"input {spec.name!r} must be {spec.describe()}")
        if any(want not in (-1, got) for got, want in zip(array.shape, spec.shape, strict=True)):
            raise ServingError(
                400, f"input {spec.name!r}: shape {list(array.shape)}; expected {spec.describe()}"
            )


def _described(inputs: list[TensorSpec]) -> str:
    return ", ".join(spec.describe() for spec in inputs)


def _batch_rows(feeds: dict[str, np.ndarray]) -> int:
    first = next(iter(feeds.values()), None)
    return int(first.shape[0]) if first is not None and first.ndim else 1
