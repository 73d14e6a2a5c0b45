"""The substitute NVML, driven through the unchanged pynvml bindings in a subprocess.

``LD_LIBRARY_PATH`` only takes effect when a process starts, so every check runs a small script
with ``sys.executable -c`` and reads back the JSON it prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.nvml_substitute import (
    CONTROL_ENV,
    CUDA_DRIVER_VERSION,
    CUDA_VERSION,
    DRIVER_VERSION,
    EXPECTED_GPUS,
    EXPECTED_MEMORY_UTILIZATION_PERCENT,
    LIBRARY_NAME,
    SCENARIO_ENV,
    FakeNvmlBuildError,
    FaultInjector,
    build_fake_nvml,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="pynvml loads libnvidia-ml.so.1 only on Linux"
)

MIB = 1024 * 1024

# Shared by every probe: `attempt` turns an NVML call into {"value": ...} or {"error": ...}.
_PRELUDE = """
import json
import pynvml

def attempt(fn, *args, **kwargs):
    try:
        return {"value": fn(*args, **kwargs)}
    except pynvml.NVMLError as exc:
        return {"error": type(exc).__name__, "code": exc.value}

result = {}
"""
_EPILOGUE = "\nprint(json.dumps(result))\n"


@pytest.fixture(scope="module")
def nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))


def _probe_env(
    library_dir: Path | None, scenario: str | None = None, control: Path | None = None
) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(SCENARIO_ENV, None)
    env.pop(CONTROL_ENV, None)
    env.pop("LD_LIBRARY_PATH", None)
    if library_dir is not None:
        inherited = os.environ.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{library_dir}:{inherited}" if inherited else str(library_dir)
    if scenario is not None:
        env[SCENARIO_ENV] = scenario
    if control is not None:
        env[CONTROL_ENV] = str(control)
    return env


def run_probe(
    body: str, library_dir: Path | None, scenario: str | None = None, control: Path | None = None
) -> dict[str, Any]:
    """Run `body` after `_PRELUDE` in a fresh interpreter; return the JSON it leaves in `result`."""
    script = _PRELUDE + textwrap.dedent(body) + _EPILOGUE
    completed = subprocess.run(
        [sys.executable, "-c", script],
        env=_probe_env(library_dir, scenario, control),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    parsed: dict[str, Any] = json.loads(completed.stdout)
    parsed["_stderr"] = completed.stderr
    return parsed


_READ_ALL = """
result["init"] = attempt(pynvml.nvmlInit)
result["driver"] = pynvml.nvmlSystemGetDriverVersion()
result["cuda"] = pynvml.nvmlSystemGetCudaDriverVersion()
result["cuda_v2"] = pynvml.nvmlSystemGetCudaDriverVersion_v2()
result["nvml"] = pynvml.nvmlSystemGetNVMLVersion()
result["count"] = pynvml.nvmlDeviceGetCount()
result["gpus"] = []
for i in range(result["count"]):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    mem2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    util = pynvml.nvmlDeviceGetUtilizationRates(h)
    result["gpus"].append({
        "index": pynvml.nvmlDeviceGetIndex(h),
        "uuid": pynvml.nvmlDeviceGetUUID(h),
        "name": pynvml.nvmlDeviceGetName(h),
        "mem": [mem.total, mem.used, mem.free],
        "mem_v2": [mem2.total, mem2.used, mem2.free, mem2.reserved],
        "util": [util.gpu, util.memory],
        "temp": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
        "temp_v": pynvml.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU),
        "power_mw": pynvml.nvmlDeviceGetPowerUsage(h),
        "limit_mw": pynvml.nvmlDeviceGetEnforcedPowerLimit(h),
        "events": pynvml.nvmlDeviceGetCurrentClocksEventReasons(h),
        "throttle": pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h),
        "ecc": attempt(
            pynvml.nvmlDeviceGetTotalEccErrors,
            h,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        ),
    })
