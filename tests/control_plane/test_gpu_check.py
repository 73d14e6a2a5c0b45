"""The active check's job as the control plane creates it (fleet/gpu_check.py), and the setting
that picks its execution provider. How it runs on a node: tests/runtime_worker/test_gpu_check.py."""

from __future__ import annotations

import ast

import pytest
from pydantic import ValidationError

from control_plane.fleet.gpu_check import SOURCE, check_job
from control_plane.jobs.schemas import JobCreate
from control_plane.settings import Settings
from modelforge_contracts.settings_errors import describe_validation_error

UUID = "GPU-66666666-7777-8888-9999-000000000000"


def test_the_check_is_a_python_job_on_one_gpu_with_its_program_as_source() -> None:
    fields = check_job(node_id="node-1", uuid=UUID, index=1, provider="CUDAExecutionProvider")
    request = JobCreate.model_validate(fields)  # what re-admission submits
    entrypoint = request.entrypoint
    assert entrypoint is not None and entrypoint.kind == "python"
    assert entrypoint.function == "check"
    assert entrypoint.source == {f"{entrypoint.module}.py": SOURCE.read_text()}
    assert request.params == {"uuid": UUID, "index": 1, "provider": "CUDAExecutionProvider"}
    assert request.resources.model_dump() == {"gpus": 1, "cpus": 0.5, "memory_mb": 512}
    assert request.labels == {} and request.secrets == []
    assert request.timeout_seconds <= 300


def test_the_program_imports_nothing_of_modelforge() -> None:
    """It runs in the runtime worker's environment, where no control plane module is."""
    tree = ast.parse(SOURCE.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported == {"__future__", "os", "time", "typing", "numpy", "onnxruntime", "pynvml"}


def test_the_provider_defaults_to_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MODELFORGE_GPU_CHECK_PROVIDER", raising=False)
    assert Settings().gpu_check_provider == "CUDAExecutionProvider"
    monkeypatch.setenv("MODELFORGE_GPU_CHECK_PROVIDER", "CPUExecutionProvider")
    assert Settings().gpu_check_provider == "CPUExecutionProvider"


def test_another_provider_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELFORGE_GPU_CHECK_PROVIDER", "TensorrtExecutionProvider")
    with pytest.raises(ValidationError) as caught:
        Settings()
    assert describe_validation_error(caught.value, Settings) == (
        "MODELFORGE_GPU_CHECK_PROVIDER: Input should be 'CUDAExecutionProvider' or "
        "'CPUExecutionProvider'"
    )
