"""The worker's local endpoint: HTTP over a unix socket with mode 0600.

`GET /v1/health` answers `{"component", "version", "protocol_version", "healthy", "accelerator"}`.
`POST /v1/jobs` takes a job assignment from the agent, with `agent_socket` (where job code
reaches the agent) and `private_paths` (the agent's files no job may read), and streams the
job's records back.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from modelforge_contracts.ipc import JsonHandler, UnixHTTPServer, serve_unix
from modelforge_contracts.job_records import encode
from modelforge_contracts.protocol import PROTOCOL_VERSION
from runtime_worker import WORKER_VERSION
from runtime_worker.execution import gpu_environment, run_job

log = logging.getLogger("modelforge.runtime_worker")


def health() -> dict[str, Any]:
    return {
        "component": "runtime-worker",
        "version": WORKER_VERSION,
        "protocol_version": PROTOCOL_VERSION,
        "healthy": True,
    }


class _Server(UnixHTTPServer):
    jobs_dir: Path


class _Handler(JsonHandler):
    server: _Server
    server_version = f"modelforge-runtime-worker/{WORKER_VERSION}"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/v1/health":
            self.send_json(200, health())
        else:
            self.send_error_json(404, "NOT_FOUND", f"no route {self.path}", "GET /v1/health")

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/v1/jobs":
            self.send_error_json(404, "NOT_FOUND", f"no route {self.path}", "POST /v1/jobs")
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            spec = json.loads(self.rfile.read(length))
            agent_socket = str(spec.pop("agent_socket"))
            private_paths = spec.pop("private_paths", [])
            if not isinstance(private_paths, list) or not all(
                isinstance(path, str) for path in private_paths
            ):
                raise TypeError("private_paths must be a list of paths")
            str(spec["job_id"])
            gpu_environment(spec)  # a malformed GPU assignment is refused before anything runs
        except (ValueError, KeyError, TypeError) as exc:
            self.send_error_json(
                400, "INVALID_JOB", str(exc), "send a job assignment from the agent"
            )
            return
        # One JSON line per record, streamed until the job exits. The agent closing this
        # connection (cancel, or the agent died) ends the job and all it started.
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.end_headers()
        records = run_job(
            spec,
            agent_socket=agent_socket,
            jobs_dir=self.server.jobs_dir,
            private_paths=private_paths,
        )
        try:
            for record in records:
                self.wfile.write(encode(record))
                self.wfile.flush()
        except OSError:
            log.warning("the agent went away from job %s; it is stopped", spec.get("job_id"))
        finally:
            records.close()


def serve(socket_path: Path, *, jobs_dir: Path) -> UnixHTTPServer:
    server = serve_unix(socket_path, _Handler, _Server)
    server.jobs_dir = jobs_dir
    return server
