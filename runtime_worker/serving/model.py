"""The model: one ONNX file behind a small interface (load, warm up, ready, run), as
`instances` onnxruntime sessions that requests are spread over.

Each instance is one session and one thread of `executor`: whoever runs a batch hands it to the
executor and the thread takes an idle session, so at most `instances` runs happen at once and
none waits for another's session. On a GPU node the instances go round the GPUs the service
holds (one per GPU by default); on the CPU there is one by default, and the cores the service
holds are shared out as onnxruntime's intra-op threads, so instances never oversubscribe them.

It knows nothing of HTTP, gRPC or batching, and never logs tensor data.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime_worker._oip import _NUMPY, ServingError, TensorSpec, tensor_spec

log = logging.getLogger("modelforge.onnx_server")


def choose_providers(available: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """CUDA when onnxruntime has it and the process may see a GPU; the CPU always as fallback."""
    if "CUDAExecutionProvider" in available and environ.get("CUDA_VISIBLE_DEVICES") != "":
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def visible_gpus(environ: Mapping[str, str]) -> int | None:
    """How many GPUs the process was given (CUDA_VISIBLE_DEVICES), None when it does not say."""
    devices = environ.get("CUDA_VISIBLE_DEVICES")
    if devices is None:
        return None
    return len([device for device in devices.split(",") if device.strip()])


@dataclass(frozen=True)
class InstancePlan:
    """How many sessions, on which providers, with how many intra-op threads each."""

    count: int
    providers: list[str]
    gpus: int  # GPUs the sessions go round (0: the CPU)
    threads: int  # onnxruntime intra-op threads per session (0: onnxruntime's default)

    @classmethod
    def of(
        cls,
        *,
        instances: int | None,
        cpus: int | None,
        available: Sequence[str],
        environ: Mapping[str, str],
    ) -> InstancePlan:
        providers = choose_providers(available, environ)
        gpus = (visible_gpus(environ) or 1) if providers[0] == "CUDAExecutionProvider" else 0
        count = instances or max(gpus, 1)
        cores = cpus or len(os.sched_getaffinity(0))
        # On the CPU the instances share the cores the service holds; on a GPU the CPU side of a
        # session is light, one thread each keeps them from fighting over the cores.
        threads = max(1, cores // count) if gpus == 0 else 1
        return cls(count=count, providers=providers, gpus=gpus, threads=threads)


class OnnxModel:
    """`plan.count` onnxruntime sessions of one ONNX file, and the protocol's view of its
    tensors. `load` then `warm_up` (both slow, run off the event loop); `run` from `executor`'s
    threads only."""

    def __init__(self, name: str, path: Path, plan: InstancePlan) -> None:
        self.name, self.path, self.plan = name, path, plan
        self.inputs: list[TensorSpec] = []
        self.outputs: list[TensorSpec] = []
        self.provider = plan.providers[0]
        self.ready = False
        #: Whether every input's and output's first dimension is dynamic (set by `load`):
        #: batching may merge requests along it, and a request's rows are its inferences.
        self.batch_dimension_dynamic = False
        #: Nanoseconds of one warm run on the warm-up's zeros, and how many input elements
        #: that run took (set by `warm_up`).
        self.warm_up_ns = 0
        self.warm_up_elements = 1
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.executor = ThreadPoolExecutor(max_workers=plan.count, thread_name_prefix="instance")

    def load(self) -> None:
        """Create the sessions; onnxruntime's exception when the file is not a usable model."""
        import onnxruntime as ort

        for index in range(self.plan.count):
            options = ort.SessionOptions()
            options.intra_op_num_threads = self.plan.threads
            options.inter_op_num_threads = 1
            # Idle intra-op threads sleep instead of spinning: spinning between requests took
            # ~0.6 ms of CPU per inference of a small model (8x the inference), CPU the event
            # loop and the other instances need (bench/serving.py).
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            providers: list[Any] = list(self.plan.providers)
            if self.plan.gpus:
                device = {"device_id": str(index % self.plan.gpus)}
                providers = [("CUDAExecutionProvider", device), *self.plan.providers[1:]]
            session = ort.InferenceSession(str(self.path), options, providers=providers)
            if index == 0:
                self.provider = session.get_providers()[0]
                self.inputs = [tensor_spec(arg) for arg in session.get_inputs()]
                self.outputs = [tensor_spec(arg) for arg in session.get_outputs()]
            self._idle.put(session)
        tensors = [*self.inputs, *self.outputs]
        self.batch_dimension_dynamic = all(spec.shape[:1] == (-1,) for spec in tensors)

    def warm_up(self) -> None:
        """One inference on zeros of each input's shape (a dynamic dimension as 1) on every
        session: a model that cannot run is never ready. Raises what the run raised."""
        feeds = {}
        for spec in self.inputs:
            if (dtype := _NUMPY.get(spec.datatype)) is None:
                raise ValueError(
                    f"input {spec.name} is {spec.datatype}, which this server cannot carry"
                )
            feeds[spec.name] = np.zeros([max(dim, 1) for dim in spec.shape], dtype=dtype)
        names = [spec.name for spec in self.outputs]
        sessions = [self._idle.get() for _ in range(self.plan.count)]
        try:
            for session in sessions:
                session.run(names, feeds)
            started = time.perf_counter_ns()  # once more, warm: what a run costs
            sessions[0].run(names, feeds)
            self.warm_up_ns = time.perf_counter_ns() - started
            self.warm_up_elements = max(1, sum(array.size for array in feeds.values()))
        finally:
            for session in sessions:
                self._idle.put(session)
        self.ready = True

    def run(self, feeds: dict[str, np.ndarray], names: Sequence[str]) -> list[np.ndarray]:
        """Run on an idle session (from one of `executor`'s threads); a `ServingError` when
        onnxruntime refuses the inputs (400) or fails (500)."""
        session = self._idle.get()
        try:
            return list(session.run(list(names), feeds))
        except Exception as exc:  # onnxruntime's errors share no base class but Exception
            invalid = type(exc).__name__ == "InvalidArgument"
            log.warning("inference failed: %s", type(exc).__name__)
            raise ServingError(
                400 if invalid else 500,
                f"the model failed: {_first_line(str(exc))}; check the inputs against "
                f"GET /v2/models/{self.name}",
            ) from None
        finally:
            self._idle.put(session)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "no reason given"
    return line[:300]