pynvml.nvmlShutdown()
"""


def test_build_puts_the_library_in_the_directory(nvml_dir: Path) -> None:
    assert (nvml_dir / LIBRARY_NAME).is_file()


def test_build_failure_reports_gcc_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("int this_is_not_c(\n")
    monkeypatch.setattr("tests.nvml_substitute.SOURCE", broken)
    with pytest.raises(FakeNvmlBuildError, match=r"gcc failed[\s\S]*broken\.c"):
        build_fake_nvml(tmp_path / "out")


@pytest.mark.parametrize("scenario", [None, "healthy", ""])
def test_healthy_scenario_matches_expected_gpus(nvml_dir: Path, scenario: str | None) -> None:
    result = run_probe(_READ_ALL, nvml_dir, scenario)

    assert result["init"] == {"value": None}
    assert result["driver"] == DRIVER_VERSION
    assert result["cuda"] == result["cuda_v2"] == CUDA_DRIVER_VERSION
    major, minor = divmod(result["cuda"] // 10, 100)
    assert f"{major}.{minor}" == CUDA_VERSION
    assert result["nvml"] == f"12.{DRIVER_VERSION}"
    assert result["count"] == 2

    reported = []
    for index, gpu in enumerate(result["gpus"]):
        assert gpu["index"] == index
        total, used, free = gpu["mem"]
        assert total % MIB == 0 and used % MIB == 0  # NVML reports bytes
        assert free == total - used
        assert gpu["mem_v2"] == [total, used, free, 0]
        assert gpu["util"][1] == EXPECTED_MEMORY_UTILIZATION_PERCENT[index]
        assert gpu["temp_v"] == gpu["temp"]
        assert gpu["events"] == gpu["throttle"] == 0
        assert gpu["ecc"] == {"error": "NVMLError_NotSupported", "code": 3}
        reported.append(
            {
                "uuid": gpu["uuid"],
                "name": gpu["name"],
                "memory_total_mb": total // MIB,
                "memory_used_mb": used // MIB,
                "utilization_percent": gpu["util"][0],
                "temperature_c": gpu["temp"],
                "power_draw_w": gpu["power_mw"] / 1000,
                "power_limit_w": gpu["limit_mw"] / 1000,
            }
        )
    assert reported == EXPECTED_GPUS


def test_no_devices_scenario_has_zero_gpus(nvml_dir: Path) -> None:
    body = """
    pynvml.nvmlInit()
    result["count"] = pynvml.nvmlDeviceGetCount()
    result["handle0"] = attempt(pynvml.nvmlDeviceGetHandleByIndex, 0)
    result["driver"] = pynvml.nvmlSystemGetDriverVersion()
    """
    result = run_probe(body, nvml_dir, "no_devices")
    assert result["count"] == 0
    assert result["handle0"] == {"error": "NVMLError_InvalidArgument", "code": 2}
    assert result["driver"] == DRIVER_VERSION


def test_telemetry_fail_scenario_enumerates_but_cannot_read_telemetry(nvml_dir: Path) -> None:
    body = """
    pynvml.nvmlInit()
    result["count"] = pynvml.nvmlDeviceGetCount()
    result["gpus"] = []
    for i in range(result["count"]):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        try:
            pynvml.nvmlDeviceGetUtilizationRates(h)
            util_raised = None
        except pynvml.NVMLError as exc:
            util_raised = type(exc).__name__
        result["gpus"].append({
            "uuid": pynvml.nvmlDeviceGetUUID(h),
            "name": pynvml.nvmlDeviceGetName(h),
            "memory_total": pynvml.nvmlDeviceGetMemoryInfo(h).total,
            "limit_mw": pynvml.nvmlDeviceGetEnforcedPowerLimit(h),
            "util_raised": util_raised,
            "temp": attempt(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU),
            "temp_v": attempt(pynvml.nvmlDeviceGetTemperatureV, h, pynvml.NVML_TEMPERATURE_GPU),
            "power": attempt(pynvml.nvmlDeviceGetPowerUsage, h),
        })
    """
    result = run_probe(body, nvml_dir, "telemetry_fail")
    assert result["count"] == 2
    unknown = {"error": "NVMLError_Unknown", "code": 999}
    for gpu, expected in zip(result["gpus"], EXPECTED_GPUS, strict=True):
        assert gpu["uuid"] == expected["uuid"]
        assert gpu["name"] == expected["name"]
        assert gpu["memory_total"] == expected["memory_total_mb"] * MIB
        assert gpu["limit_mw"] / 1000 == expected["power_limit_w"]
        assert gpu["util_raised"] == "NVMLError_Unknown"  # a subclass of pynvml.NVMLError
        assert gpu["temp"] == gpu["temp_v"] == gpu["power"] == unknown


def test_init_fail_scenario_raises_driver_not_loaded(nvml_dir: Path) -> None:
    body = """
    try:
        pynvml.nvmlInit()
        result["init"] = "ok"
    except pynvml.NVMLError_DriverNotLoaded as exc:
        result["init"] = ["NVMLError_DriverNotLoaded", exc.value, str(exc)]
    result["count"] = attempt(pynvml.nvmlDeviceGetCount)
    """
    result = run_probe(body, nvml_dir, "init_fail")
    assert result["init"] == ["NVMLError_DriverNotLoaded", 9, "Driver Not Loaded"]
    # The library is loaded but not initialised: it answers NVML_ERROR_UNINITIALIZED itself.
    assert result["count"] == {"error": "NVMLError_Uninitialized", "code": 1}


def test_unknown_scenario_fails_init_loudly(nvml_dir: Path) -> None:
    result = run_probe('result["init"] = attempt(pynvml.nvmlInit)', nvml_dir, "helthy")
    assert result["init"] == {"error": "NVMLError_Unknown", "code": 999}
    assert "unknown MODELFORGE_FAKE_NVML_SCENARIO 'helthy'" in result["_stderr"]


def test_init_is_reference_counted_and_shutdown_uninitialises(nvml_dir: Path) -> None:
    body = """
    pynvml.nvmlInit()
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    result["after_one_shutdown"] = attempt(pynvml.nvmlDeviceGetCount)
    pynvml.nvmlShutdown()
    result["after_two"] = attempt(pynvml.nvmlDeviceGetCount)
    result["driver"] = attempt(pynvml.nvmlSystemGetDriverVersion)
    result["third_shutdown"] = attempt(pynvml.nvmlShutdown)
    """
    result = run_probe(body, nvml_dir)
    uninitialized = {"error": "NVMLError_Uninitialized", "code": 1}
    assert result["after_one_shutdown"] == {"value": 2}
    assert result["after_two"] == result["driver"] == result["third_shutdown"] == uninitialized


def test_without_the_library_pynvml_reports_library_not_found() -> None:
    result = run_probe('result["init"] = attempt(pynvml.nvmlInit)', library_dir=None)
    if result["init"] == {"value": None}:
        pytest.skip("a real libnvidia-ml.so.1 is installed on this machine")
    assert result["init"] == {"error": "NVMLError_LibraryNotFound", "code": 12}


# ---- Injected faults (the control file) ----

_PAUSE = """
import sys
import time

