"""The node agent end to end with real processes: control plane on Granian, runtime worker,
agent — in cpu mode and in nvidia mode over the substitute NVML."""

from __future__ import annotations

import grp
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.node import Node, live_stack, wait_ready, wait_until
from tests.e2e.server import FAST, LiveServer
from tests.nvml_substitute import EXPECTED_GPUS, build_fake_nvml

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_nvml(tmp_path_factory.mktemp("nvml"))


def _node_view(server: LiveServer, node_id: str) -> dict[str, Any]:
    return dict(server.get(f"/api/v1/admin/nodes/{node_id}"))


@pytest.mark.parametrize("mode", ["cpu", "nvidia"])
def test_node_becomes_ready_then_goes_stale_and_offline(
    tmp_path: Path, nvml_dir: Path, mode: str
) -> None:
    nvml = nvml_dir if mode == "nvidia" else None
    with live_stack(tmp_path, FAST, mode=mode, nvml_dir=nvml) as (server, node):
        node_id = node.start_worker().start_agent().node_id()
        wait_ready(server, node_id, 20, "readiness")
        readiness = server.get(f"/api/v1/admin/nodes/{node_id}/readiness")
        assert {c["status"] for c in readiness["checks"]} == {"pass"}, readiness
        view = _node_view(server, node_id)
        assert view["state"] == "online"
        inventory, telemetry = view["inventory"], view["telemetry"]
        assert inventory["accelerator_mode"] == mode
        assert inventory["runtime_worker"]["protocol_version"] == 1
        if mode == "nvidia":
            assert [g["uuid"] for g in inventory["gpus"]] == [g["uuid"] for g in EXPECTED_GPUS]
            assert [g["memory_total_mb"] for g in inventory["gpus"]] == [143771, 143771]
            for reported, expected in zip(telemetry["gpus"], EXPECTED_GPUS, strict=True):
                for key in (
                    "uuid",
                    "memory_used_mb",
                    "utilization_percent",
                    "temperature_c",
                    "power_draw_w",
                    "power_limit_w",
                ):
                    assert reported[key] == expected[key], key
                # ECC is not supported by this "GPU": the field is absent, not zero.
                assert "ecc_volatile_corrected" not in reported
        else:
            assert inventory["gpus"] == [] and telemetry["gpus"] == []
        assert "cpu_percent" in telemetry["host"]

        # Secrets never reach the agent's log or its process arguments.
        cmdline = Path(f"/proc/{node.agent.pid}/cmdline").read_bytes()  # type: ignore[union-attr]
        credential = (node.state / "identity.json").read_text()
        credential_value = re.search(r'"credential": "([^"]+)"', credential).group(1)  # type: ignore[union-attr]
        assert node.token is not None
        for secret in (node.token, credential_value):
            assert secret.encode() not in cmdline
            assert secret not in node.log()

        assert node.stop_agent() == 0
        stopped_at = _node_view(server, node_id)["last_heartbeat_at"]
        took_stale = wait_until(lambda: _node_view(server, node_id)["state"] == "stale", 8, "stale")
        wait_until(lambda: _node_view(server, node_id)["state"] == "offline", 8, "offline")
        assert took_stale <= 4.5  # stale after 4 s of silence, within one poll
        time.sleep(1)
        # The recorded heartbeat genuinely stopped advancing.
        assert _node_view(server, node_id)["last_heartbeat_at"] == stopped_at
        events = server.get(f"/api/v1/admin/nodes/{node_id}/events")
        transitions = [
            (e["from_state"], e["to_state"])
            for e in reversed(events)
            if e["kind"] == "state_changed"
        ]
        assert transitions[-2:] == [("online", "stale"), ("stale", "offline")]


def test_kill_9_and_restart_keeps_the_identity(tmp_path: Path) -> None:
    with live_stack(tmp_path, FAST) as (server, node):
        node.start_worker().start_agent()
        node_id = node.node_id()
        wait_until(lambda: _node_view(server, node_id)["state"] == "online", 10, "online")
        assert node.stop_agent(signal.SIGKILL) == -signal.SIGKILL
        node.start_agent()  # the token is still in its environment
        wait_until(lambda: "identity of node" in node.log(), 10, "identity loaded")
        assert node.node_id() == node_id
        assert f"identity of node {node_id} loaded; the enrollment token" in node.log()
        nodes = server.get("/api/v1/admin/nodes")
        assert [n["node_id"] for n in nodes] == [node_id]
        enrolled = [
            e
            for e in server.get(f"/api/v1/admin/nodes/{node_id}/events")
            if e["kind"] in ("enrolled", "credential_reissued")
        ]
        assert len(enrolled) == 1
        before = _node_view(server, node_id)["last_heartbeat_at"]
        wait_until(
            lambda: _node_view(server, node_id)["last_heartbeat_at"] != before,
            5,
            "heartbeats after restart",
        )


def test_revoked_credential_stops_the_agent(tmp_path: Path) -> None:
    with live_stack(tmp_path, FAST) as (server, node):
        node.start_worker().start_agent()
        node_id = node.node_id()
        wait_until(lambda: _node_view(server, node_id)["state"] == "online", 10, "online")
        with server.client() as client:
            client.post(f"/api/v1/admin/nodes/{node_id}/credential/revoke", headers=server.admin)
        assert node.wait_agent_exit(timeout=10) == 4
        log = node.log()
        assert "credential was revoked" in log
        assert log.count("CREDENTIAL_REVOKED") <= 1  # no retry storm


