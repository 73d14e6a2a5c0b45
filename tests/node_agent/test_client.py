"""The agent's one transport (`ControlPlane`) against a real HTTP server: the retry rule applies
to every call, artifacts included; terminal answers stop the agent wherever they happen; the
credential never shows in a repr, an error or a log line."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from modelforge_contracts.errors import error_body
from modelforge_contracts.ipc import UnixHTTPConnection
from node_agent.artifact_cache import ArtifactCache
from node_agent.client import ControlPlane
from node_agent.digests import InvalidDigest
from node_agent.local_api import serve_local_api
from node_agent.retry import AgentStopped, ControlPlaneError, Interrupted
from runtime_worker import job
from tests.node_agent.conftest import Answer, Recorded, RecordingServer, control_plane_client

CREDENTIAL = "node-credential-that-must-stay-secret"
CONTENT = b"weights " * 1000
DIGEST = "sha256:" + hashlib.sha256(CONTENT).hexdigest()
ARTIFACT = f"/api/v1/agent/artifacts/{DIGEST}"


def _serve(respond: dict[str, list[Answer]]) -> RecordingServer:
    """A server answering each path from its list of answers in turn (the last one repeats)."""

    def answer(request: Recorded) -> Answer:
        answers = respond.get(request.path)
        if not answers:
            return 404, error_body("NOT_FOUND", "no such route")
        return answers.pop(0) if len(answers) > 1 else answers[0]

    return RecordingServer(respond=answer).start()


@contextmanager
def _local_api(
    tmp_path: Path,
    server: RecordingServer,
    monkeypatch: pytest.MonkeyPatch,
    stop: threading.Event | None = None,
) -> Iterator[ControlPlane]:
    """The agent's local socket for job code (`tmp_path/agent.sock`, named to job code by
    MODELFORGE_AGENT_SOCKET) served on a thread, with the cache at `tmp_path/cache` and the
    agent's client for `server`, holding CREDENTIAL, behind it. On leaving, all three close."""
    control_plane = control_plane_client(server.url, stop)
    control_plane.use_credential(CREDENTIAL)
    socket_path = tmp_path / "agent.sock"
    local = serve_local_api(
        socket_path, cache=ArtifactCache(tmp_path / "cache", 10**6), control_plane=control_plane
    )
    threading.Thread(target=local.serve_forever, daemon=True).start()
    monkeypatch.setenv("MODELFORGE_AGENT_SOCKET", str(socket_path))
    try:
        yield control_plane
    finally:
        local.shutdown()
        local.server_close()
        control_plane.close()
        server.stop()


def test_the_credential_never_shows_in_a_repr_an_error_or_a_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = _serve(
        {
            "/api/v1/agent/heartbeat": [(422, error_body("INVALID_REQUEST", "bad health"))],
            "/api/v1/agent/telemetry": [(403, error_body("CREDENTIAL_REVOKED", "revoked"))],
        }
    )
    caplog.set_level(logging.DEBUG)
    try:
        with control_plane_client(server.url) as control_plane:
            control_plane.use_credential(CREDENTIAL)
            assert control_plane.heartbeat({"status": "healthy"}) is None  # dropped, logged
            with pytest.raises(AgentStopped) as stopped:
                control_plane.post_telemetry({"host": {}})
            texts = [repr(control_plane), str(control_plane), str(stopped.value)]
            texts += [repr(stopped.value), repr(control_plane.stopped)]
    finally:
        server.stop()
    refusal = ControlPlaneError(422, "INVALID_REQUEST", "POST", "/api/v1/agent/heartbeat")
    texts += [str(refusal), repr(refusal), caplog.text]
    assert "HTTP 422 INVALID_REQUEST on POST /api/v1/agent/heartbeat" in caplog.text
    # It was sent — as a header, to the control plane only.
    assert server.requests[0].headers["Authorization"] == f"Bearer {CREDENTIAL}"
    for text in texts:
        assert CREDENTIAL not in text
        assert "bad health" not in text  # nor a response body


