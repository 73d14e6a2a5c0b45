"""A GPU's active check (control_plane/fleet/gpu_check_job.py) as nodes run it, on the NVML
substitute loaded through the real pynvml bindings.

Through a real runtime worker (`python -m runtime_worker`, handed the job over its socket as the
agent does): the job reaches NVML through the worker's LD_LIBRARY_PATH, which the worker passes
on to jobs (on a real node the library comes from the container toolkit's loader configuration
instead). The faults: the worker gives a job none of its MODELFORGE_* variables, the substitute's
control file variable included, so these tests run the job host (`python -m
runtime_worker.job_host`, the process a worker's supervisor starts for a job) themselves, with
the job's GPU variables and the control file set, and read its outcome from its events pipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from control_plane.fleet.gpu_check import check_job
from modelforge_contracts import job_records as records
from tests.nvml_substitute import CONTROL_ENV, EXPECTED_GPUS, FaultInjector, build_fake_nvml
from tests.runtime_worker.real_worker import run_on_worker, running_worker

GPU = EXPECTED_GPUS[1]
INDEX = 1
CPU = "CPUExecutionProvider"


def _spec(provider: str = CPU, uuid: str = GPU["uuid"]) -> dict[str, Any]:
    fields = check_job(node_id="node-1", uuid=uuid, index=INDEX, provider=provider)
    return {
        "job_id": "job-gpu-check",
        "entrypoint": fields["entrypoint"],
        "params": fields["params"],
        "resources": fields["resources"],
        "timeout_seconds": fields["timeout_seconds"],
        "silence_timeout_seconds": fields["silence_timeout_seconds"],
        "assigned_gpus": [{"index": INDEX, "uuid": GPU["uuid"]}],
    }


def _clean_env(nvml: Path) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("MODELFORGE_", "NVIDIA_", "CUDA_", "LD_LIBRARY_PATH"))
    }
    env["LD_LIBRARY_PATH"] = str(nvml)
    return env


@pytest.fixture(scope="module")
def nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_nvml(tmp_path_factory.mktemp("nvml"))


@pytest.fixture(scope="module")
def worker(nvml: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A runtime worker whose environment has the substitute on LD_LIBRARY_PATH."""
    with running_worker(tmp_path_factory.mktemp("worker"), _clean_env(nvml)) as socket:
        yield socket


def _run_job_host(
    spec: dict[str, Any], nvml: Path, workdir: Path, control: Path
) -> records.ResultRecord | records.ErrorRecord:
    """Run the job host on `spec` as a worker's supervisor does, with the substitute's control
    file set and only the job's GPU visible; its outcome."""
    read_fd, write_fd = os.pipe()
    env = _clean_env(nvml)
    env.update(
        {
            CONTROL_ENV: str(control),
            "CUDA_VISIBLE_DEVICES": GPU["uuid"],
            "MODELFORGE_JOB_EVENTS_FD": str(write_fd),
        }
    )
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        process = subprocess.run(
            [sys.executable, "-m", "runtime_worker.job_host"],
            input=json.dumps(spec).encode(),
            env=env,
            cwd=workdir,
            pass_fds=(write_fd,),
            capture_output=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd, "rb") as events:
        outcomes = [records.decode(line) for line in events]
    assert len(outcomes) == 1, (outcomes, process.stdout, process.stderr)
    outcome = outcomes[0]
    assert isinstance(outcome, records.ResultRecord | records.ErrorRecord)
    assert process.returncode == (0 if isinstance(outcome, records.ResultRecord) else 1)
    return outcome


def test_a_clean_gpu_passes_as_a_job_of_the_runtime_worker(worker: Path) -> None:
    exit_record = run_on_worker(worker, _spec())
    assert exit_record.state == "succeeded", exit_record.error
    result = exit_record.result
    assert result["uuid"] == GPU["uuid"] and result["provider"] == CPU
    # The substitute offers row remapping and page retirement, and no ECC counter until a
    # fault sets one: that reading is skipped, and said so.
    assert result["nvml"]["checked"] == {
        "remapped_rows": {"correctable": 0, "uncorrectable": 0},
        "retired_pages_pending": False,
    }
    assert result["nvml"]["skipped"] == ["volatile uncorrected ECC errors: not supported"]
    assert result["inference"]["max_abs_difference"] <= result["inference"]["tolerance"]
    assert set(result["timings"]) == {"nvml_s", "session_s", "infer_s", "total_s"}
    assert result["timings"]["total_s"] < 10


