"""The agents' fast path answers heartbeats, claims and completions exactly like the FastAPI
routes, and hands everything it is not certain about to those routes with the complete body
(HB-4, SC-3)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from control_plane.api.agent_fast import AgentFastPath
from control_plane.api.agent_frame import FAST_BODY_LIMIT
from control_plane.api.edge import Edge
from control_plane.api.gateway import Gateway
from control_plane.api.gateway_peers import PeerRoute
from modelforge_contracts import protocol
from tests.control_plane.test_jobs import _claim, _node, _submit
from tests.factories import ControlPlane, control_plane, heartbeat_body


def _fast_path(cp: ControlPlane) -> AgentFastPath:
    served = cp.client.app
    assert isinstance(served, AgentFastPath)  # the served app: the fast path is outermost,
    # Whatever it does not answer meets the gateway, then the replicas' internal route, and
    # what neither takes, the edge.
    assert isinstance(served.app, Gateway)
    assert isinstance(served.app.app, PeerRoute)
    assert isinstance(served.app.app.app, Edge)
    return served


def test_fast_and_full_paths_answer_alike(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        enrolled = cp.enroll()
        credential = enrolled["credential"]
        first = cp.heartbeat(credential)  # unknown jti: the full path reads its status
        fast = _fast_path(cp)
        assert fast.heartbeats == 0
        second = cp.heartbeat(credential)
        assert fast.heartbeats == 1
        assert first.status_code == second.status_code == 200
        assert first.json() == second.json()
        for header in ("content-type", "content-security-policy", "x-content-type-options"):
            assert first.headers[header] == second.headers[header], header
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
        assert fast.heartbeats == 0
        cp.client.post(f"/api/v1/admin/nodes/{node_id}/credential/revoke", headers=cp.admin)
        revoked = cp.heartbeat(credential)
        assert revoked.json()["error"]["code"] == "CREDENTIAL_REVOKED"
        assert fast.heartbeats == 0


def _padded(size: int) -> bytes:
    body = json.dumps(heartbeat_body()).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


@pytest.mark.parametrize("size", [5 * 1024, FAST_BODY_LIMIT + 1, 4 * FAST_BODY_LIMIT])
def test_a_large_heartbeat_is_answered_like_a_small_one(
    tmp_path: Path, database_url: str, size: int
) -> None:
    """Valid JSON padded with whitespace: read whole by the seam, or handed on complete."""
    with control_plane(tmp_path, database_url) as cp:
        credential = cp.enroll()["credential"]
        small = cp.heartbeat(credential)
        headers = {**cp.agent(credential), "content-type": "application/json"}
        body = _padded(size)
        assert len(body) == size
        large = cp.client.post("/api/v1/agent/heartbeat", headers=headers, content=body)
        assert large.status_code == 200, large.text
        assert large.json() == small.json()
        assert _fast_path(cp).heartbeats == (1 if size <= FAST_BODY_LIMIT else 0)


def test_the_answer_names_the_agents_protocol(
    tmp_path: Path, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a range wider than one version, each agent is told the protocol it speaks."""
    monkeypatch.setattr(protocol, "PROTOCOL_MAX", 2)
    with control_plane(tmp_path, database_url) as cp:
        credential = cp.enroll()["credential"]
        cp.heartbeat(credential)  # the first one verifies the credential on the full path
        for spoken in (1, 2, 1):
            answer = cp.heartbeat(credential, protocol=spoken).json()["compatibility"]
            assert answer == {
                "status": "compatible",
                "protocol_version": spoken,
                "accepted": [1, 2],
            }
        assert _fast_path(cp).heartbeats == 3