def pause(name):
    # Tell the test where this process stands, then wait until it has injected what it wants.
    print(json.dumps({"paused": name}), flush=True)
    sys.stdin.readline()
"""

_LOST = {"error": "NVMLError_GpuIsLost", "code": 15}
_TIMEOUT = {"error": "NVMLError_Timeout", "code": 10}


class Probe:
    """A probe process that stops at each `pause(name)` until the test resumes it."""

    def __init__(self, body: str, library_dir: Path, control: Path) -> None:
        script = _PRELUDE + _PAUSE + textwrap.dedent(body) + _EPILOGUE
        self.process = subprocess.Popen(
            [sys.executable, "-c", script],
            env=_probe_env(library_dir, control=control),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def reached(self, name: str) -> None:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line == "":
            _, stderr = self.process.communicate(timeout=60)
            pytest.fail(f"the probe exited before pausing at {name!r}:\n{stderr}")
        assert json.loads(line) == {"paused": name}

    def resume(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()

    def finish(self) -> dict[str, Any]:
        stdout, stderr = self.process.communicate(timeout=60)
        assert self.process.returncode == 0, stderr
        parsed: dict[str, Any] = json.loads(stdout)
        parsed["_stderr"] = stderr
        return parsed

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


@pytest.fixture
def control(tmp_path: Path) -> Path:
    return tmp_path / "nvml-control"


@pytest.fixture
def probes() -> Iterator[list[Probe]]:
    started: list[Probe] = []
    yield started
    for probe in started:
        probe.kill()


_EVENT = """
def event(data):
    return {
        "index": pynvml.nvmlDeviceGetIndex(data.device),
        "type": data.eventType,
        "code": data.eventData,
        "instances": [data.gpuInstanceId, data.computeInstanceId],
    }