def test_the_cuda_provider_missing_fails_the_job_saying_so(worker: Path) -> None:
    exit_record = run_on_worker(worker, _spec("CUDAExecutionProvider"))
    assert exit_record.state == "failed" and exit_record.error is not None
    assert exit_record.error.code == "JOB_EXCEPTION"
    assert "GpuCheckFailed: onnxruntime" in exit_record.error.message
    assert "has no CUDAExecutionProvider" in exit_record.error.message
    assert "onnxruntime-gpu" in exit_record.error.message


def test_a_job_that_sees_another_gpu_fails(worker: Path) -> None:
    other = EXPECTED_GPUS[0]["uuid"]
    exit_record = run_on_worker(worker, _spec(uuid=other))
    assert exit_record.state == "failed" and exit_record.error is not None
    assert f"must see GPU {other} alone" in exit_record.error.message


def test_a_clean_gpu_passes_with_the_control_file_read(nvml: Path, tmp_path: Path) -> None:
    control = tmp_path / "control"
    FaultInjector(control).ecc(INDEX, "uncorrected", "volatile", 0)
    outcome = _run_job_host(_spec(), nvml, tmp_path / "job", control)
    assert isinstance(outcome, records.ResultRecord)
    assert outcome.value["nvml"]["checked"]["volatile_uncorrected_ecc"] == 0
    assert outcome.value["nvml"]["skipped"] == []


def _failure(nvml: Path, tmp_path: Path, control: Path) -> str:
    outcome = _run_job_host(_spec(), nvml, tmp_path / "job", control)
    assert isinstance(outcome, records.ErrorRecord), outcome
    assert outcome.error.code == "JOB_EXCEPTION"
    return outcome.error.message


def test_a_lost_gpu_fails_the_check(nvml: Path, tmp_path: Path) -> None:
    control = tmp_path / "control"
    FaultInjector(control).lose(INDEX)
    message = _failure(nvml, tmp_path, control)
    assert f"GpuCheckFailed: GPU {INDEX} ({GPU['uuid']}) is lost" in message
    assert "fell off the bus" in message and "reboot the node" in message


def test_a_pending_row_remapping_fails_the_check(nvml: Path, tmp_path: Path) -> None:
    control = tmp_path / "control"
    FaultInjector(control).remap(INDEX, 0, 2, True, False)
    message = _failure(nvml, tmp_path, control)
    assert f"GpuCheckFailed: GPU {INDEX} ({GPU['uuid']}) has a row remapping pending" in message


def test_a_failed_row_remapping_fails_the_check(nvml: Path, tmp_path: Path) -> None:
    control = tmp_path / "control"
    FaultInjector(control).remap(INDEX, 0, 8, False, True)
    message = _failure(nvml, tmp_path, control)
    assert "failed a row remapping (8 rows remapped" in message


def test_volatile_uncorrected_ecc_fails_the_check(nvml: Path, tmp_path: Path) -> None:
    control = tmp_path / "control"
    FaultInjector(control).ecc(INDEX, "uncorrected", "volatile", 3)
    message = _failure(nvml, tmp_path, control)
    assert "has 3 volatile uncorrected ECC errors" in message


def test_retired_pages_pending_fail_the_check(nvml: Path, tmp_path: Path) -> None:
    control = tmp_path / "control"
    FaultInjector(control).retired_pending(INDEX, True)
    message = _failure(nvml, tmp_path, control)
    assert "has retired memory pages pending" in message


def test_a_reset_gpu_passes_again(nvml: Path, tmp_path: Path) -> None:
    control = tmp_path / "control"
    injector = FaultInjector(control)
    injector.lose(INDEX)
    injector.remap(INDEX, 0, 2, True, False)
    injector.reset(INDEX)
    outcome = _run_job_host(_spec(), nvml, tmp_path / "job", control)
    assert isinstance(outcome, records.ResultRecord), outcome