@pytest.mark.parametrize("depth", [100, 1_000, 100_000])
def test_deeply_nested_heartbeat_is_refused_with_a_code(
    tmp_path: Path, database_url: str, depth: int
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        credential = cp.enroll()["credential"]
        cp.heartbeat(credential)
        headers = {**cp.agent(credential), "content-type": "application/json"}
        nested = "[" * depth + "]" * depth
        for body in (nested, json.dumps(heartbeat_body())[:-1] + ',"x":' + nested + "}"):
            response = cp.client.post("/api/v1/agent/heartbeat", headers=headers, content=body)
            assert response.status_code == 422, response.text
            assert response.json()["error"]["code"] == "JSON_TOO_DEEP"
        assert cp.heartbeat(credential).status_code == 200  # the server is fine


def test_the_edge_bounds_heartbeats_and_heads_their_answers(
    tmp_path: Path, database_url: str
) -> None:
    """The edge is in front of the fast path: a heartbeat over the body limit is refused even
    chunked, one the fast path answers still gets the security headers, and a non-finite
    number reaches the JSON guard, not the service."""
    with control_plane(tmp_path, database_url, max_body_bytes=64 * 1024) as cp:
        credential = cp.enroll()["credential"]
        cp.heartbeat(credential)
        fast = _fast_path(cp)
        answered = cp.heartbeat(credential)
        assert fast.heartbeats == 1
        assert "default-src 'none'" in answered.headers["content-security-policy"]
        headers = {**cp.agent(credential), "content-type": "application/json"}
        body = _padded(65 * 1024)

        def chunked() -> Iterator[bytes]:
            for start in range(0, len(body), 4096):
                yield body[start : start + 4096]

        for content in (body, chunked()):
            response = cp.client.post("/api/v1/agent/heartbeat", headers=headers, content=content)
            assert response.status_code == 413, response.text
            assert response.json()["error"]["code"] == "REQUEST_TOO_LARGE"
        nan = json.dumps(heartbeat_body()).replace(
            '"protocol_version": 1', '"protocol_version": NaN'
        )
        response = cp.client.post("/api/v1/agent/heartbeat", headers=headers, content=nan)
        assert (response.status_code, response.json()["error"]["code"]) == (422, "JSON_NOT_FINITE")
        assert fast.heartbeats == 1


def test_claims_and_completions_take_the_fast_path_and_answer_alike(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp)  # its heartbeat verified the credential: cached
        other = _node(cp)
        fast = _fast_path(cp)
        headers = {"Authorization": node["Authorization"]}
        jobs = [_submit(cp) for _ in range(2)]
        claimed = cp.client.post(
            "/api/v1/agent/work/claim", headers=headers, json={"hold_seconds": 5}
        )
        assert claimed.status_code == 200 and fast.claims == 1
        assert claimed.json()["job_id"] == jobs[0]["job_id"]
        assert claimed.headers["content-security-policy"]
        # A claim with no work: 204 with no body, from the fast path too.
        assert _claim(cp, node)["job_id"] == jobs[1]["job_id"]  # type: ignore[index]
        empty = cp.client.post(
            "/api/v1/agent/work/claim", headers=headers, json={"hold_seconds": 0}
        )
        assert empty.status_code == 204 and empty.content == b"" and fast.claims == 3

        done = cp.client.post(
            f"/api/v1/agent/jobs/{jobs[0]['job_id']}/complete",
            headers=headers,
            json={"state": "succeeded", "result": {"y": 42}},
        )
        assert (done.status_code, done.json()) == (200, {"cancel": False})
        assert fast.completions == 1
        view = cp.client.get(f"/api/v1/jobs/{jobs[0]['job_id']}", headers=cp.admin).json()
        assert view["state"] == "succeeded" and view["result"] == {"y": 42}

        # Refusals from the fast path are the routes' refusals.
        again = cp.client.post(
            f"/api/v1/agent/jobs/{jobs[0]['job_id']}/complete",
            headers=headers,
            json={"state": "succeeded"},
        )
        assert again.status_code == 409 and again.json()["error"]["code"] == "JOB_NOT_RUNNING"
        stranger = cp.client.post(
            f"/api/v1/agent/jobs/{jobs[1]['job_id']}/complete",
            headers={"Authorization": other["Authorization"]},
            json={"state": "succeeded"},
        )
        assert stranger.status_code == 404
        assert stranger.json()["error"]["code"] == "JOB_NOT_ASSIGNED"

        # What it is not sure of goes to the routes: a non-finite result, an unknown field.
        not_finite = cp.client.post(
            f"/api/v1/agent/jobs/{jobs[1]['job_id']}/complete",
            headers={**headers, "Content-Type": "application/json"},
            content=b'{"state": "succeeded", "result": NaN}',
        )
        assert not_finite.status_code == 422
        assert not_finite.json()["error"]["code"] == "JSON_NOT_FINITE"
        unknown = cp.client.post(
            f"/api/v1/agent/jobs/{jobs[1]['job_id']}/complete",
            headers=headers,
            json={"state": "succeeded", "surprise": 1},
        )
        assert unknown.status_code == 422
        assert unknown.json()["error"]["code"] == "INVALID_REQUEST"
        running = cp.client.get(f"/api/v1/jobs/{jobs[1]['job_id']}", headers=cp.admin).json()
        assert running["state"] == "running"  # none of them changed it


def test_a_claim_whose_credential_is_revoked_while_it_waits_is_refused(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        with ThreadPoolExecutor(max_workers=1) as pool:
            waiting = pool.submit(
                cp.client.post,
                "/api/v1/agent/work/claim",
                headers={"Authorization": node["Authorization"]},
                json={"hold_seconds": 20},
            )
            while cp.ctx.scheduler.waiting == 0:
                time.sleep(0.01)
            cp.client.post(
                f"/api/v1/admin/nodes/{node['node_id']}/credential/revoke", headers=cp.admin
            )
            refused = waiting.result(timeout=10)
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "CREDENTIAL_REVOKED"
        assert _fast_path(cp).claims == 1


def test_heartbeat_bodies_judged_once_are_recorded_per_node(
    tmp_path: Path, database_url: str
) -> None:
    """The fast path answers a body it judged before from memory; each node still gets its own
    heartbeat recorded, with the health its own body said, and the memory stays bounded."""
    with control_plane(tmp_path, database_url) as cp:
        first, second = cp.enroll(), cp.enroll()
        for enrolled in (first, second):
            cp.heartbeat(enrolled["credential"])  # first contact: the route
        fast = _fast_path(cp)
        degraded = {"status": "degraded", "message": "GPU 1 is hot"}
        for _ in range(3):
            assert cp.heartbeat(first["credential"]).status_code == 200
            assert cp.heartbeat(second["credential"], **degraded).status_code == 200
        assert fast.heartbeats == 6
        cp.flush()
        assert cp.node(first["node_id"])["health"] == {"status": "healthy", "preflight": "passed"}
        assert cp.node(second["node_id"])["health"] == {"preflight": "passed", **degraded}
        # Hundreds of distinct bodies: each judged and answered alike, the memory bounded.
        answers = {
            cp.heartbeat(first["credential"], message=f"note {index}").text for index in range(300)
        }
        assert len(answers) == 1
        assert fast.heartbeats == 306
        assert len(fast._judged) <= 256
        cp.flush()
        assert cp.node(first["node_id"])["health"]["message"] == "note 299"


def test_the_first_of_repeated_headers_counts_as_on_the_route(
    tmp_path: Path, database_url: str
) -> None:
    """Two Authorization headers: the fast path reads the first, as the route does."""
    with control_plane(tmp_path, database_url) as cp:
        credential = cp.enroll()["credential"]
        cp.heartbeat(credential)
        fast = _fast_path(cp)
        body = json.dumps(heartbeat_body()).encode()
        for first, second, status in (
            (credential, "not-a-credential", 200),
            ("not-a-credential", credential, 401),
        ):
            headers = [
                ("authorization", f"Bearer {first}"),
                ("authorization", f"Bearer {second}"),
                ("content-type", "application/json"),
            ]
            response = cp.client.post("/api/v1/agent/heartbeat", headers=headers, content=body)
            assert response.status_code == status, response.text
        assert fast.heartbeats == 1  # the second went to the route, which refused it