"""


def test_xid_reaches_a_waiting_event_set_within_100_ms(
    nvml_dir: Path, control: Path, probes: list[Probe]
) -> None:
    # Another thread queries both GPUs all along: the agent watches events and reads telemetry
    # on different threads, so the library must serve both at once.
    body = _EVENT + textwrap.dedent(
        """
    import threading
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    events = pynvml.nvmlEventSetCreate()
    result["supported"] = pynvml.nvmlDeviceGetSupportedEventTypes(handles[1])
    for handle in handles:
        pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
    stop = threading.Event()
    reads = []
    def query():
        while not stop.is_set():
            for handle in handles:
                pynvml.nvmlDeviceGetUtilizationRates(handle)
                reads.append(pynvml.nvmlDeviceGetUUID(handle))
    reader = threading.Thread(target=query)
    reader.start()
    started = time.monotonic()
    result["idle"] = attempt(pynvml.nvmlEventSetWait_v2, events, 50)
    result["idle_s"] = time.monotonic() - started
    pause("registered")
    first = pynvml.nvmlEventSetWait_v2(events, 5000)
    result["delivered_at"] = time.monotonic()
    result["first"] = event(first)
    result["second"] = event(pynvml.nvmlEventSetWait_v2(events, 1000))
    result["third"] = attempt(pynvml.nvmlEventSetWait_v2, events, 20)
    stop.set()
    reader.join()
    result["reads"] = len(reads)
    pynvml.nvmlEventSetFree(events)
    """
    )
    probe = Probe(body, nvml_dir, control)
    probes.append(probe)
    probe.reached("registered")
    injected_at = time.monotonic()  # CLOCK_MONOTONIC: the same clock in both processes
    injector = FaultInjector(control)
    injector.xid(1, 79)
    injector.xid(0, 48)
    probe.resume()
    result = probe.finish()

    assert result["supported"] & 0x8  # nvmlEventTypeXidCriticalError
    assert result["idle"] == _TIMEOUT
    assert result["idle_s"] >= 0.05
    latency = result["delivered_at"] - injected_at
    assert latency < 0.1, f"the XID arrived {latency:.3f} s after it was written"
    no_instance = [0xFFFFFFFF, 0xFFFFFFFF]
    assert result["first"] == {"index": 1, "type": 0x8, "code": 79, "instances": no_instance}
    assert result["second"] == {"index": 0, "type": 0x8, "code": 48, "instances": no_instance}
    assert result["third"] == _TIMEOUT
    assert result["reads"] > 0
    assert result["_stderr"] == ""


def test_xid_read_before_registration_or_for_another_gpu_is_not_delivered(
    nvml_dir: Path, control: Path, probes: list[Probe]
) -> None:
    body = _EVENT + textwrap.dedent(
        """
    pynvml.nvmlInit()
    gpu0 = pynvml.nvmlDeviceGetHandleByIndex(0)
    events = pynvml.nvmlEventSetCreate()
    pause("created")
    pynvml.nvmlDeviceRegisterEvents(gpu0, pynvml.nvmlEventTypeXidCriticalError, events)
    result["before"] = attempt(pynvml.nvmlEventSetWait_v2, events, 200)
    pause("registered")
    result["after"] = event(pynvml.nvmlEventSetWait_v2(events, 5000))
    result["then"] = attempt(pynvml.nvmlEventSetWait, events, 100)
    """
    )
    probe = Probe(body, nvml_dir, control)
    probes.append(probe)
    injector = FaultInjector(control)
    probe.reached("created")
    injector.xid(0, 79)  # the set exists but has not registered for XIDs yet
    probe.resume()
    probe.reached("registered")
    injector.xid(1, 79)  # a GPU this set did not register
    injector.xid(0, 43)
    probe.resume()
    result = probe.finish()

    assert result["before"] == _TIMEOUT
    assert {k: result["after"][k] for k in ("index", "code")} == {"index": 0, "code": 43}
    assert result["then"] == _TIMEOUT


_EVERY_DEVICE_CALL = """
def every_device_call(handle, events):
    return {
        "uuid": attempt(pynvml.nvmlDeviceGetUUID, handle),
        "name": attempt(pynvml.nvmlDeviceGetName, handle),
        "index": attempt(pynvml.nvmlDeviceGetIndex, handle),
        "memory": attempt(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).total),
        "util": attempt(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        "temp": attempt(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
        "power": attempt(pynvml.nvmlDeviceGetPowerUsage, handle),
        "limit": attempt(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle),
        "ecc": attempt(pynvml.nvmlDeviceGetTotalEccErrors, handle, 1, 0),
        "clocks": attempt(pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle),
        "remap": attempt(pynvml.nvmlDeviceGetRemappedRows, handle),
        "retired": attempt(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle),
        "supported": attempt(pynvml.nvmlDeviceGetSupportedEventTypes, handle),
        "register": attempt(pynvml.nvmlDeviceRegisterEvents, handle, 8, events),
    }
"""


def test_a_lost_gpu_fails_every_device_call_until_found_or_reset(
    nvml_dir: Path, control: Path, probes: list[Probe]
) -> None:
    body = _EVERY_DEVICE_CALL + textwrap.dedent(
        """
    pynvml.nvmlInit()
    gpu0, gpu1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
    events = pynvml.nvmlEventSetCreate()
    pause("ready")
    result["lost"] = every_device_call(gpu0, events)
    try:
        pynvml.nvmlDeviceGetUUID(gpu0)
    except pynvml.NVMLError_GpuIsLost as exc:
        result["message"] = str(exc)
    result["error_string"] = pynvml.nvmlErrorString(15)
    result["timeout_string"] = pynvml.nvmlErrorString(10)
    result["other"] = every_device_call(gpu1, events)
    result["count"] = pynvml.nvmlDeviceGetCount()
    result["lookup"] = attempt(lambda: pynvml.nvmlDeviceGetHandleByIndex(0) is not None)
    result["wait"] = attempt(pynvml.nvmlEventSetWait_v2, events, 10)
    pause("lost")
    result["found"] = every_device_call(gpu0, events)
    pause("found")
    result["reset"] = every_device_call(gpu0, events)
    """
    )
    probe = Probe(body, nvml_dir, control)
    probes.append(probe)
    injector = FaultInjector(control)
    probe.reached("ready")
    injector.lose(0)
    probe.resume()
    probe.reached("lost")
    injector.find(0)
    probe.resume()
    probe.reached("found")
    injector.lose(0)
    injector.reset(0)
    probe.resume()
    result = probe.finish()

    assert result["lost"] == dict.fromkeys(result["lost"], _LOST)
    assert result["message"] == result["error_string"] == "GPU is lost"
    assert result["timeout_string"] == "Timeout"
    for answers in (result["other"], result["found"], result["reset"]):
        failing = {call: answer for call, answer in answers.items() if "error" in answer}
        assert failing == {"ecc": {"error": "NVMLError_NotSupported", "code": 3}}
    assert result["found"]["uuid"] == {"value": EXPECTED_GPUS[0]["uuid"]}
    assert result["count"] == 2
    assert result["lookup"] == _LOST  # as real NVML: no handle for a GPU off the bus
    assert result["wait"] == _TIMEOUT


_READ_HEALTH = """
def health(handle):
    return {
        "ecc": {
            f"{kind}_{counter}": attempt(pynvml.nvmlDeviceGetTotalEccErrors, handle, k, c)
            for kind, k in (("corrected", 0), ("uncorrected", 1))
            for counter, c in (("volatile", 0), ("aggregate", 1))
        },
        "remap": list(pynvml.nvmlDeviceGetRemappedRows(handle)),
        "retired_pending": pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle),
        "throttle": pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle),
        "throttle_old_name": pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle),
    }

