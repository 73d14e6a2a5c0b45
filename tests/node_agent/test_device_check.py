"""scripts/device-check, the node acceptance test, run as an operator runs it
(`.venv/bin/python scripts/device-check`) in a subprocess against the substitute NVML: the real
preflight, the real GPU watcher through the real pynvml bindings, a real onnxruntime inference.

On this machine there is no CUDA: the inference runs as the dry run (`--provider
CPUExecutionProvider`), and asking for CUDA must fail saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import onnxruntime

from tests.nvml_substitute import CONTROL_ENV, EXPECTED_GPUS, SCENARIO_ENV, FaultInjector

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device-check"
CPU = "CPUExecutionProvider"
UUID0, UUID1 = (gpu["uuid"] for gpu in EXPECTED_GPUS)
#: A watch long enough that a fault injected once it watches arrives before it ends, even on a
#: loaded machine (the test reads the progress and injects in another process).
INJECT_SECONDS = "4"


def _env(nvml_dir: Path, control: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MODELFORGE_", "NVIDIA_", "LD_LIBRARY_PATH", "CUDA_"))
    }
    return {**env, "LD_LIBRARY_PATH": str(nvml_dir), CONTROL_ENV: str(control), **extra}


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_two_healthy_substitute_gpus_pass(fake_nvml_dir: Path, tmp_path: Path) -> None:
    done = _run(_env(fake_nvml_dir, tmp_path / "control"), "--seconds", "2", "--provider", CPU)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"GPU 0 {UUID0}: healthy" in done.stdout
    assert f"GPU 1 {UUID1}: healthy" in done.stdout
    assert f"inference on the CPU ({CPU}): output [64, 2] matches the CPU's" in done.stdout
    assert _last_line(done.stdout) == (
        f"device-check: PASSED: preflight, 2 GPU(s) healthy over 2 s, inference on {CPU} "
        "matches the CPU's"
    )


def test_json_report_names_each_gpu_and_the_inference(fake_nvml_dir: Path, tmp_path: Path) -> None:
    done = _run(
        _env(fake_nvml_dir, tmp_path / "control"),
        *("--seconds", "2", "--provider", CPU, "--json"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)  # stdout is the report alone; progress went to stderr
    assert report["passed"] is True
    assert report["failures"] == []
    assert report["preflight"]["ok"] is True
    assert [(g["index"], g["uuid"], g["state"]) for g in report["gpus"]] == [
        (0, UUID0, "healthy"),
        (1, UUID1, "healthy"),
    ]
    (inference,) = report["inference"]
    assert inference["passed"] is True
    assert inference["used"] == CPU
    assert inference["max_abs_difference"] == 0.0
    assert inference["infer_ms"] > 0


def test_xid_79_on_gpu_1_fails_naming_it(fake_nvml_dir: Path, tmp_path: Path) -> None:
    control = tmp_path / "control"
    process = _start_injectable(fake_nvml_dir, control)
    progress = _until_watching(process)
    # The watcher's event set is registered now: an XID from here on reaches it.
    FaultInjector(control).xid(1, 79)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 1, progress + err + out
    report = json.loads(out)
    gpus = {g["index"]: g for g in report["gpus"]}
    assert gpus[0]["state"] == "healthy"
    assert gpus[1]["state"] == "unhealthy"
    assert [(e["kind"], e.get("xid")) for e in gpus[1]["evidence"]] == [("xid", 79)]
    assert report["failures"] == [f"GPU 1 ({UUID1}) unhealthy: XID 79 (GPU has fallen off the bus)"]
    assert report["verdict"] == (
        f"device-check: FAILED: GPU 1 ({UUID1}) unhealthy: XID 79 (GPU has fallen off the bus)"
    )
    # The watcher reported the change while it watched, not only at the end.
    assert any(
        change["states"] == {"0": "healthy", "1": "unhealthy"} for change in report["changes"]
    )
    assert f"GPU 1 {UUID1}: unhealthy: XID 79 (GPU has fallen off the bus)" in err


def test_application_xids_are_counted_and_pass(fake_nvml_dir: Path, tmp_path: Path) -> None:
    control = tmp_path / "control"
    process = _start_injectable(fake_nvml_dir, control)
    _until_watching(process)
    injector = FaultInjector(control)
    for _ in range(5):
        injector.xid(0, 13)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err + out
    gpus = {g["index"]: g for g in json.loads(out)["gpus"]}
    assert gpus[0]["state"] == "healthy"
    assert gpus[0]["xid_counts"] == {"13": 5}


def test_cuda_requested_without_cuda_fails_saying_so(fake_nvml_dir: Path, tmp_path: Path) -> None:
    # The project's onnxruntime is the CPU build: this machine has no CUDA provider to offer.
    assert "CUDAExecutionProvider" not in onnxruntime.get_available_providers()
    done = _run(
        _env(fake_nvml_dir, tmp_path / "control"),
        *("--seconds", "1", "--provider", "CUDAExecutionProvider"),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    verdict = _last_line(done.stdout)
    assert verdict.startswith("device-check: FAILED: CUDA is not available: onnxruntime ")
    assert "offers only" in verdict and CPU in verdict
    # The GPUs themselves were still judged.
    assert f"GPU 1 {UUID1}: healthy" in done.stdout


def test_a_failed_preflight_fails_with_its_code(fake_nvml_dir: Path, tmp_path: Path) -> None:
    done = _run(
        _env(fake_nvml_dir, tmp_path / "control", **{SCENARIO_ENV: "init_fail"}),
        *("--seconds", "1", "--provider", CPU),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert _last_line(done.stdout).startswith(
        "device-check: FAILED: preflight NVIDIA_NVML_UNAVAILABLE: "
    )


def _start_injectable(nvml_dir: Path, control: Path) -> subprocess.Popen[str]:
    """The check on the CPU for `INJECT_SECONDS`, answering JSON, its faults through `control`."""
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--seconds", INJECT_SECONDS, "--provider", CPU, "--json"],
        env=_env(nvml_dir, control),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _until_watching(process: subprocess.Popen[str]) -> str:
    """The progress (stderr) up to the line saying the watcher watches; fails after 60 s."""
    assert process.stderr is not None
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith("watching "):
            return "".join(seen)
    process.kill()
    process.wait()
    raise AssertionError("device-check never said it was watching:\n" + "".join(seen))
