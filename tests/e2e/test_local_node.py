"""`modelforge-control-plane --local-node` (issue 29) with real processes: the control plane starts
a node agent and a runtime worker beside it, enrolled with a token it minted for itself.

- One node comes online within 60 s, labelled `local=true`; the mint is audited as the actor
  `local-node`.
- The token is in no child's arguments or environment, in no log, and its file is gone once the
  agent holds its identity.
- A child killed is started again; Ctrl-C (SIGINT to the terminal's process group) and SIGTERM
  both stop the control plane and both children, and a control plane killed with SIGKILL leaves
  neither behind.
- A second start reuses the node: the same node id, no new enrollment, no new mint.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.e2e.local_node import LocalControlPlane, gone, short_directory
from tests.e2e.node import wait_until

pytestmark = pytest.mark.e2e

#: An enrollment token as control_plane/security.new_enrollment_token writes them.
TOKEN = re.compile(rb"mfe_[A-Za-z0-9_-]{20,}")


def _mints(server: LocalControlPlane) -> list[dict[str, object]]:
    return list(server.get("/api/v1/admin/audit?action=enrollment.mint"))


def _assert_no_token_anywhere(
    server: LocalControlPlane, children: dict[str, psutil.Process]
) -> None:
    for name, child in children.items():
        pid = child.pid
        assert not TOKEN.search(Path(f"/proc/{pid}/cmdline").read_bytes()), name
        environment = Path(f"/proc/{pid}/environ").read_bytes()
        assert not TOKEN.search(environment), name
        assert b"MODELFORGE_AGENT_ENROLLMENT_TOKEN=" not in environment, name
        assert b"MODELFORGE_ADMIN_TOKEN" not in environment, name
    for log in [server.log_path, *(server.data_dir / "local-node").glob("*.log")]:
        assert not TOKEN.search(log.read_bytes()), log


@pytest.fixture
def short() -> Iterator[Path]:
    with short_directory() as path:
        yield path


def test_a_local_node_enrolls_once_runs_beside_the_control_plane_and_stops_with_it(
    short: Path,
) -> None:
    server = LocalControlPlane(short / "run")
    with server:
        node, seconds = server.wait_online_node(timeout=60)
        assert seconds < 60
        assert node["labels"] == {"local": "true"}
        enrollments = server.get("/api/v1/admin/node-enrollments")
        assert [(e["node_id"], e["state"]) for e in enrollments] == [(node["node_id"], "claimed")]
        mints = _mints(server)
        assert [(m["actor"], m["target"]) for m in mints] == [
            ("local-node", enrollments[0]["enrollment_id"])
        ]

        children = server.children()
        token_file = server.data_dir / "local-node" / "enrollment-token"
        wait_until(lambda: not token_file.exists(), 10, "the token file to be removed")
        _assert_no_token_anywhere(server, children)

        # A child that dies is started again.
        children["worker"].send_signal(signal.SIGKILL)
        wait_until(
            lambda: server.children()["worker"].pid != children["worker"].pid,
            20,
            "the worker to be started again",
        )
        children = server.children()

        assert server.press_ctrl_c() == 0, server.log()
        for name, child in children.items():
            assert gone(child), f"{name} outlived the control plane"

    # The second start finds the agent's identity: the same node, nothing minted. On the same
    # port, as `make run` restarts: the agent's identity belongs to the URL it enrolled with
    # (on another port it refuses to start, exit 2).
    again = LocalControlPlane(short / "run", port=server.port)
    with again:
        second, seconds = again.wait_online_node(timeout=60)
        assert second["node_id"] == node["node_id"]
        assert len(again.get("/api/v1/admin/node-enrollments")) == 1
        assert len(_mints(again)) == 1
        children = again.children()
        _assert_no_token_anywhere(again, children)
        started = time.monotonic()
        assert again.stop() == 0, again.log()
        assert time.monotonic() - started < 60
        for name, child in children.items():
            assert gone(child), f"{name} outlived the control plane"

    # A control plane killed outright (no chance to stop them): the kernel stops both.
    crashed = LocalControlPlane(short / "run", port=server.port)
    with crashed:
        crashed.wait_online_node(timeout=60)
        children = crashed.children()
        crashed.kill()
        wait_until(
            lambda: all(gone(child) for child in children.values()),
            30,
            "the agent and the worker to end with the killed control plane",
        )
