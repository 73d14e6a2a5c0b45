"""The agent's local endpoint for job code on this node (unix socket, mode 0600): fetch an
artifact into the cache, upload one. The node credential stays inside the agent: job code gets
the artifact, or an error saying why not — never the credential, never a control plane body.

A digest from job code is checked before anything else sees it (`INVALID_DIGEST`, 400): a
"digest" with slashes or `..` never reaches the cache or the control plane."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from modelforge_contracts.ipc import JsonHandler, UnixHTTPServer, serve_unix
from node_agent.artifact_cache import ArtifactCache, ArtifactError
from node_agent.client import ControlPlane
from node_agent.digests import InvalidDigest, check_digest
from node_agent.retry import AgentStopped, ControlPlaneError, Interrupted

log = logging.getLogger(__name__)


class _Server(UnixHTTPServer):
    cache: ArtifactCache
    control_plane: ControlPlane


class _Handler(JsonHandler):
    server: _Server

    def _agent_unavailable(self, exc: AgentStopped | Interrupted) -> None:
        if isinstance(exc, AgentStopped):
            message = f"the node agent stopped: {exc.explanation}"
        else:
            message = "the node agent is stopping"
        self.send_error_json(
            503, "AGENT_STOPPED", message, "ask the node's operator to look at the node agent"
        )

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/v1/artifacts/fetch":
            self.send_error_json(404, "NOT_FOUND", self.path)
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            digest = check_digest(body["digest"])
        except InvalidDigest as exc:
            self.send_error_json(
                400,
                "INVALID_DIGEST",
                str(exc),
                "pass a digest as the job received it (inputs(), save_artifact(), the job spec)",
            )
            return
        except (ValueError, KeyError, TypeError) as exc:
            self.send_error_json(
                400,
                "INVALID_REQUEST",
                f"{type(exc).__name__}: {exc}",
                'send a JSON object {"digest": "sha256:…"}',
            )
            return
        try:
            path = self.server.cache.fetch(digest, self.server.control_plane.download_artifact)
        except (ArtifactError, ControlPlaneError) as exc:
            self.send_error_json(502, "ARTIFACT_UNAVAILABLE", str(exc))
            return
        except (AgentStopped, Interrupted) as exc:
            self._agent_unavailable(exc)
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
            digest, path = self.server.cache.store(chunks())
            self.server.control_plane.upload_artifact(digest, path)
        except (ArtifactError, ControlPlaneError) as exc:
            self.send_error_json(502, "ARTIFACT_UPLOAD_FAILED", f"{type(exc).__name__}: {exc}")
            return
        except (AgentStopped, Interrupted) as exc:
            self._agent_unavailable(exc)
            return
        self.send_json(200, {"digest": digest})


def serve_local_api(
    socket_path: Path, *, cache: ArtifactCache, control_plane: ControlPlane
) -> _Server:
    server = serve_unix(socket_path, _Handler, _Server)
    server.cache, server.control_plane = cache, control_plane
    return server
