"""A real runtime worker (`python -m runtime_worker`) for the tests, and jobs handed to it over
its socket as the agent hands them: `POST /v1/jobs`, its record stream read to the `exit`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from modelforge_contracts import job_records as records
from modelforge_contracts.ipc import UnixHTTPConnection
from tests.e2e.node import wait_until


@contextmanager
def running_worker(directory: Path, env: dict[str, str]) -> Iterator[Path]:
    """A runtime worker with exactly `env` (plus its socket) listening in `directory`; yields
    its socket; stopped with SIGTERM on leaving."""
    socket = directory / "worker.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "runtime_worker"],
        env={**env, "MODELFORGE_WORKER_SOCKET": str(socket)},
    )
    try:
        wait_until(lambda: socket.exists() or process.poll() is not None, 15, "the worker's socket")
        assert process.poll() is None, "the runtime worker exited"
        yield socket
    finally:
        process.terminate()
        process.wait(timeout=20)


def python_job(job_id: str, source: str, function: str, **fields: Any) -> dict[str, Any]:
    """The assignment of a Python job whose module `job.py` is `source`."""
    return {
        "job_id": job_id,
        "entrypoint": {
            "kind": "python",
            "module": "job",
            "function": function,
            "source": {"job.py": source},
        },
        "params": {},
        "resources": {"gpus": 0},
        "timeout_seconds": 60,
        **fields,
    }


def run_on_worker(socket: Path, assignment: dict[str, Any]) -> records.ExitRecord:
    """Hand `assignment` to the worker as the agent does; the job's `exit` record."""
    connection = UnixHTTPConnection(str(socket), timeout=60)
    try:
        body = json.dumps({"agent_socket": str(socket.with_name("agent.sock")), **assignment})
        connection.request("POST", "/v1/jobs", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200, response.read()
        for line in response:
            record = records.decode(line)
            if isinstance(record, records.ExitRecord):
                return record
    finally:
        connection.close()
    raise AssertionError("the worker's stream ended without an exit record")
