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
NVML cannot read can be shown to stay absent, and the current clock event (throttle) reasons are 0,
until a fault below changes them.

Faults are injected into running processes through a control file: set ``CONTROL_ENV`` to its path
in the subprocess's environment (read at the first ``nvmlInit``; unset, or a file not written yet:
no faults) and append lines with ``FaultInjector(path)``. Each process keeps its own read offset
and reads the new complete lines at ``nvmlInit``, at every device query and every ~5 ms while
``nvmlEventSetWait`` waits. State lines apply in every process that reads them. One method per line
(``index`` is the NVML device index):

``xid(index, code)``
    an XID critical error: queued to every event set registered (``nvmlDeviceRegisterEvents`` with
    ``nvmlEventTypeXidCriticalError`` on that GPU) when the line is read, and returned in order,
    one per ``nvmlEventSetWait_v2`` call (``eventType`` ``nvmlEventTypeXidCriticalError``,
    ``eventData`` the code, ``device`` the GPU's handle, the instance ids ``0xFFFFFFFF``). A set
    registered later never sees it. A wait with nothing queued returns ``NVML_ERROR_TIMEOUT`` (10)
    after its timeout. ``nvmlDeviceGetSupportedEventTypes`` answers single/double bit ECC, P-state,
    XID and clock events (registering any other type is ``NVML_ERROR_NOT_SUPPORTED``); only XID
    events are ever generated.
``lose(index)`` / ``find(index)``
    the GPU falls off the bus / comes back: meanwhile every per-device call on it returns
    ``NVML_ERROR_GPU_IS_LOST`` (15), and so does looking its handle up by index, as real NVML
    answers for a GPU that fell off the bus (a handle looked up before stays valid). The device
    count and waiting on an event set keep working.
``ecc(index, kind, counter, count)``
    sets one ECC counter (``kind`` ``corrected`` | ``uncorrected``, ``counter`` ``volatile`` |
    ``aggregate``); from then on ``nvmlDeviceGetTotalEccErrors`` answers on that GPU (the counters
    not set read 0).
``remap(index, corrected, uncorrected, pending, failure)``
    what ``nvmlDeviceGetRemappedRows`` returns (default 0, 0, 0, 0).
``retired_pending(index, pending)``
    what ``nvmlDeviceGetRetiredPagesPendingStatus`` returns (default 0).
``throttle(index, mask)``
    the current clocks event (throttle) reasons bit mask (default 0).
``reset(index)``
    a GPU reset: clears lost, the volatile ECC counters, the pending remap and retired pages and
    the throttle mask; the aggregate ECC counters, remapped row counts and a remap failure stay.

A malformed line (unknown command, wrong arguments, a GPU index out of range, longer than 255
bytes) is ignored with one message on stderr; a last line without its newline waits for it. The
library guards its state with a mutex: one thread may wait on an event set while others query
devices.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Literal

SCENARIO_ENV = "MODELFORGE_FAKE_NVML_SCENARIO"
SCENARIOS = ("healthy", "no_devices", "telemetry_fail", "init_fail")
CONTROL_ENV = "MODELFORGE_FAKE_NVML_CONTROL"

SOURCE = Path(__file__).with_name("fake_nvml.c")
LIBRARY_NAME = "libnvidia-ml.so.1"
CFLAGS = ("-shared", "-fPIC", "-pthread", "-O2", "-Wall", "-Wextra", "-Werror")

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


class FaultInjector:
    """Appends fault lines to the control file that processes using the substitute read.

    Each method writes exactly one line with a single ``os.write`` on an ``O_APPEND`` descriptor,
    so a reader never sees half of it and lines from several writers never interleave.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def xid(self, index: int, code: int) -> None:
        self._append("xid", index, code)

    def lose(self, index: int) -> None:
        self._append("lost", index)

    def find(self, index: int) -> None:
        self._append("found", index)

    def ecc(
        self,
        index: int,
        kind: Literal["corrected", "uncorrected"],
        counter: Literal["volatile", "aggregate"],
        count: int,
    ) -> None:
        if kind not in ("corrected", "uncorrected"):
            raise ValueError(f"ECC kind must be corrected or uncorrected, not {kind!r}")
        if counter not in ("volatile", "aggregate"):
            raise ValueError(f"ECC counter must be volatile or aggregate, not {counter!r}")
        self._append("ecc", index, kind, counter, count)

    def remap(
        self, index: int, corrected: int, uncorrected: int, pending: bool, failure: bool
    ) -> None:
        self._append("remap", index, corrected, uncorrected, int(pending), int(failure))

    def retired_pending(self, index: int, pending: bool) -> None:
        self._append("retired_pending", index, int(pending))

    def throttle(self, index: int, mask: int) -> None:
        self._append("throttle", index, mask)

    def reset(self, index: int) -> None:
        self._append("reset", index)

    def _append(self, command: str, *args: int | str) -> None:
        for arg in args:
            if isinstance(arg, int) and (isinstance(arg, bool) or arg < 0):
                raise ValueError(f"{command}: arguments are non-negative integers, not {arg!r}")
        line = " ".join((command, *map(str, args))).encode() + b"\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            written = os.write(fd, line)
        finally:
            os.close(fd)
        if written != len(line):
            raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