def test_control_plane_outage_backs_off_and_recovers(tmp_path: Path) -> None:
    env = dict(
        FAST, MODELFORGE_NODE_STALE_AFTER_SECONDS="30", MODELFORGE_NODE_OFFLINE_AFTER_SECONDS="90"
    )
    with live_stack(tmp_path, env) as (server, node):
        node.start_worker().start_agent()
        node_id = node.node_id()
        wait_until(lambda: _node_view(server, node_id)["state"] == "online", 10, "online")
        assert server.stop() == 0
        line = "ConnectError on POST /api/v1/agent/heartbeat (backoff 1s…16s)"
        # The heartbeats' own 16 s: each loop backs off on its own, and another loop's line may
        # say 16 s first (a CI run read the heartbeats' waits as [1, 2, 4, 8] then).
        wait_until(
            lambda: f"{line}; next attempt in 16s" in node.log(),
            45,
            "backoff to reach 16 s",
            interval=0.5,
        )
        log = node.log()
        assert line in log
        # Each loop backs off on its own: the heartbeats' waits double up to 16 s, whatever
        # each failure was (while Granian stops, the native front in front of it answers 502,
        # then its port is closed).
        failed = r" on POST /api/v1/agent/heartbeat \(backoff 1s…16s\); next attempt in (\d+)s"
        waits = [int(w) for w in re.findall(failed, log)]
        assert max(waits) == 16 and waits[:4] == [1, 2, 4, 8]
        assert re.search(r"last success \d+s ago", log)
        server.start()
        back = time.monotonic()
        seen = _node_view(server, node_id)["last_heartbeat_at"]
        wait_until(
            lambda: _node_view(server, node_id)["last_heartbeat_at"] != seen,
            20,
            "a heartbeat after the control plane returned",
            interval=0.2,
        )
        assert time.monotonic() - back <= 17
        assert "reconnected to the control plane" in node.log()


def test_an_incompatible_runtime_worker_marks_the_node_and_keeps_it_online(
    tmp_path: Path,
) -> None:
    """A runtime worker of another protocol: the node stays online and heartbeating, shows
    Needs upgrade naming the runtime worker (heartbeats do not clear it), the agent says once
    what to upgrade; a compatible worker clears the mark and the node becomes ready."""
    with live_stack(tmp_path, FAST) as (server, node):
        node.start_fake_worker(protocol=99, version="9.9.9").start_agent()
        node_id = node.node_id()

        def marked() -> dict[str, Any] | None:
            mark = _node_view(server, node_id)["needs_upgrade"]
            return dict(mark) if mark and mark["component"] == "runtime-worker" else None

        wait_until(lambda: marked() is not None, 20, "Needs upgrade for the runtime worker")
        assert (marked() or {})["code"] == "TOO_NEW"
        first = _node_view(server, node_id)["last_heartbeat_at"]
        time.sleep(3)  # six heartbeat intervals
        view = _node_view(server, node_id)
        assert view["state"] == "online"
        assert view["last_heartbeat_at"] != first
        assert marked() is not None  # heartbeats leave the worker's mark alone
        assert node.agent is not None and node.agent.poll() is None, node.log()
        readiness = server.get(f"/api/v1/admin/nodes/{node_id}/readiness")
        protocol = next(c for c in readiness["checks"] if c["name"] == "protocol")
        assert protocol["status"] == "fail" and "runtime-worker" in protocol["detail"]
        log = node.log()
        assert log.count("must be upgraded") == 1, log
        assert "runtime worker 9.9.9 (protocol 99)" in log
        events = server.get(f"/api/v1/admin/nodes/{node_id}/events")
        assert [e["kind"] for e in events].count("needs_upgrade") == 1

        node.stop_worker()
        node.start_worker()
        wait_ready(server, node_id, 30, "readiness with a compatible worker")
        assert _node_view(server, node_id)["needs_upgrade"] is None
        assert node.agent.poll() is None
        assert "is compatible" in node.log()


def test_sockets_shared_with_a_group_for_a_worker_under_its_own_user(tmp_path: Path) -> None:
    """Separate users on bare metal: each socket is 0660 for the group named, and the node works
    through them."""
    group = grp.getgrgid(65534).gr_name
    sockets = {"MODELFORGE_AGENT_SOCKET_GROUP": group, "MODELFORGE_WORKER_SOCKET_GROUP": group}
    with live_stack(tmp_path, FAST, extra_env=sockets) as (server, node):
        node_id = node.start_worker().start_agent().node_id()
        wait_ready(server, node_id, 30, "readiness")
        for path in (node.socket, node.root / "agent.sock"):
            info = path.stat()
            assert stat.S_IMODE(info.st_mode) == 0o660, path
            assert info.st_gid == 65534, path


def test_a_worker_socket_group_that_does_not_exist_stops_the_worker(tmp_path: Path) -> None:
    node = Node(
        tmp_path / "node",
        "http://127.0.0.1:9",
        extra_env={"MODELFORGE_WORKER_SOCKET_GROUP": "no-such-group-modelforge"},
    )
    result = subprocess.run(
        [sys.executable, "-m", "runtime_worker"],
        env=node.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "MODELFORGE_WORKER_SOCKET_GROUP" in result.stderr
    assert "no group 'no-such-group-modelforge'" in result.stderr
    assert not node.socket.exists()
