"""HTTP over unix sockets between the processes of one node: the node agent, its runtime worker
and the job code the worker runs. Nothing here listens on a network port; sockets are created
with mode 0600 so only the service user can connect.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import socketserver
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, TypeVar

from modelforge_contracts.errors import error_body

log = logging.getLogger(__name__)
S = TypeVar("S", bound="UnixHTTPServer")


class UnixHTTPConnection(http.client.HTTPConnection):
    """`http.client` to a unix socket; the socket is closed when connecting fails."""

    def __init__(self, path: Path | str, timeout: float | None = None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler answering JSON, logging at debug level only."""

    def address_string(self) -> str:
        return "local"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug(format, *args)

    def send_json(self, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def send_error_json(self, status: int, code: str, message: str, next_step: str = "") -> None:
        self.send_json(status, error_body(code, message, next_step))


def serve_unix(path: Path, handler: type[BaseHTTPRequestHandler], server_class: type[S]) -> S:
    """Bind a threading HTTP server on `path` (replacing a stale socket), mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    old = os.umask(0o177)
    try:
        return server_class(str(path), handler)
    finally:
        os.umask(old)
