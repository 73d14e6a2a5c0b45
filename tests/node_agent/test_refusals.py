"""Terminal answers stop the agent with their own exit code and no retry storm; transient ones
are retried. Against a real HTTP server scripted per request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modelforge_contracts.errors import error_body
from tests.node_agent.conftest import (
    ENROLLED,
    Answer,
    Recorded,
    RecordingServer,
    agent_env,
    run_agent,
)


def _error(code: str) -> dict[str, Any]:
    return error_body(code, "m", "n")


@pytest.mark.parametrize(
    ("status", "code", "exit_code", "explanation"),
    [
        (426, "TOO_OLD", 5, "refused this agent's protocol (TOO_OLD)"),
        (426, "TOO_NEW", 5, "refused this agent's protocol (TOO_NEW)"),
        (403, "CREDENTIAL_REVOKED", 4, "credential was revoked"),
        (401, "CREDENTIAL_EXPIRED", 4, "credential has expired"),
        (401, "CREDENTIAL_INVALID", 4, "does not accept this node's credential"),
    ],
)
def test_terminal_heartbeat_answer_stops_the_agent(
    tmp_path: Path, status: int, code: str, exit_code: int, explanation: str
) -> None:
    def respond(request: Recorded) -> Answer:
        if request.path == "/api/v1/agent/enroll":
            return 200, ENROLLED
        return status, _error(code)

    server = RecordingServer(respond=respond).start()
    try:
        result = run_agent(agent_env(tmp_path / "state", url=server.url))
    finally:
        server.stop()
    assert result.returncode == exit_code, result.stderr
    assert explanation in result.stderr
    assert [r.path for r in server.requests] == [
        "/api/v1/agent/enroll",
        "/api/v1/agent/heartbeat",
    ]
    assert "cred.jwt.value" not in result.stderr


@pytest.mark.parametrize(
    "code", ["ENROLLMENT_TOKEN_USED", "ENROLLMENT_TOKEN_EXPIRED", "ENROLLMENT_TOKEN_UNKNOWN"]
)
def test_refused_enrollment_stops_with_exit_6(tmp_path: Path, code: str) -> None:
    server = RecordingServer(respond=lambda _r: (409, _error(code))).start()
    try:
        result = run_agent(agent_env(tmp_path / "state", url=server.url))
    finally:
        server.stop()
    assert result.returncode == 6 and code in result.stderr
    assert len(server.requests) == 1
    assert not (tmp_path / "state" / "identity.json").exists()


def test_server_errors_are_retried_with_the_same_nonce(tmp_path: Path) -> None:
    """A lost answer (here: a 503) is retried with the nonce persisted before the first try."""
    answers = iter([(503, _error("SERVICE_UNAVAILABLE")), (200, ENROLLED)])

    def respond(request: Recorded) -> Answer:
        if request.path == "/api/v1/agent/enroll":
            return next(answers)
        return 403, _error("CREDENTIAL_REVOKED")

    server = RecordingServer(respond=respond).start()
    try:
        result = run_agent(agent_env(tmp_path / "state", url=server.url))
    finally:
        server.stop()
    assert "HTTP 503 SERVICE_UNAVAILABLE on POST /api/v1/agent/enroll (backoff 1s…16s)" in (
        result.stderr
    )
    enrolls = [r for r in server.requests if r.path == "/api/v1/agent/enroll"]
    assert len(enrolls) == 2
    nonces = {json.loads(r.body)["claim_nonce"] for r in enrolls}
    assert len(nonces) == 1
    assert (tmp_path / "state" / "identity.json").exists()
    assert "mfe_test-token-0123456789" not in result.stderr
