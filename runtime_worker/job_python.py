"""Which interpreter a job runs under: the node's Python (the agent's `MODELFORGE_AGENT_PYTHON`,
named in each assignment as `python`) for a Python job, unless its entrypoint asks for the
worker's (`"python": "worker"`, as the GPU check does: it needs the worker's pynvml and
onnxruntime); the worker's own for every other job and when the node names none.

Under another interpreter the job host still imports `runtime_worker` and
`modelforge_contracts` (both the standard library only): each job gets a directory holding links
to exactly those two packages, first on its `PYTHONPATH`, so the job's own processes (a
`multiprocessing` child) find the helpers too, and nothing else of the worker's environment.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import modelforge_contracts
import runtime_worker

#: The job fails with this code when the node's Python is not there to run it.
PYTHON_UNAVAILABLE = "JOB_PYTHON_UNAVAILABLE"
_HELPERS = (runtime_worker, modelforge_contracts)


def interpreter_for(spec: dict[str, Any], node_python: str | None) -> str | None:
    """The interpreter `spec` runs under when it is not the worker's own; None: the worker's."""
    entrypoint = spec.get("entrypoint") or {}
    if node_python is None or entrypoint.get("kind") != "python":
        return None
    if entrypoint.get("python", "node") == "worker" or node_python == sys.executable:
        return None
    return node_python


def unavailable(python: str) -> str | None:
    """Why this worker cannot run `python`, or None when it can."""
    path = Path(python)
    if path.is_file() and os.access(path, os.X_OK):
        return None
    return (
        f"the node's Python {python[:200]} is not an executable file where the runtime worker "
        "runs; set MODELFORGE_AGENT_PYTHON (--python) to an interpreter on the worker's host or "
        "in its container, or unset it to run jobs under the worker's own"
    )


def helpers_path(workdir: Path, inherited: str | None) -> str:
    """A `PYTHONPATH` for a job in `workdir` under another interpreter: the helpers' directory
    (made here), then `inherited` (the worker's own `PYTHONPATH`, when it passed the filter)."""
    directory = workdir / ".modelforge-helpers"
    directory.mkdir(mode=0o700)
    for package in _HELPERS:
        source = Path(package.__file__ or "").parent
        (directory / source.name).symlink_to(source, target_is_directory=True)
    return os.pathsep.join(filter(None, [str(directory), inherited]))
