"""The agent's local endpoint for job code on this node (unix socket, mode 0600): fetch an
artifact into the cache, upload one. The node credential stays inside the agent."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from modelforge_ipc import JsonHandler, UnixHTTPServer, serve_unix
from node_agent.artifact_cache import ArtifactCache, ArtifactError

log = logging.getLogger(__name__)


class _Server(UnixHTTPServer):
    cache: ArtifactCache
    http: httpx.Client
    credential: Callable[[], str]


class _Handler(JsonHandler):
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/v1/artifacts/fetch":
            self.send_error_json(404, "NOT_FOUND", self.path)
            return
        try:
            digest = str(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["digest"])
            path = self.server.cache.fetch(self.server.http, self.server.credential(), digest)
        except (ValueError, KeyError, TypeError) as exc:
            self.send_error_json(400, "INVALID_REQUEST", str(exc))
            return
        except ArtifactError as exc:
            self.send_error_json(502, "ARTIFACT_UNAVAILABLE", str(exc))
            return
        self.send_json(200, {"path": str(path)})

    def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/v1/artifacts":
            self.send_error_json(404, "NOT_FOUND", self.path)
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
            self.send_error_json(502, "ARTIFACT_UPLOAD_FAILED", f"{type(exc).__name__}: {exc}")
            return
        self.send_json(200, {"digest": digest})


def serve_local_api(
    socket_path: Path, *, cache: ArtifactCache, http: httpx.Client, credential: Callable[[], str]
) -> _Server:
    server = serve_unix(socket_path, _Handler, _Server)
    server.cache, server.http, server.credential = cache, http, credential
    return server
