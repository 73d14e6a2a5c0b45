"""What this node has and how busy it is: psutil for the host, NVML for GPUs,
the Slurm allocation when the agent runs inside one, explicit overrides on top.

CPUs and memory: the flag, else the variable (`MODELFORGE_AGENT_CPUS`, `_RAM_MB`), else the Slurm
allocation's, else the host's. GPUs in the order of the remote-worker document: which ones are
those NVML sees (inside a Slurm allocation only those `SLURM_JOB_GPUS` names); how many, the
first set of `--gpus`, `SLURM_GPUS_ON_NODE`, `MODELFORGE_AGENT_GPUS`, else all of them. A count
is an upper bound: a GPU NVML does not show cannot be offered.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from node_agent import AGENT_VERSION

if TYPE_CHECKING:
    from node_agent.nvml import GpuInfo, Nvml

_MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))


@dataclass(frozen=True)
class Overrides:
    """What the operator set. `cpus` and `ram_mb`: the flag, else the variable, over anything
    detected. `gpus` (`--gpus`) is above everything; `gpus_variable` (`MODELFORGE_AGENT_GPUS`)
    is below `SLURM_GPUS_ON_NODE`: inside an allocation, what Slurm gave the job stands."""

    cpus: int | None = None
    gpus: int | None = None
    ram_mb: int | None = None
    gpus_variable: int | None = None


def machine_id() -> str | None:
    for path in _MACHINE_ID_FILES:
        try:
            value = path.read_text().strip()
        except OSError:
            continue
        if value:
            return value
    return None


def slurm_allocation(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    keys = {
        "job_id": "SLURM_JOB_ID",
        "cpus_on_node": "SLURM_CPUS_ON_NODE",
        "mem_per_node_mb": "SLURM_MEM_PER_NODE",
        "gpus": "SLURM_JOB_GPUS",
        "gpus_on_node": "SLURM_GPUS_ON_NODE",
        "partition": "SLURM_JOB_PARTITION",
    }
    return {name: env[var] for name, var in keys.items() if env.get(var)}


def slurm_gpu_indices(value: str) -> set[int] | None:
    """The GPU indices of `SLURM_JOB_GPUS` ("0,2" or "0-3,6"); None when it cannot be read,
    which leaves the GPUs NVML sees as they are."""
    indices: set[int] = set()
    for part in value.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            return None
        indices.update(range(int(first), int(last or first) + 1))
    return indices


def offered_gpus(
    gpus: list[GpuInfo], overrides: Overrides, slurm: dict[str, str] | None
) -> list[GpuInfo]:
    """The GPUs this node offers, of those NVML sees (`gpus`), in the detection order above."""
    listed = list(gpus)
    allocated = slurm_gpu_indices(slurm["gpus"]) if slurm and "gpus" in slurm else None
    if allocated is not None:
        # NVML lists every GPU of a shared node; the job may use only those Slurm gave it.
        listed = [gpu for gpu in listed if gpu.index in allocated]
    on_node = (slurm or {}).get("gpus_on_node", "")
    for count in (
        overrides.gpus,
        int(on_node) if on_node.isdigit() else None,  # not a count: the next one decides
        overrides.gpus_variable,
    ):
        if count is not None:
            return listed[:count]
    return listed


def _os_name() -> str:
    try:
        release = platform.freedesktop_os_release()
        return str(release.get("PRETTY_NAME") or release.get("NAME") or platform.system())
    except OSError:
        return f"{platform.system()} {platform.release()}"


def collect_inventory(
    *,
    hostname: str,
    mode: str,
    gpus: list[GpuInfo],
    overrides: Overrides,
    runtime_worker: dict[str, Any] | None,
) -> dict[str, Any]:
    cpus = psutil.cpu_count(logical=True) or 1
    memory_mb = psutil.virtual_memory().total // (1024 * 1024)
    slurm = slurm_allocation()
    if slurm:
        # Inside a Slurm allocation only what the job was given is ours to offer.
        if slurm.get("cpus_on_node", "").isdigit():
            cpus = min(cpus, int(slurm["cpus_on_node"]))
        if slurm.get("mem_per_node_mb", "").isdigit():
            memory_mb = min(memory_mb, int(slurm["mem_per_node_mb"]))
    listed = offered_gpus(gpus, overrides, slurm)
    if overrides.cpus is not None:
        cpus = overrides.cpus
    if overrides.ram_mb is not None:
        memory_mb = overrides.ram_mb
    inventory: dict[str, Any] = {
        "hostname": hostname,
        "os": _os_name(),
        "agent_version": AGENT_VERSION,
        "accelerator_mode": mode,
        "cpu_count": cpus,
        "memory_mb": memory_mb,
        "gpus": [g.inventory() for g in listed],
    }
    if runtime_worker is not None:
        inventory["runtime_worker"] = runtime_worker
    if slurm:
        inventory["slurm"] = slurm
    return inventory


def collect_telemetry(nvml: Nvml | None, gpus: list[GpuInfo]) -> dict[str, Any]:
    memory = psutil.virtual_memory()
    telemetry: dict[str, Any] = {
        "host": {
            "cpu_percent": psutil.cpu_percent(interval=None),
            "memory_used_mb": round((memory.total - memory.available) / (1024 * 1024), 1),
            "memory_total_mb": round(memory.total / (1024 * 1024), 1),
        },
        "gpus": [nvml.telemetry(g.index, g.uuid) for g in gpus] if nvml is not None else [],
    }
    return telemetry
