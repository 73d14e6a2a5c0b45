"""Real time, real processes: liveness with short thresholds, shutdown flush, refusal of
contradictory settings at start-up."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select

from control_plane.models import Node
from tests.e2e.server import LiveServer, control_plane_executable, free_port
from tests.factories import heartbeat_body

pytestmark = pytest.mark.e2e

SHORT = {
    "MODELFORGE_NODE_STALE_AFTER_SECONDS": "2.0",
    "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": "4.0",
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
    "MODELFORGE_HEARTBEAT_FLUSH_INTERVAL_SECONDS": "0.2",
}


def _wait_for_state(client, server: LiveServer, node_id: str, state: str, within: float) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while time.monotonic() - start < within:
        if (
            client.get(f"/api/v1/admin/nodes/{node_id}", headers=server.admin).json()["state"]
            == state
        ):
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"node did not become {state} within {within} s")


def test_liveness_with_real_time(tmp_path: Path, database_url: str) -> None:
    with (
        LiveServer(tmp_path / "data", database_url, env_overrides=SHORT) as server,
        server.client() as client,
    ):
        enrolled = server.enroll("rt-host")
        node_id = enrolled["node_id"]
        auth = {"Authorization": f"Bearer {enrolled['credential']}"}
        assert (
            client.post("/api/v1/agent/heartbeat", headers=auth, json=heartbeat_body()).status_code
            == 200
        )
        assert (
            client.get(f"/api/v1/admin/nodes/{node_id}", headers=server.admin).json()["state"]
            == "online"
        )
        stale_after = _wait_for_state(client, server, node_id, "stale", within=5)
        offline_after = _wait_for_state(client, server, node_id, "offline", within=5)
        assert stale_after < 3.0 and offline_after < 3.0  # each 2 s after the previous state
        time.sleep(0.5)  # let the sweep record the transitions
        events = client.get(f"/api/v1/admin/nodes/{node_id}/events", headers=server.admin).json()
        transitions = [
            (e["from_state"], e["to_state"])
            for e in reversed(events)
            if e["kind"] == "state_changed"
        ]
        assert transitions == [("offline", "online"), ("online", "stale"), ("stale", "offline")]


def test_heartbeat_survives_graceful_stop(tmp_path: Path, database_url: str) -> None:
    """A 2xx heartbeat is written even when the process is stopped before the next flush."""
    env = {"MODELFORGE_HEARTBEAT_FLUSH_INTERVAL_SECONDS": "1.0"}
    server = LiveServer(tmp_path / "data", database_url, env_overrides=env).start()
    with server.client() as client:
        enrolled = server.enroll("rt-host")
        auth = {"Authorization": f"Bearer {enrolled['credential']}"}
        assert (
            client.post("/api/v1/agent/heartbeat", headers=auth, json=heartbeat_body()).status_code
            == 200
        )
    assert server.stop() == 0, server.log()
    engine = create_engine(database_url)
    with engine.connect() as conn:
        last = conn.scalar(select(Node.last_heartbeat_at).where(Node.id == enrolled["node_id"]))
    engine.dispose()
    assert last is not None, server.log()


@pytest.mark.parametrize(
    ("env", "names"),
    [
        (
            {
                "MODELFORGE_NODE_STALE_AFTER_SECONDS": "30",
                "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": "30",
            },
            ["MODELFORGE_NODE_OFFLINE_AFTER_SECONDS", "MODELFORGE_NODE_STALE_AFTER_SECONDS"],
        ),
        (
            {
                "MODELFORGE_NODE_STALE_AFTER_SECONDS": "60",
                "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": "20",
            },
            ["MODELFORGE_NODE_OFFLINE_AFTER_SECONDS", "MODELFORGE_NODE_STALE_AFTER_SECONDS"],
        ),
        (
            {"MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "30"},
            ["MODELFORGE_HEARTBEAT_INTERVAL_SECONDS", "MODELFORGE_NODE_STALE_AFTER_SECONDS"],
        ),
        ({"MODELFORGE_NODE_STALE_AFTER_SECONDS": "-1"}, ["MODELFORGE_NODE_STALE_AFTER_SECONDS"]),
        ({"MODELFORGE_DATABASE_URL": "mysql://db/x"}, ["MODELFORGE_DATABASE_URL"]),
    ],
)
def test_contradictory_liveness_settings_refuse_to_start(
    tmp_path: Path, env: dict[str, str], names: list[str]
) -> None:
    server = LiveServer(tmp_path / "data", f"sqlite:///{tmp_path / 'x.db'}", env_overrides=env)
    executable = control_plane_executable()
    result = subprocess.run(
        [executable], env=server.env(), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    for name in names:
        assert name in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.db").exists()  # refused before touching anything


def test_unreachable_database_is_a_clear_error(tmp_path: Path) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nothing"
    server = LiveServer(tmp_path / "data", url)
    executable = control_plane_executable()
    result = subprocess.run(
        [executable], env=server.env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "cannot reach the database" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("size", [5 * 1024, 256 * 1024])
def test_large_heartbeat_over_real_http(tmp_path: Path, database_url: str, size: int) -> None:
    """Granian delivers a large body in several chunks: the heartbeat seam hands the route the
    complete body (it once replayed only the first 4 KiB), and the answer is the usual one."""
    with (
        LiveServer(tmp_path / "data", database_url) as server,
        server.client() as client,
    ):
        credential = server.enroll("big-host")["credential"]
        auth = {"Authorization": f"Bearer {credential}", "Content-Type": "application/json"}
        body = json.dumps(heartbeat_body()).encode()
        padded = body[:-1] + b" " * (size - len(body)) + b"}"

        def chunks() -> Iterator[bytes]:
            for start in range(0, len(padded), 1000):
                yield padded[start : start + 1000]

        small = client.post("/api/v1/agent/heartbeat", headers=auth, content=body)
        for content in (padded, chunks()):
            large = client.post("/api/v1/agent/heartbeat", headers=auth, content=content)
            assert large.status_code == 200, large.text
            assert large.json() == small.json()