def test_a_revoked_credential_during_an_artifact_fetch_stops_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Job code asks for an artifact; the control plane says the credential is revoked. The
    agent stops like on any other call, and job code gets an error saying so."""
    server = _serve({ARTIFACT: [(403, error_body("CREDENTIAL_REVOKED", "revoked"))]})
    stop = threading.Event()
    with _local_api(tmp_path, server, monkeypatch, stop) as control_plane:
        with pytest.raises(RuntimeError) as refused:
            job.load_artifact(DIGEST)
        assert stop.is_set()
        assert control_plane.stopped is not None and control_plane.stopped.exit_code == 4
        # Every later call ends the same way, without asking the control plane again.
        with pytest.raises(AgentStopped):
            control_plane.heartbeat({"status": "healthy"})
    assert str(refused.value).startswith("AGENT_STOPPED: the node agent stopped: ")
    assert "credential was revoked" in str(refused.value)
    assert CREDENTIAL not in str(refused.value)
    assert server.paths() == [ARTIFACT]  # one request: no retries


def test_job_code_gets_invalid_digest_for_a_path_and_nothing_is_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Job code names a "digest" that is a path out of the cache: the agent's local socket
    refuses it with INVALID_DIGEST, before the cache or the control plane sees it."""
    server = _serve({})
    victim = tmp_path / "victim"
    victim.write_text("not an artifact")
    os.utime(victim, (1_000_000, 1_000_000))
    relative = "../victim"  # from the cache at tmp_path/cache
    traversal = "sha256:." + "/" * (64 - 1 - len(relative)) + relative
    with _local_api(tmp_path, server, monkeypatch) as control_plane:
        with pytest.raises(RuntimeError) as refused:
            job.load_artifact(traversal)
        connection = UnixHTTPConnection(tmp_path / "agent.sock", timeout=10)
        connection.request("POST", "/v1/artifacts/fetch", body=json.dumps({"digest": 7}))
        response = connection.getresponse()
        not_text = (response.status, json.loads(response.read()))
        connection.close()
        # The client refuses to build a request from one, too.
        with pytest.raises(InvalidDigest):
            control_plane.download_artifact(traversal, tmp_path / "partial")
        with pytest.raises(InvalidDigest):
            control_plane.upload_artifact("sha256:../../admin", victim)
    assert str(refused.value).startswith("INVALID_DIGEST: ")
    assert "64 lowercase hex" in str(refused.value)
    assert not_text[0] == 400 and not_text[1]["error"]["code"] == "INVALID_DIGEST"
    assert not_text[1]["error"]["next_step"]
    assert victim.stat().st_mtime == 1_000_000 and victim.read_text() == "not an artifact"
    assert server.requests == []  # the control plane was never asked


def test_a_failing_download_backs_off_and_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def respond(request: Recorded) -> Answer:
        if len(server.requests) == 1:
            return 503, error_body("SERVICE_UNAVAILABLE", "busy")
        assert request.headers.get("Range") == "bytes=100-"
        return 206, CONTENT[100:]

    server = RecordingServer(respond=respond).start()
    cache = ArtifactCache(tmp_path / "cache", 10**6)
    (tmp_path / "cache" / ".partial").mkdir(parents=True)
    (tmp_path / "cache" / ".partial" / DIGEST.removeprefix("sha256:")).write_bytes(CONTENT[:100])
    caplog.set_level(logging.INFO)
    try:
        with control_plane_client(server.url) as control_plane:
            control_plane.use_credential(CREDENTIAL)
            path = cache.fetch(DIGEST, control_plane.download_artifact)
    finally:
        server.stop()
    assert path.read_bytes() == CONTENT
    assert len(server.requests) == 2
    assert (
        f"HTTP 503 SERVICE_UNAVAILABLE on GET {ARTIFACT} (backoff 1s…16s); next attempt in 1s"
        in caplog.text
    )


def test_stopping_interrupts_a_call_waiting_to_retry() -> None:
    server = _serve({"/api/v1/agent/heartbeat": [(503, error_body("SERVICE_UNAVAILABLE", "x"))]})
    stop = threading.Event()
    outcome: list[BaseException] = []

    def beat() -> None:
        try:
            control_plane.heartbeat({"status": "healthy"})
        except BaseException as exc:
            outcome.append(exc)

    with control_plane_client(server.url, stop) as control_plane:
        control_plane.use_credential(CREDENTIAL)
        caller = threading.Thread(target=beat)
        caller.start()
        time.sleep(0.3)  # the first attempt was refused; the call waits to retry
        stop.set()
        caller.join(timeout=2)
    server.stop()
    assert not caller.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], Interrupted)


def test_each_endpoint_keeps_its_meaning_of_a_refusal() -> None:
    events = "/api/v1/agent/jobs/{}/events"
    server = _serve(
        {
            "/api/v1/agent/work/claim": [(204, {})],
            events.format("gone"): [(404, error_body("JOB_NOT_FOUND", "gone"))],
            events.format("over"): [(409, error_body("JOB_FINISHED", "over"))],
            events.format("live"): [(200, {"cancel": False})],
            "/api/v1/agent/jobs/over/complete": [(409, error_body("JOB_FINISHED", "over"))],
            "/api/v1/agent/jobs/watch": [(200, {"cancel": ["over"]})],
        }
    )
    try:
        with control_plane_client(server.url) as control_plane:
            control_plane.use_credential(CREDENTIAL)
            assert control_plane.claim(0.1) is None
            assert control_plane.events("gone", []) is True  # no longer ours: stop it
            assert control_plane.events("over", []) is True
            assert control_plane.events("live", []) is False
            control_plane.complete("over", {"state": "failed"})  # already ended: left as it is
            assert control_plane.watch(["over", "live"], 0.1) == ["over"]
            with pytest.raises(AgentStopped) as refused:  # an enrollment refused by a 404
                control_plane.enroll(token="t", claim_nonce="n", hostname="h", fingerprint={})
    finally:
        server.stop()
    assert refused.value.exit_code == 6
