"""How the local node (control_plane/local_node.py) starts and stops its children: what of this
process's environment they inherit, each in a session of its own, dying with the thread that
started it, stopped with SIGTERM and then SIGKILL to its process group.

Composition, as `local_node` is: only `local_node` imports it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("modelforge.control_plane.local_node")

#: Run as `python -c _LAUNCH <control plane pid> <module>`: ask the kernel for SIGTERM when the
#: thread that started this process ends (the setting survives exec), give up if that already
#: happened, then become `python -m <module>`.
_LAUNCH = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable, '-m', sys.argv[2]])\n"
)

#: The agent's variables the local node sets itself; the operator's other MODELFORGE_AGENT_*
#: variables (PARALLEL, CPUS, GPUS, SERVICE_HOST, …) reach the local agent unchanged.
SET_HERE = frozenset(
    {
        "MODELFORGE_AGENT_CONTROL_PLANE_URL",
        "MODELFORGE_AGENT_ENROLLMENT_TOKEN",
        "MODELFORGE_AGENT_ENROLLMENT_TOKEN_FILE",
        "MODELFORGE_AGENT_STATE_VOLUME",
        "MODELFORGE_AGENT_WORKER_SOCKET",
        "MODELFORGE_AGENT_SOCKET",
        # An idle exit (code 0) would only be followed by a restart here: the local agent
        # runs as long as its control plane.
        "MODELFORGE_AGENT_MAX_IDLE_SECONDS",
    }
)


def spawn(module: str, *, env: dict[str, str], cwd: Path, output: Path) -> subprocess.Popen[bytes]:
    """`python -m <module>` in a session of its own, its output appended to `output` (0600)."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return subprocess.Popen(  # noqa: S603 - our own interpreter and modules
            [sys.executable, "-c", _LAUNCH, str(os.getpid()), module],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        os.close(fd)


def stop(running: list[subprocess.Popen[bytes]], *, grace: float) -> None:
    """SIGTERM to each, SIGKILL to the process group of those still running after the grace."""
    for process in running:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("local node: pid %d ignored SIGTERM; killing it", process.pid)
            try:
                os.killpg(process.pid, signal.SIGKILL)  # its session's group is its pid
            except ProcessLookupError:
                pass
            process.wait()


def inherited(*, agent_variables: bool) -> dict[str, str]:
    """This process's environment without the control plane's settings (its database URL and
    admin token among them): only the operator's MODELFORGE_AGENT_* variables, for the agent."""
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("MODELFORGE_")
        or (agent_variables and name.startswith("MODELFORGE_AGENT_") and name not in SET_HERE)
    }
