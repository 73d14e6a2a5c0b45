"""NVIDIA preflight: decides before enrollment whether this node may report at all.

`nvidia` requires NVML, at least one GPU and telemetry from every GPU; `cpu` needs no NVML;
`auto` requires NVML only when NVIDIA devices or `NVIDIA_VISIBLE_DEVICES` are observed. A failure
has exactly one code and the agent exits with code 3 without sending anything. Bounded in time,
no network.
"""

from __future__ import annotations

import glob
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from node_agent.nvml import GpuInfo

EXIT_PREFLIGHT = 3
FailureCode = Literal[
    "NVIDIA_NVML_UNAVAILABLE", "NVIDIA_DEVICE_NOT_FOUND", "NVIDIA_TELEMETRY_UNAVAILABLE"
]

_NEXT_STEPS: dict[str, str] = {
    "NVIDIA_NVML_UNAVAILABLE": "Install the NVIDIA driver on the host and run the agent with the "
    "NVIDIA Container Toolkit (GPU device reservation), which injects libnvidia-ml.so.1; on a "
    "CPU-only node set MODELFORGE_AGENT_ACCELERATOR_MODE=cpu.",
    "NVIDIA_DEVICE_NOT_FOUND": "Check `nvidia-smi` on the host and that the container is given "
    "the GPUs (device reservation or NVIDIA_VISIBLE_DEVICES).",
    "NVIDIA_TELEMETRY_UNAVAILABLE": "Check `nvidia-smi -q` on the host; a GPU that cannot report "
    "utilisation, memory and temperature is not healthy enough to take work.",
}


@dataclass
class PreflightResult:
    requested_mode: str
    mode: Literal["nvidia", "cpu"]
    ok: bool
    code: FailureCode | None = None
    message: str = ""
    gpus: list[GpuInfo] = field(default_factory=list)

    @property
    def next_step(self) -> str:
        return _NEXT_STEPS.get(self.code or "", "")

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "requested_mode": self.requested_mode,
            "mode": self.mode,
            "code": self.code,
            "message": self.message,
            "next_step": self.next_step or None,
            "gpus": [g.inventory() for g in self.gpus],
        }

    def report(self) -> str:
        lines = [f"ModelForge node agent preflight (mode {self.requested_mode} -> {self.mode})"]
        for gpu in self.gpus:
            lines.append(f"  GPU {gpu.index}: {gpu.name} {gpu.uuid}")
        if self.ok:
            lines.append("  result: PASSED")
        else:
            lines.append(f"  result: FAILED {self.code}: {self.message}")
            lines.append(f"  next step: {self.next_step}")
        return "\n".join(lines)


def nvidia_observed() -> bool:
    visible = os.environ.get("NVIDIA_VISIBLE_DEVICES", "").strip().lower()
    if visible and visible not in ("void", "none"):
        return True
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def run_preflight(requested_mode: str, *, timeout: float) -> PreflightResult:
    if requested_mode == "cpu" or (requested_mode == "auto" and not nvidia_observed()):
        return PreflightResult(requested_mode, "cpu", ok=True, message="NVML not required")
    outcome: list[PreflightResult] = []
    worker = threading.Thread(
        target=lambda: outcome.append(_check_nvidia(requested_mode)), daemon=True
    )
    worker.start()
    worker.join(timeout)
    if not outcome:
        return PreflightResult(
            requested_mode,
            "nvidia",
            ok=False,
            code="NVIDIA_NVML_UNAVAILABLE",
            message=f"NVML did not answer within {timeout:g} s",
        )
    return outcome[0]


def _check_nvidia(requested_mode: str) -> PreflightResult:
    # Imported here: a cpu-mode agent never loads the NVML bindings (memory footprint).
    import pynvml

    from node_agent.nvml import Nvml, NvmlUnavailable

    def fail(code: FailureCode, message: str, gpus: list[GpuInfo] | None = None) -> PreflightResult:
        return PreflightResult(requested_mode, "nvidia", False, code, message, gpus or [])

    try:
        with Nvml() as nvml:
            try:
                gpus = nvml.gpus()
            except pynvml.NVMLError as exc:
                return fail("NVIDIA_DEVICE_NOT_FOUND", f"cannot enumerate GPUs: {exc}")
            if not gpus:
                return fail("NVIDIA_DEVICE_NOT_FOUND", "NVML reports no GPU")
            for gpu in gpus:
                try:
                    nvml.telemetry(gpu.index, gpu.uuid, strict=True)
                except pynvml.NVMLError as exc:
                    return fail(
                        "NVIDIA_TELEMETRY_UNAVAILABLE",
                        f"GPU {gpu.index} ({gpu.uuid}) returned no telemetry: {exc}",
                        gpus,
                    )
    except NvmlUnavailable as exc:
        return fail("NVIDIA_NVML_UNAVAILABLE", f"NVML could not be loaded or initialised: {exc}")
    return PreflightResult(requested_mode, "nvidia", True, None, f"{len(gpus)} GPU(s)", gpus)
