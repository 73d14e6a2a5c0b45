"""A substitute NVML for tests: a real shared library standing in for ``libnvidia-ml.so.1``.

The substitution happens at the lowest level. ``fake_nvml.c`` is compiled into a file named
``libnvidia-ml.so.1``; a process started with that file's directory on ``LD_LIBRARY_PATH`` loads
it when the unchanged ``pynvml`` bindings call ``CDLL("libnvidia-ml.so.1")``. Everything above the
C ABI (pynvml, the node agent) is the real code. ``LD_LIBRARY_PATH`` is read only when a process
starts, so use it in a subprocess, never by changing ``os.environ`` of the test process.

The environment variable ``SCENARIO_ENV`` (read at ``nvmlInit``) picks the behaviour:

``healthy`` (default, also when unset or empty)
    two GPUs, with the values of ``EXPECTED_GPUS``, ``DRIVER_VERSION`` and ``CUDA_VERSION``.
``no_devices``
    init succeeds, ``nvmlDeviceGetCount`` is 0.
``telemetry_fail``
    the same two GPUs are enumerated (UUID, name, index, memory and enforced power limit work),
    but utilisation, temperature and power usage fail with ``NVML_ERROR_UNKNOWN`` (999).
``init_fail``
    ``nvmlInit`` fails with ``NVML_ERROR_DRIVER_NOT_LOADED`` (9).

Any other value makes ``nvmlInit`` fail with ``NVML_ERROR_UNKNOWN`` and a message on stderr.
In every scenario ``nvmlDeviceGetTotalEccErrors`` is ``NVML_ERROR_NOT_SUPPORTED`` (3), so a field
NVML cannot read can be shown to stay absent, and the current clock event (throttle) reasons are 0.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

SCENARIO_ENV = "MODELFORGE_FAKE_NVML_SCENARIO"
SCENARIOS = ("healthy", "no_devices", "telemetry_fail", "init_fail")

SOURCE = Path(__file__).with_name("fake_nvml.c")
LIBRARY_NAME = "libnvidia-ml.so.1"
CFLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror")

DRIVER_VERSION = "560.35.03"
CUDA_DRIVER_VERSION = 12060  # the raw nvmlSystemGetCudaDriverVersion value: 1000*major + 10*minor
CUDA_VERSION = "12.6"

# The healthy scenario as an agent would report it: memory in MiB (NVML gives bytes), power in
# watts (NVML gives milliwatts), utilisation is the GPU (not memory) percentage. Index = position.
EXPECTED_GPUS: list[dict[str, Any]] = [
    {
        "uuid": "GPU-11111111-2222-3333-4444-555555555555",
        "name": "NVIDIA Fake H200",
        "memory_total_mb": 143771,
        "memory_used_mb": 1024,
        "utilization_percent": 37,
        "temperature_c": 41,
        "power_draw_w": 120.5,
        "power_limit_w": 700.0,
    },
    {
        "uuid": "GPU-66666666-7777-8888-9999-000000000000",
        "name": "NVIDIA Fake H200",
        "memory_total_mb": 143771,
        "memory_used_mb": 2048,
        "utilization_percent": 61,
        "temperature_c": 55,
        "power_draw_w": 250.25,
        "power_limit_w": 700.0,
    },
]

# The memory-controller utilisation (nvmlUtilization_t.memory) of each healthy GPU, in percent.
EXPECTED_MEMORY_UTILIZATION_PERCENT = [12, 20]


class FakeNvmlBuildError(RuntimeError):
    """gcc is missing or could not compile fake_nvml.c."""


def build_fake_nvml(directory: Path) -> Path:
    """Compile the substitute into ``directory/libnvidia-ml.so.1`` and return ``directory``.

    Put the returned directory on ``LD_LIBRARY_PATH`` of a subprocess.
    """
    gcc = shutil.which("gcc")
    if gcc is None:
        raise FakeNvmlBuildError("gcc is not on PATH: cannot build the substitute NVML library")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / LIBRARY_NAME
    command = [gcc, *CFLAGS, f"-Wl,-soname,{LIBRARY_NAME}", "-o", str(target), str(SOURCE)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise FakeNvmlBuildError(
            f"gcc failed (exit {result.returncode}) building {target} from {SOURCE}:\n"
            f"{result.stderr.strip()}"
        )
    return directory
