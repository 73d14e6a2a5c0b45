"""The agent's local endpoint for job code on this node (unix socket, mode 0600): fetch an
artifact into the cache, upload one. The node credential stays inside the agent."""

from __future__ import annotations

import json
import logging
import os
import socketserver
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx

from node_agent.artifact_cache import ArtifactCache, ArtifactError

log = logging.getLogger(__name__)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    cache: ArtifactCache
    http: httpx.Client
    credential: Callable[[], str]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def address_string(self) -> str:
        return "local-job"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug(format, *args)

    def _send(self, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(status, {"error": {"code": code, "message": message, "next_step": ""}})

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/v1/artifacts/fetch":
            self._error(404, "NOT_FOUND", self.path)
            return
        try:
            digest = str(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["digest"])
            path = self.server.cache.fetch(self.server.http, self.server.credential(), digest)
        except (ValueError, KeyError, TypeError) as exc:
            self._error(400, "INVALID_REQUEST", str(exc))
            return
        except ArtifactError as exc:
            self._error(502, "ARTIFACT_UNAVAILABLE", str(exc))
            return
        self._send(200, {"path": str(path)})

    def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/v1/artifacts":
            self._error(404, "NOT_FOUND", self.path)
            return
        length = int(self.headers.get("Content-Length") or 0)

        def chunks() -> Iterator[bytes]:
            remaining = length
            while remaining > 0:
                chunk = self.rfile.read(min(remaining, 1024 * 1024))
                if not chunk:
                    raise ArtifactError("the upload ended early")
                remaining -= len(chunk)
                yield chunk

        try:
            digest, _ = self.server.cache.store(chunks())
            self.server.cache.upload(self.server.http, self.server.credential(), digest)
        except (ArtifactError, httpx.HTTPError) as exc:
            self._error(502, "ARTIFACT_UPLOAD_FAILED", f"{type(exc).__name__}: {exc}")
            return
        self._send(200, {"digest": digest})


def serve_local_api(
    socket_path: Path, *, cache: ArtifactCache, http: httpx.Client, credential: Callable[[], str]
) -> _Server:
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)
    old = os.umask(0o177)
    try:
        server = _Server(str(socket_path), _Handler)
    finally:
        os.umask(old)
    server.cache, server.http, server.credential = cache, http, credential
    return server
