"""A claim whose connection closes while it waits is withdrawn at once (the real control plane
process over a real socket): a job submitted afterwards is not handed to the closed claim but
to the next one, exactly once (SC-2)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from tests.e2e.server import LiveServer
from tests.factories import PYTHON_JOB, heartbeat_body, inventory_body

pytestmark = pytest.mark.e2e


def test_a_closed_claim_is_withdrawn(tmp_path: Path) -> None:
    with LiveServer(tmp_path / "cp", f"sqlite:///{tmp_path / 'cp.db'}") as server:
        enrolled = server.enroll()
        node = {"Authorization": f"Bearer {enrolled['credential']}"}
        with server.client() as client:
            assert client.put("/api/v1/agent/inventory", headers=node, json=inventory_body())
            assert client.post("/api/v1/agent/heartbeat", headers=node, json=heartbeat_body())
            # Verified and cached: the claim below takes the agents' fast path.
            assert client.post("/api/v1/agent/heartbeat", headers=node, json=heartbeat_body())

            body = json.dumps({"hold_seconds": 30}).encode()
            request = (
                f"POST /api/v1/agent/work/claim HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: {node['Authorization']}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode() + body
            with socket.create_connection(("127.0.0.1", server.port)) as closed_claim:
                closed_claim.sendall(request)
                time.sleep(1.0)  # it waits in the scheduler
            time.sleep(1.0)  # closed: the server sees the disconnect and withdraws it

            job = client.post("/api/v1/jobs", headers=server.admin, json=PYTHON_JOB).json()
            time.sleep(0.5)
            queued = client.get(f"/api/v1/jobs/{job['job_id']}", headers=server.admin).json()
            assert queued["state"] == "queued", queued  # not handed to the closed claim
            claimed = client.post(
                "/api/v1/agent/work/claim", headers=node, json={"hold_seconds": 5}
            )
            assert claimed.status_code == 200 and claimed.json()["job_id"] == job["job_id"]
            events = client.get(f"/api/v1/jobs/{job['job_id']}/events", headers=server.admin).json()
            assert [e["data"].get("state") for e in events] == ["queued", "running"]
