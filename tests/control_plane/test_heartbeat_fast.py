"""The heartbeat fast path answers exactly like the FastAPI route, and hands everything it is
not certain about to that route (HB-4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from control_plane.api.heartbeat_fast import HeartbeatFastPath, accepted_heartbeat
from tests.factories import ControlPlane, control_plane, heartbeat_body


def _fast_path(cp: ControlPlane) -> HeartbeatFastPath:
    layer: Any = cp.client.app.middleware_stack  # type: ignore[attr-defined]
    while not isinstance(layer, HeartbeatFastPath):
        layer = layer.app
    return layer


def test_fast_and_full_paths_answer_alike(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        credential = enrolled["credential"]
        first = cp.heartbeat(credential)  # unknown jti: the full path reads its status
        fast = _fast_path(cp)
        assert fast.answered == 0
        second = cp.heartbeat(credential)
        assert fast.answered == 1
        assert first.status_code == second.status_code == 200
        assert first.json() == second.json()
        assert first.headers["content-type"] == second.headers["content-type"]
        cp.flush()
        node = cp.node(enrolled["node_id"])
        assert node["health"] == {"status": "healthy", "preflight": "passed"}
        assert node["state"] == "online"


def test_everything_uncertain_takes_the_full_path(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        credential, node_id = enrolled["credential"], enrolled["node_id"]
        cp.heartbeat(credential)
        fast = _fast_path(cp)
        headers = cp.agent(credential)
        cases = [
            (heartbeat_body(protocol=2), 426, "TOO_NEW"),
            (heartbeat_body(protocol=True), 426, "UNKNOWN"),
            ({**heartbeat_body(), "extra": 1}, 422, "INVALID_REQUEST"),
            (heartbeat_body(status="bored"), 422, "INVALID_REQUEST"),
            (heartbeat_body(message="x\x00y"), 422, "INVALID_REQUEST"),
        ]
        for body, status, code in cases:
            response = cp.client.post("/api/v1/agent/heartbeat", headers=headers, json=body)
            assert (response.status_code, response.json()["error"]["code"]) == (status, code)
        assert fast.answered == 0
        cp.client.post(f"/api/v1/admin/nodes/{node_id}/credential/revoke", headers=cp.admin)
        revoked = cp.heartbeat(credential)
        assert revoked.json()["error"]["code"] == "CREDENTIAL_REVOKED"
        assert fast.answered == 0


def test_body_acceptance_matches_the_schema() -> None:
    assert accepted_heartbeat(
        b'{"protocol_version":1,"agent_version":"1","health":'
        b'{"status":"healthy","preflight":"passed","message":null}}'
    ) == ("1", 1, {"status": "healthy", "preflight": "passed"})
    for body in (
        b"",
        b"[]",
        b"{}",
        b'{"protocol_version":1.0,"agent_version":"1","health":'
        b'{"status":"healthy","preflight":"passed"}}',
        b'{"protocol_version":1,"agent_version":"","health":'
        b'{"status":"healthy","preflight":"passed"}}',
        b'{"protocol_version":1,"agent_version":"1","health":{"status":"healthy"}}',
    ):
        assert accepted_heartbeat(body) is None
