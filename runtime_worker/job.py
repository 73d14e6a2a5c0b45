"""Helpers for code running inside a job; they work the same on every node:

    from runtime_worker.job import emit, inputs, load_artifact, save_artifact

`emit(event)` records a JSON event visible through the jobs API, in order; an event that is not
strict JSON (NaN, Infinity, or not serialisable) raises `RecordNotJson` (a `ValueError`) in the
job, which — if the job lets it propagate — fails with `JOB_RESULT_NOT_JSON`.
`load_artifact(digest)` returns a local path to the artifact (fetched and cached by the node
agent). `save_artifact(path, name=None)` uploads a file and returns its digest; with a `name` it
becomes one of the job's outputs. `inputs()` maps the job's input names to digests.

They talk to the runtime worker through an inherited pipe and to the node agent through its
local unix socket; neither needs (or sees) a credential.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from modelforge_contracts.ipc import UnixHTTPConnection
from modelforge_contracts.job_records import (
    EventRecord,
    OutputRecord,
    Record,
    RecordNotJson,
    encode,
)

_lock = threading.Lock()
_CHUNK = 1024 * 1024


def write_line(line: bytes) -> None:
    """Write one encoded record to the runtime worker's events pipe, whole."""
    fd = int(os.environ["MODELFORGE_JOB_EVENTS_FD"])
    with _lock:
        os.write(fd, line)


def write_record(record: Record) -> None:
    write_line(encode(record))


def emit(event: Any) -> None:
    """Record `event` as a job event; `RecordNotJson` when it is not strict JSON."""
    try:
        write_record(EventRecord(event))
    except RecordNotJson as exc:
        raise RecordNotJson(f"emit(): the event is not strict JSON ({exc})") from None


def inputs() -> dict[str, str]:
    return dict(json.loads(os.environ.get("MODELFORGE_JOB_INPUTS", "{}")))


def _agent(
    method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    connection = UnixHTTPConnection(os.environ["MODELFORGE_AGENT_SOCKET"], timeout=600)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = json.loads(response.read() or b"{}")
    finally:
        connection.close()
    if response.status >= 400:
        error = data.get("error", {}) if isinstance(data, dict) else {}
        raise RuntimeError(f"{error.get('code', response.status)}: {error.get('message', '')}")
    return dict(data)


def load_artifact(digest: str) -> Path:
    """A local, read-only path to the artifact `digest` (sha256:…)."""
    answer = _agent(
        "POST",
        "/v1/artifacts/fetch",
        json.dumps({"digest": digest}),
        {"Content-Type": "application/json"},
    )
    return Path(answer["path"])


def save_artifact(path: str | os.PathLike[str], name: str | None = None) -> str:
    """Upload the file at `path`; returns its digest. `name` makes it a job output."""
    source = Path(path)
    with source.open("rb") as handle:
        answer = _agent(
            "PUT",
            "/v1/artifacts",
            handle,
            {
                "Content-Length": str(source.stat().st_size),
                "Content-Type": "application/octet-stream",
            },
        )
    digest = str(answer["digest"])
    if name is not None:
        write_record(OutputRecord(name, digest))
    return digest
