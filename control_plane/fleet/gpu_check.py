"""A GPU's active check (issue 28): the job that must pass before a GPU the rules made unhealthy
is re-admitted to the schedule.

`check_job` answers the fields of that job's submission (`jobs.schemas.JobCreate`): a `python`
entrypoint whose source is `gpu_check_job.py` beside this module, read as text and never
imported here (it runs on the node, in the runtime worker, with pynvml and onnxruntime), with
the GPU and the onnxruntime execution provider as its params and one GPU as its resources.
Pinning it to that GPU of that node (`Job.pinned`) is the caller's, in the same transaction.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

#: The job program's module, and the file its source is read from.
MODULE = "modelforge_gpu_check"
SOURCE = Path(__file__).with_name("gpu_check_job.py")
#: The check takes well under a second on a CPU, a few seconds where onnxruntime loads CUDA;
#: the rest is room for a busy node.
TIMEOUT_SECONDS = 120.0
SILENCE_TIMEOUT_SECONDS = 120.0
RESOURCES: dict[str, Any] = {"gpus": 1, "cpus": 0.5, "memory_mb": 512}


@cache
def _source() -> str:
    return SOURCE.read_text()


def check_job(*, node_id: str, uuid: str, index: int, provider: str) -> dict[str, Any]:
    """The active check of GPU `uuid` (NVML index `index`) of node `node_id`, on the
    onnxruntime execution provider `provider` (the setting MODELFORGE_GPU_CHECK_PROVIDER)."""
    return {
        "entrypoint": {
            "kind": "python",
            "module": MODULE,
            "function": "check",
            "source": {f"{MODULE}.py": _source()},
            "python": "worker",  # pynvml and onnxruntime, whatever the node's Python holds
        },
        "params": {"uuid": uuid, "index": index, "provider": provider},
        "resources": dict(RESOURCES),
        "labels": {},
        "timeout_seconds": TIMEOUT_SECONDS,
        "silence_timeout_seconds": SILENCE_TIMEOUT_SECONDS,
    }
