"""The GPU variables a job's environment gets from its assignment."""

from __future__ import annotations

import pytest

from runtime_worker.execution import gpu_environment, job_environment

GPUS = [{"index": 1, "uuid": "GPU-b"}, {"index": 0, "uuid": "GPU-a"}]


def test_exactly_the_assigned_gpus_by_uuid() -> None:
    env = gpu_environment({"resources": {"gpus": 2}, "assigned_gpus": GPUS})
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-b,GPU-a", "NVIDIA_VISIBLE_DEVICES": "GPU-b,GPU-a"}


def test_no_gpu_means_empty_values_overriding_the_nodes_own() -> None:
    extra = gpu_environment({"resources": {"gpus": 0}, "assigned_gpus": []})
    env = job_environment({"CUDA_VISIBLE_DEVICES": "0,1", "NVIDIA_VISIBLE_DEVICES": "all"}, extra)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == ""


def test_without_an_assignment_only_a_cpu_job_is_restricted() -> None:
    assert gpu_environment({"resources": {"gpus": 0}}) == {
        "CUDA_VISIBLE_DEVICES": "",
        "NVIDIA_VISIBLE_DEVICES": "",
    }
    assert gpu_environment({"resources": {"gpus": 1}}) == {}


@pytest.mark.parametrize("bad", ["GPU-a", [{"index": 0}], [None]])
def test_a_malformed_assignment_is_refused(bad: object) -> None:
    with pytest.raises(TypeError):
        gpu_environment({"assigned_gpus": bad})
