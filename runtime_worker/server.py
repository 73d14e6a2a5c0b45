"""The worker's local endpoint: HTTP over a unix socket with mode 0600.

`GET /v1/health` answers `{"component", "version", "protocol_version", "healthy", "accelerator"}`.
`POST /v1/jobs` takes a job assignment from the agent, with `agent_socket` (where job code
reaches the agent), `private_paths` (the agent's files no job may read), `secrets` (variables
for the job's environment only) and `python` (the node's Python, optional:
runtime_worker.job_python), and streams the job's records back.

Services (runtime_worker.services): `PUT /v1/services/{service_id}` runs one as its body says
(idempotent per generation; `INVALID_SERVICE` naming the field when malformed) and answers
`{"service_id", "generation", "state"}`; `DELETE /v1/services/{service_id}` stops it and all it
started, and waits (`{"stopped": true}`, or `SERVICE_NOT_FOUND`); `GET /v1/services` answers
`{"instance", "services": [...]}` with each one's state, port, pid, restarts, last exit, events
and the tail of its output.
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
from runtime_worker._service_spec import InvalidService
from runtime_worker.execution import check_variables, gpu_environment, run_job
from runtime_worker.services import Services, WorkerStopping

log = logging.getLogger("modelforge.runtime_worker")
_SERVICES = "/v1/services"
_SERVICE_PREFIX = "/v1/services/"
#: A service specification is small; anything bigger is refused unread.
_MAX_SERVICE_BODY = 1024 * 1024


def health() -> dict[str, Any]:
    return {
        "component": "runtime-worker",
        "version": WORKER_VERSION,
        "protocol_version": PROTOCOL_VERSION,
        "healthy": True,
    }


class WorkerServer(UnixHTTPServer):
    """The worker's socket server: where jobs get their work directories, and its services."""

    jobs_dir: Path
    services: Services


class _Handler(JsonHandler):
    server: WorkerServer
    server_version = f"modelforge-runtime-worker/{WORKER_VERSION}"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/v1/health":
            self.send_json(200, health())
        elif self.path == _SERVICES:
            self.send_json(200, self.server.services.statuses())
        else:
            self.send_error_json(
                404, "NOT_FOUND", f"no route {self.path}", "GET /v1/health or GET /v1/services"
            )

    def _service_id(self) -> str | None:
        """The id in `/v1/services/{id}`, or None (404 sent) for any other path."""
        service_id = self.path.removeprefix(_SERVICE_PREFIX)
        if not self.path.startswith(_SERVICE_PREFIX) or not service_id or "/" in service_id:
            self.send_error_json(
                404, "NOT_FOUND", f"no route {self.path}", "use /v1/services/{service_id}"
            )
            return None
        return service_id

    def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
        service_id = self._service_id()
        if service_id is None:
            return
        next_step = "send a service specification from the agent"
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_SERVICE_BODY:
                self.close_connection = True
                raise InvalidService(f"the body is larger than {_MAX_SERVICE_BODY} bytes")
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError:
                raise InvalidService("the body is not JSON") from None
            created, answer = self.server.services.put(service_id, body)
        except InvalidService as exc:
            self.send_error_json(400, "INVALID_SERVICE", str(exc), next_step)
            return
        except WorkerStopping:
            self.send_error_json(
                503, "WORKER_STOPPING", "the runtime worker is stopping", "try again once it runs"
            )
            return
        self.send_json(201 if created else 200, answer)

    def do_DELETE(self) -> None:  # noqa: N802 - http.server's naming
        service_id = self._service_id()
        if service_id is None:
            return
        if self.server.services.delete(service_id):
            self.send_json(200, {"stopped": True})
        else:
            self.send_error_json(
                404,
                "SERVICE_NOT_FOUND",
                f"this worker runs no service {service_id[:100]!r}",
                "GET /v1/services lists the services it runs",
            )

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
            # Out of the spec: the secrets travel to the job's environment only.
            secrets = check_variables(spec.pop("secrets", None), "secrets")
            python = spec.pop("python", None)
            if python is not None and (not isinstance(python, str) or not python.startswith("/")):
                raise TypeError("python must be the absolute path of an interpreter")
            str(spec["job_id"])
            gpu_environment(spec)  # a malformed GPU assignment is refused before anything runs
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
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
            secrets=secrets,
            python=python,
        )
        try:
            for record in records:
                self.wfile.write(encode(record))
                self.wfile.flush()
        except OSError:
            log.warning("the agent went away from job %s; it is stopped", spec.get("job_id"))
        finally:
            records.close()


def serve(socket_path: Path, *, jobs_dir: Path) -> WorkerServer:
    server = serve_unix(socket_path, _Handler, WorkerServer)
    server.jobs_dir = jobs_dir
    server.services = Services(jobs_dir)
    return server
