"""The runtime worker runs as its own process and answers only on a private unix socket."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from node_agent.worker_link import query_runtime_worker


def test_worker_reports_version_protocol_and_health(tmp_path: Path) -> None:
    sock = tmp_path / "run" / "worker.sock"
    env = dict(os.environ, MODELFORGE_WORKER_SOCKET=str(sock))
    process = subprocess.Popen(
        [sys.executable, "-m", "runtime_worker"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        assert stat.S_ISSOCK(sock.stat().st_mode)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600  # the local agent only
        report = query_runtime_worker(sock)
        assert report is not None
        assert report["protocol_version"] == 1 and report["healthy"] is True
        assert report["version"]
        # No network listener: the process holds no TCP socket.
        listening = subprocess.run(
            ["cat", f"/proc/{process.pid}/net/tcp"], capture_output=True, text=True
        ).stdout
        inode_lines = [line for line in listening.splitlines()[1:] if " 0A " in line]
        own = {
            os.readlink(f"/proc/{process.pid}/fd/{fd}")
            for fd in os.listdir(f"/proc/{process.pid}/fd")
        }
        assert not any(f"socket:[{line.split()[9]}]" in own for line in inode_lines)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=10)
    assert process.returncode == 0, stderr
    assert not sock.exists()


def test_agent_reports_absent_worker_as_none(tmp_path: Path) -> None:
    assert query_runtime_worker(tmp_path / "missing.sock") is None
    stale = tmp_path / "stale.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(stale))
    listener.close()  # a socket file with nobody behind it
    assert query_runtime_worker(stale, timeout=1) is None


def test_unusable_socket_path_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    env = dict(os.environ, MODELFORGE_WORKER_SOCKET=str(blocker / "worker.sock"))
    result = subprocess.run(
        [sys.executable, "-m", "runtime_worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 2
    assert "MODELFORGE_WORKER_SOCKET" in result.stderr and "Traceback" not in result.stderr
