"""The active check of one GPU (issue 28): the program of the job the control plane starts when
an admin re-admits a GPU that failed. The runtime worker runs it on that GPU alone
(CUDA_VISIBLE_DEVICES names only it). `check(uuid, provider, index)` returns what it checked,
or raises `GpuCheckFailed` naming what failed, which fails the job with that message:

1. NVML (pynvml): the GPU with that UUID answers, is not lost, has no volatile uncorrected ECC
   error, no row remapping pending or failed and no retired page pending. A reading this GPU
   or driver does not offer (NOT_SUPPORTED: row remapping before Ampere, page retirement from
   Ampere on) is skipped, and the result names it.
2. onnxruntime: a small model, written here field by field (the `onnx` package is not on
   nodes), runs the same input on `provider` (CUDAExecutionProvider in production) and on
   CPUExecutionProvider; the answers must be finite and agree within TOLERANCE.

The control plane ships this file as the job's source text (control_plane/fleet/gpu_check.py)
and never imports it: it runs in the runtime worker's environment and imports nothing of
ModelForge.
"""

from __future__ import annotations

import os
import time
from typing import Any

#: The largest difference allowed between the provider's answer and the CPU's. The answers lie
#: in [-1, 1] (tanh); TF32 matrix products on a GPU differ from the CPU by ~1e-3, a faulty GPU
#: by far more (or by NaN).
TOLERANCE = 2e-2
#: The model's input: x of shape (ROWS, WIDTH), w of shape (WIDTH, WIDTH), from a fixed seed.
ROWS, WIDTH = 256, 512
#: The way out of a fault that a GPU reset clears.
_RESET = "reset the GPU (nvidia-smi -r -i <index>, nothing running on it) or reboot the node"
_FLOAT = 1  # onnx TensorProto.FLOAT


class GpuCheckFailed(RuntimeError):
    """The GPU did not pass; the message says which step failed and how."""