pynvml.nvmlInit()
result["gpus"] = [health(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
"""


def _ecc(cv: int, ca: int, uv: int, ua: int) -> dict[str, Any]:
    return {
        "corrected_volatile": {"value": cv},
        "corrected_aggregate": {"value": ca},
        "uncorrected_volatile": {"value": uv},
        "uncorrected_aggregate": {"value": ua},
    }


def test_health_counters_read_back_what_was_set(nvml_dir: Path, control: Path) -> None:
    injector = FaultInjector(control)
    injector.ecc(0, "uncorrected", "volatile", 2)
    injector.ecc(0, "uncorrected", "aggregate", 7)
    injector.ecc(0, "corrected", "volatile", 1000)
    injector.remap(0, 3, 1, pending=True, failure=False)
    injector.retired_pending(0, True)
    injector.throttle(0, 0x88)  # hardware slowdown | sync boost

    result = run_probe(_READ_HEALTH, nvml_dir, control=control)

    gpu0, gpu1 = result["gpus"]
    assert gpu0["ecc"] == _ecc(1000, 0, 2, 7)
    assert gpu0["remap"] == [3, 1, 1, 0]
    assert gpu0["retired_pending"] == 1
    assert gpu0["throttle"] == gpu0["throttle_old_name"] == 0x88
    # GPU 1 was not touched: ECC stays unsupported, the rest reads clean.
    not_supported = {"error": "NVMLError_NotSupported", "code": 3}
    assert gpu1["ecc"] == dict.fromkeys(gpu1["ecc"], not_supported)
    assert gpu1["remap"] == [0, 0, 0, 0]
    assert gpu1["retired_pending"] == 0
    assert gpu1["throttle"] == 0
    assert result["_stderr"] == ""


def test_reset_clears_volatile_state_but_keeps_aggregate_counts(
    nvml_dir: Path, control: Path
) -> None:
    injector = FaultInjector(control)
    injector.ecc(1, "uncorrected", "volatile", 2)
    injector.ecc(1, "uncorrected", "aggregate", 9)
    injector.ecc(1, "corrected", "volatile", 40)
    injector.ecc(1, "corrected", "aggregate", 400)
    injector.remap(1, 5, 2, pending=True, failure=True)
    injector.retired_pending(1, True)
    injector.throttle(1, 0x40)
    injector.lose(1)
    injector.reset(1)

    result = run_probe(_READ_HEALTH, nvml_dir, control=control)

    gpu1 = result["gpus"][1]
    assert gpu1["ecc"] == _ecc(0, 400, 0, 9)
    assert gpu1["remap"] == [5, 2, 0, 1]  # the failure needs more than a reset
    assert gpu1["retired_pending"] == 0
    assert gpu1["throttle"] == 0


def test_every_process_sees_state_lines_and_each_registered_set_gets_the_xid(
    nvml_dir: Path, control: Path, probes: list[Probe]
) -> None:
    body = (
        _EVENT
        + _READ_HEALTH
        + textwrap.dedent(
            """
    events = pynvml.nvmlEventSetCreate()
    gpu1 = pynvml.nvmlDeviceGetHandleByIndex(1)
    pynvml.nvmlDeviceRegisterEvents(gpu1, pynvml.nvmlEventTypeXidCriticalError, events)
    pause("ready")
    result["event"] = event(pynvml.nvmlEventSetWait_v2(events, 5000))
    result["gpus"] = [health(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
    """
        )
    )
    both = [Probe(body, nvml_dir, control), Probe(body, nvml_dir, control)]
    probes.extend(both)
    for probe in both:
        probe.reached("ready")
    injector = FaultInjector(control)
    injector.throttle(1, 0x20)
    injector.ecc(1, "uncorrected", "volatile", 1)
    injector.xid(1, 94)
    for probe in both:
        probe.resume()

    for result in (probe.finish() for probe in both):
        assert {k: result["event"][k] for k in ("index", "code")} == {"index": 1, "code": 94}
        assert result["gpus"][1]["throttle"] == 0x20
        assert result["gpus"][1]["ecc"]["uncorrected_volatile"] == {"value": 1}
        assert result["gpus"][0]["throttle"] == 0


def test_malformed_lines_are_ignored_with_one_message_each(nvml_dir: Path, control: Path) -> None:
    control.write_text(
        "".join(f"throttle 1 {mask}\n" for mask in range(100))  # more than one read of the file
        + "bogus 0\n"
        "xid 2 79\n"  # there are two GPUs: 0 and 1
        "ecc 0 corrected sometimes 3\n"
        "throttle 0 -1\n"
        "remap 0 1 2 3 0\n"  # pending is 0 or 1
        "lost\n"
        "\n"
        + "#"
        * 1000  # a line longer than the library reads is malformed, even as a comment
        + "\n"
        "throttle 1 4\n"
        "throttle 0 8"  # no newline yet: a line still being written is not read
    )
    result = run_probe(_READ_HEALTH, nvml_dir, control=control)

    messages = result["_stderr"].strip().splitlines()
    assert len(messages) == 7
    assert all(m.startswith("fake NVML: ignoring malformed line '") for m in messages)
    assert "'ecc 0 corrected sometimes 3'" in messages[2]
    assert result["gpus"][1]["throttle"] == 4
    assert result["gpus"][0]["throttle"] == 0
    assert result["gpus"][0]["remap"] == [0, 0, 0, 0]


def test_fault_injector_writes_one_line_per_call(control: Path) -> None:
    injector = FaultInjector(control)
    injector.xid(0, 79)
    injector.lose(1)
    injector.find(1)
    injector.ecc(0, "corrected", "aggregate", 12)
    injector.remap(1, 2, 3, pending=False, failure=True)
    injector.retired_pending(0, False)
    injector.throttle(1, 0x8)
    injector.reset(0)
    assert control.read_text().splitlines() == [
        "xid 0 79",
        "lost 1",
        "found 1",
        "ecc 0 corrected aggregate 12",
        "remap 1 2 3 0 1",
        "retired_pending 0 0",
        "throttle 1 8",
        "reset 0",
    ]
    with pytest.raises(ValueError, match="volatile or aggregate"):
        injector.ecc(0, "corrected", "forever", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        injector.throttle(0, -1)
    assert len(control.read_text().splitlines()) == 8
