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


NVML_GPUS = [GpuInfo(i, f"GPU-{i}", "H100", 81559.0, "550.54", "12.4") for i in range(4)]


def _offered(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], overrides: Overrides
) -> list[int]:
    """The indices of the GPUs offered with exactly `environ` as the Slurm environment."""
    for var in ("SLURM_JOB_ID", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in environ.items():
        monkeypatch.setenv(var, value)
    inventory = collect_inventory(
        hostname="h", mode="nvidia", gpus=NVML_GPUS, overrides=overrides, runtime_worker=None
    )
    return [gpu["index"] for gpu in inventory["gpus"]]


SLURM = {"SLURM_JOB_ID": "7"}


@pytest.mark.parametrize(
    ("environ", "overrides", "offered"),
    [
        # 5. NVML: every GPU it sees.
        ({}, Overrides(), [0, 1, 2, 3]),
        # 4. SLURM_JOB_GPUS: the GPUs it lists.
        ({**SLURM, "SLURM_JOB_GPUS": "1-3"}, Overrides(), [1, 2, 3]),
        # 3. MODELFORGE_AGENT_GPUS over SLURM_JOB_GPUS and NVML (of the GPUs Slurm lists).
        ({**SLURM, "SLURM_JOB_GPUS": "1-3"}, Overrides(gpus_variable=2), [1, 2]),
        ({}, Overrides(gpus_variable=1), [0]),
        ({}, Overrides(gpus_variable=0), []),
        # 2. SLURM_GPUS_ON_NODE over the variable.
        (
            {**SLURM, "SLURM_GPUS_ON_NODE": "3", "SLURM_JOB_GPUS": "0-3"},
            Overrides(gpus_variable=1),
            [0, 1, 2],
        ),
        ({**SLURM, "SLURM_GPUS_ON_NODE": "1"}, Overrides(gpus_variable=4), [0]),
        # 1. The flag over everything, 0 included.
        (
            {**SLURM, "SLURM_GPUS_ON_NODE": "3", "SLURM_JOB_GPUS": "0-3"},
            Overrides(gpus=1, gpus_variable=2),
            [0],
        ),
        ({**SLURM, "SLURM_GPUS_ON_NODE": "3"}, Overrides(gpus=0), []),
        # A count is at most: no GPU that NVML does not show is offered.
        ({}, Overrides(gpus_variable=8), [0, 1, 2, 3]),
        ({**SLURM, "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_GPUS": "2"}, Overrides(), [2]),
        # A SLURM_GPUS_ON_NODE that is no count leaves the decision to the next in line.
        ({**SLURM, "SLURM_GPUS_ON_NODE": "two"}, Overrides(gpus_variable=1), [0]),
        # Outside an allocation (no SLURM_JOB_ID) Slurm's variables are not read.
        ({"SLURM_GPUS_ON_NODE": "1", "SLURM_JOB_GPUS": "3"}, Overrides(), [0, 1, 2, 3]),
    ],
)
def test_gpus_are_counted_in_the_remote_worker_order(
    monkeypatch: pytest.MonkeyPatch,
    environ: dict[str, str],
    overrides: Overrides,
    offered: list[int],
) -> None:
    assert _offered(monkeypatch, environ, overrides) == offered


def test_the_allocation_reports_slurm_gpus_on_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    inventory = collect_inventory(
        hostname="h", mode="nvidia", gpus=NVML_GPUS, overrides=Overrides(), runtime_worker=None
    )
    assert inventory["slurm"]["gpus_on_node"] == "2"


def test_cpus_and_memory_set_by_the_operator_stand_over_the_allocation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    allocation = {"SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "2", "SLURM_MEM_PER_NODE": "300"}
    for var, value in allocation.items():
        monkeypatch.setenv(var, value)
    inventory = collect_inventory(
        hostname="h",
        mode="cpu",
        gpus=[],
        overrides=Overrides(cpus=6, ram_mb=4096, gpus_variable=2),
        runtime_worker=None,
    )
    assert (inventory["cpu_count"], inventory["memory_mb"], inventory["gpus"]) == (6, 4096, [])
