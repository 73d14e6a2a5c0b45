"""What the agent offers inside a Slurm allocation: the CPUs, memory and GPUs the job was given
(SLURM_CPUS_ON_NODE, SLURM_MEM_PER_NODE, SLURM_JOB_GPUS), not the whole shared node, and the
allocation itself in its inventory (PV-1)."""

from __future__ import annotations

import pytest

from node_agent.inventory import Overrides, collect_inventory
from node_agent.nvml import GpuInfo


def test_inside_a_slurm_allocation_only_its_gpus_cpus_and_memory_are_offered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpus = [GpuInfo(i, f"GPU-{i}", "H100", 81559.0, "550.54", "12.4") for i in range(4)]
    for var, value in {
        "SLURM_JOB_ID": "4242",
        "SLURM_CPUS_ON_NODE": "1",
        "SLURM_MEM_PER_NODE": "300",
        "SLURM_JOB_GPUS": "1,3",
        "SLURM_JOB_PARTITION": "gpu",
    }.items():
        monkeypatch.setenv(var, value)
    inventory = collect_inventory(
        hostname="h", mode="nvidia", gpus=gpus, overrides=Overrides(), runtime_worker=None
    )
    assert [gpu["uuid"] for gpu in inventory["gpus"]] == ["GPU-1", "GPU-3"]
    assert inventory["cpu_count"] == 1 and inventory["memory_mb"] == 300
    assert inventory["slurm"] == {
        "job_id": "4242",
        "cpus_on_node": "1",
        "mem_per_node_mb": "300",
        "gpus": "1,3",
        "partition": "gpu",
    }
    monkeypatch.setenv("SLURM_JOB_GPUS", "0-2")
    inventory = collect_inventory(
        hostname="h", mode="nvidia", gpus=gpus, overrides=Overrides(), runtime_worker=None
    )
    assert [gpu["index"] for gpu in inventory["gpus"]] == [0, 1, 2]
    # An allocation that names no GPUs (no gres on this cluster) leaves what NVML sees.
    monkeypatch.delenv("SLURM_JOB_GPUS")
    inventory = collect_inventory(
        hostname="h", mode="nvidia", gpus=gpus, overrides=Overrides(), runtime_worker=None
    )
    assert len(inventory["gpus"]) == 4
