"""Reading GPUs through NVML with the official bindings (`nvidia-ml-py`).

A value NVML cannot read is left out (None), never replaced by zero. The library is the
one the NVIDIA Container Toolkit injects (`libnvidia-ml.so.1`); the image bundles none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import pynvml

T = TypeVar("T")
_MIB = 1024 * 1024


class NvmlUnavailable(Exception):
    """NVML could not be loaded or initialised."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_total_mb: float | None
    driver_version: str | None
    cuda_version: str | None

    def inventory(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _optional(read: Callable[[], T]) -> T | None:
    try:
        return read()
    except pynvml.NVMLError:
        return None


class Nvml:
    """An initialised NVML session. Use as a context manager."""

    def __enter__(self) -> Nvml:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(str(exc)) from None
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass

    def device_count(self) -> int:
        return int(pynvml.nvmlDeviceGetCount())

    def gpus(self) -> list[GpuInfo]:
        driver = _optional(lambda: text(pynvml.nvmlSystemGetDriverVersion()))
        cuda_raw = _optional(pynvml.nvmlSystemGetCudaDriverVersion)
        cuda = f"{cuda_raw // 1000}.{(cuda_raw % 1000) // 10}" if cuda_raw else None
        gpus = []
        for index in range(self.device_count()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = _optional(partial(pynvml.nvmlDeviceGetMemoryInfo, handle))
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=text(pynvml.nvmlDeviceGetUUID(handle)),
                    name=text(pynvml.nvmlDeviceGetName(handle)),
                    memory_total_mb=round(memory.total / _MIB, 1) if memory else None,
                    driver_version=driver,
                    cuda_version=cuda,
                )
            )
        return gpus

    def telemetry(self, index: int, uuid: str, *, strict: bool = False) -> dict[str, Any]:
        """One GPU's telemetry. With `strict`, a failing core reading raises `NVMLError`.
        Otherwise a GPU NVML cannot hand out (real NVML answers GPU_IS_LOST to the lookup of
        a GPU that fell off the bus) has its index and UUID alone: the other GPUs' readings
        still go out, and the missing ones say it."""
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError:
            if strict:
                raise
            return {"index": index, "uuid": uuid}

        def core(read: Callable[[], T]) -> T | None:
            return read() if strict else _optional(read)

        utilization = core(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
        memory = core(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
        temperature = core(
            lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        )
        power = _optional(lambda: pynvml.nvmlDeviceGetPowerUsage(handle))
        limit = _optional(lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle))
        ecc_corrected = _optional(
            lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        )
        ecc_uncorrected = _optional(
            lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        )
        reasons = _optional(lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
        sample: dict[str, Any] = {
            "index": index,
            "uuid": uuid,
            "utilization_percent": float(utilization.gpu) if utilization else None,
            "memory_used_mb": round(memory.used / _MIB, 1) if memory else None,
            "memory_total_mb": round(memory.total / _MIB, 1) if memory else None,
            "temperature_c": float(temperature) if temperature is not None else None,
            "power_draw_w": power / 1000 if power is not None else None,
            "power_limit_w": limit / 1000 if limit is not None else None,
            "ecc_volatile_corrected": ecc_corrected,
            "ecc_volatile_uncorrected": ecc_uncorrected,
            "throttle_reasons": _throttle_names(reasons) if reasons is not None else None,
        }
        return {k: v for k, v in sample.items() if v is not None}


_THROTTLE_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


def _throttle_names(mask: int) -> list[str]:
    return [name for name, bit in _THROTTLE_BITS.items() if mask & bit]