def check(uuid: str, provider: str, index: int | None = None) -> dict[str, Any]:
    """Check the GPU `uuid` (at NVML index `index`, when known), then run the model on
    `provider` and on the CPU. Returns what was checked, what was skipped, the largest
    difference and the timings."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible != uuid:
        raise GpuCheckFailed(
            f"this job must see GPU {uuid} alone, but CUDA_VISIBLE_DEVICES is {visible!r}"
        )
    started = time.monotonic()
    nvml = _nvml_check(uuid, index)
    nvml_seconds = time.monotonic() - started
    inference = _inference_check(provider)
    return {
        "uuid": uuid,
        "provider": provider,
        "nvml": nvml,
        "inference": inference,
        "timings": {
            "nvml_s": round(nvml_seconds, 4),
            "total_s": round(time.monotonic() - started, 4),
            **inference.pop("timings"),
        },
    }


# ---------------------------------------------------------------------------------------- NVML


def _nvml_check(uuid: str, index: int | None) -> dict[str, Any]:
    try:
        import pynvml
    except ImportError:
        raise GpuCheckFailed(
            "pynvml (the nvidia-ml-py package) is not installed where the runtime worker runs "
            "jobs; the check needs it to read the GPU's health"
        ) from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise GpuCheckFailed(f"NVML did not start on this node: {exc}") from None
    name = f"GPU {index} ({uuid})" if index is not None else f"GPU {uuid}"
    try:
        handle = _find(pynvml, uuid, index, name)
        return _readings(pynvml, handle, name)
    except pynvml.NVMLError as exc:
        raise GpuCheckFailed(f"NVML failed while checking {name}: {exc}") from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _lost(pynvml: Any, exc: Exception) -> bool:
    return bool(getattr(exc, "value", None) == pynvml.NVML_ERROR_GPU_IS_LOST)


def _lost_message(name: str) -> str:
    return (
        f"{name} is lost: NVML answers 'GPU is lost' (it fell off the bus): {_RESET} before "
        "re-admitting it"
    )


def _find(pynvml: Any, uuid: str, index: int | None, name: str) -> Any:
    """The handle of the GPU `uuid`. NVML answers GPU_IS_LOST for a lost GPU (its lookup by
    index, or any call on a handle it still hands out, its UUID included), so its UUID cannot be
    compared: a lost GPU at `index` is this one."""
    seen: list[str] = []
    for position in range(int(pynvml.nvmlDeviceGetCount())):
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(position)
            found = _text(pynvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError as exc:
            if _lost(pynvml, exc) and position == index:
                raise GpuCheckFailed(_lost_message(name)) from None
            seen.append(f"{position}: {exc}")
            continue
        if found == uuid:
            return handle
        seen.append(f"{position}: {found}")
    raise GpuCheckFailed(
        f"NVML finds no GPU {uuid} on this node (it sees {'; '.join(seen) or 'no GPU'})"
    )


def _reading(pynvml: Any, name: str, read: Any, *args: Any) -> Any:
    """`read(*args)`; None when this GPU or driver does not offer it."""
    try:
        return read(*args)
    except pynvml.NVMLError as exc:
        if _lost(pynvml, exc):
            raise GpuCheckFailed(_lost_message(name)) from None
        if exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            return None
        raise GpuCheckFailed(f"NVML could not read {name} ({read.__name__}: {exc})") from None


def _readings(pynvml: Any, handle: Any, name: str) -> dict[str, Any]:
    checked: dict[str, Any] = {}
    skipped: list[str] = []
    ecc = _reading(
        pynvml,
        name,
        pynvml.nvmlDeviceGetTotalEccErrors,
        handle,
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        pynvml.NVML_VOLATILE_ECC,
    )
    if ecc is None:
        skipped.append("volatile uncorrected ECC errors: not supported")
    elif int(ecc) > 0:
        raise GpuCheckFailed(
            f"{name} has {int(ecc)} volatile uncorrected ECC errors since the driver loaded: "
            f"{_RESET}"
        )
    else:
        checked["volatile_uncorrected_ecc"] = 0
    remap = _reading(pynvml, name, pynvml.nvmlDeviceGetRemappedRows, handle)
    if remap is None:
        skipped.append("row remapping: not supported")
    else:
        corrected, uncorrected, pending, failure = (int(value) for value in remap)
        if failure:
            raise GpuCheckFailed(
                f"{name} failed a row remapping ({uncorrected} rows remapped for "
                "uncorrectable errors): the GPU needs service"
            )
        if pending:
            raise GpuCheckFailed(
                f"{name} has a row remapping pending: {_RESET}, so that it takes effect"
            )
        checked["remapped_rows"] = {"correctable": corrected, "uncorrectable": uncorrected}
    retired = _reading(pynvml, name, pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    if retired is None:
        skipped.append("retired pages pending: not supported")
    elif int(retired):
        raise GpuCheckFailed(
            f"{name} has retired memory pages pending: {_RESET}, so that they are retired"
        )
    else:
        checked["retired_pages_pending"] = False
    return {"checked": checked, "skipped": skipped}


# ---------------------------------------------------------------------------------- inference


def _inference_check(provider: str) -> dict[str, Any]:
    import numpy as np
    import onnxruntime as ort

    available = ort.get_available_providers()
    if provider not in available:
        raise GpuCheckFailed(
            f"onnxruntime {ort.__version__} here has no {provider} (it has "
            f"{', '.join(available)}); a GPU node needs the runtime worker's cuda flavour "
            "(onnxruntime-gpu)"
        )
    rng = np.random.default_rng(28)
    x = rng.standard_normal((ROWS, WIDTH), dtype=np.float32)
    w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
    model = _model()

    started = time.monotonic()
    session = _session(ort, model, provider)
    session_seconds = time.monotonic() - started
    started = time.monotonic()
    try:
        (answer,) = session.run(None, {"x": x, "w": w})
    except Exception as exc:  # onnxruntime raises its own classes, none of them shared
        raise GpuCheckFailed(f"the model failed on {provider}: {exc}") from None
    infer_seconds = time.monotonic() - started
    (expected,) = _session(ort, model, "CPUExecutionProvider").run(None, {"x": x, "w": w})

    if not np.all(np.isfinite(answer)):
        raise GpuCheckFailed(f"the model's answer on {provider} holds NaN or infinite values")
    difference = float(np.max(np.abs(answer.astype(np.float64) - expected)))
    if difference > TOLERANCE:
        raise GpuCheckFailed(
            f"the model's answer on {provider} differs from the CPU's by up to {difference:.3g} "
            f"(allowed {TOLERANCE:g}): the GPU computes wrongly"
        )
    return {
        "model": f"tanh(x @ w), x {ROWS}x{WIDTH}, w {WIDTH}x{WIDTH}",
        "max_abs_difference": difference,
        "tolerance": TOLERANCE,
        "timings": {"session_s": round(session_seconds, 4), "infer_s": round(infer_seconds, 4)},
    }


def _session(ort: Any, model: bytes, provider: str) -> Any:
    """A session on `provider` alone: no part of the model may fall back to the CPU."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if provider != "CPUExecutionProvider":
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        session = ort.InferenceSession(model, sess_options=options, providers=[provider])
    except Exception as exc:  # onnxruntime raises its own classes, none of them shared
        raise GpuCheckFailed(f"onnxruntime could not start {provider}: {exc}") from None
    if session.get_providers()[0] != provider:
        raise GpuCheckFailed(
            f"onnxruntime could not start {provider} (it runs on {session.get_providers()})"
        )
    return session


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, value: bytes | str | int) -> bytes:
    """One protobuf field: a varint, or length-delimited bytes, text or message."""
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _model() -> bytes:
    """An ONNX model (IR 9, opset 17): y = tanh(x @ w), x (N, WIDTH) and w (WIDTH, WIDTH) both
    inputs, written from onnx.proto's field numbers (ModelProto, GraphProto, NodeProto,
    ValueInfoProto)."""

    def value_info(name: str, rows: str | int) -> bytes:
        first = _field(2, rows) if isinstance(rows, str) else _field(1, rows)
        shape = _field(1, first) + _field(1, _field(1, WIDTH))
        return _field(1, name) + _field(2, _field(1, _field(1, _FLOAT) + _field(2, shape)))

    graph = (
        _field(1, _field(1, "x") + _field(1, "w") + _field(2, "xw") + _field(4, "MatMul"))
        + _field(1, _field(1, "xw") + _field(2, "y") + _field(4, "Tanh"))
        + _field(2, "gpu-check")
        + _field(11, value_info("x", "N"))
        + _field(11, value_info("w", WIDTH))
        + _field(12, value_info("y", "N"))
    )
    return (
        _field(1, 9)
        + _field(2, "modelforge-gpu-check")
        + _field(7, graph)
        + _field(8, _field(2, 17))
    )
