"""The worker's local endpoint: HTTP over a unix socket with mode 0600 (RW-1).

`GET /v1/health` answers `{"component", "version", "protocol_version", "healthy", "accelerator"}`.
"""

from __future__ import annotations

import json
import logging
import os
import socketserver
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from runtime_worker import PROTOCOL_VERSION, WORKER_VERSION
from runtime_worker.execution import run_job

log = logging.getLogger("modelforge.runtime_worker")


def health() -> dict[str, Any]:
    return {
        "component": "runtime-worker",
        "version": WORKER_VERSION,
        "protocol_version": PROTOCOL_VERSION,
        "healthy": True,
    }


class _Handler(BaseHTTPRequestHandler):
    server_version = f"modelforge-runtime-worker/{WORKER_VERSION}"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/v1/health":
            self._send(200, health())
        else:
            self._send(
                404,
                {
                    "error": {
                        "code": "NOT_FOUND",
                        "message": f"no route {self.path}",
                        "next_step": "GET /v1/health",
                    }
                },
            )

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/v1/jobs":
            self._send(
                404,
                {
                    "error": {
                        "code": "NOT_FOUND",
                        "message": f"no route {self.path}",
                        "next_step": "POST /v1/jobs",
                    }
                },
            )
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            spec = json.loads(self.rfile.read(length))
            agent_socket = str(spec.pop("agent_socket"))
            str(spec["job_id"])
        except (ValueError, KeyError, TypeError) as exc:
            self._send(
                400,
                {
                    "error": {
                        "code": "INVALID_JOB",
                        "message": str(exc),
                        "next_step": "send a job assignment from the agent",
                    }
                },
            )
            return
        # One JSON line per record, streamed until the job exits. The agent closing this
        # connection (cancel, or the agent died) ends the job: its group is killed.
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.end_headers()
        records = run_job(spec, agent_socket=agent_socket)
        try:
            for record in records:
                self.wfile.write((json.dumps(record, default=str) + "\n").encode())
                self.wfile.flush()
        except OSError:
            log.warning(
                "the agent went away from job %s; its process group is killed", spec.get("job_id")
            )
        finally:
            records.close()

    def _send(self, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def address_string(self) -> str:
        return "local-agent"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s " + format, self.address_string(), *args)


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def serve(socket_path: Path) -> UnixHTTPServer:
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)
    old_umask = os.umask(0o177)  # the socket is created 0600: the local agent only
    try:
        server = UnixHTTPServer(str(socket_path), _Handler)
    finally:
        os.umask(old_umask)
    return server
