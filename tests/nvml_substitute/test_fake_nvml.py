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
from pathlib import Path
from typing import Any

import pytest

from tests.nvml_substitute import (
    CUDA_DRIVER_VERSION,
    CUDA_VERSION,
    DRIVER_VERSION,
    EXPECTED_GPUS,
    EXPECTED_MEMORY_UTILIZATION_PERCENT,
    LIBRARY_NAME,
    SCENARIO_ENV,
    FakeNvmlBuildError,
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


def run_probe(body: str, library_dir: Path | None, scenario: str | None = None) -> dict[str, Any]:
    """Run `body` after `_PRELUDE` in a fresh interpreter; return the JSON it leaves in `result`."""
    env = dict(os.environ)
    env.pop(SCENARIO_ENV, None)
    env.pop("LD_LIBRARY_PATH", None)
    if library_dir is not None:
        inherited = os.environ.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{library_dir}:{inherited}" if inherited else str(library_dir)
    if scenario is not None:
        env[SCENARIO_ENV] = scenario
    script = _PRELUDE + textwrap.dedent(body) + _EPILOGUE
    completed = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
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
