"""Keep the node credential out of reach of other processes of the agent's user — the jobs on a
bare-metal node, above all.

`make_undumpable` sets PR_SET_DUMPABLE=0 (prctl, through libc with ctypes): no core dump of a
process holding the credential, and a process of the same user without CAP_SYS_PTRACE can
neither ptrace the agent nor read its /proc memory, environment (the enrollment token), root,
working directory or descriptors. The agent's files are hidden from jobs by the runtime worker
(the agent names them in each job it hands over: `private_paths`).
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

_PR_SET_DUMPABLE = 4


def make_undumpable() -> None:
    """PR_SET_DUMPABLE=0 for this process (Linux; elsewhere nothing to do)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    zero = ctypes.c_ulong(0)
    if libc.prctl(_PR_SET_DUMPABLE, zero, zero, zero, zero) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_DUMPABLE): {os.strerror(errno)}")


def share_socket(path: Path, gid: int) -> None:
    """Let `gid` use the unix socket at `path` (mode 0660): the runtime worker's user, when it
    runs under a user of its own, reaches the agent through it."""
    os.chown(path, -1, gid)
    os.chmod(path, 0o660)


def private_paths(*paths: object) -> list[str]:
    """The absolute form of each path given (None skipped): what no job may read."""
    return [os.path.abspath(str(path)) for path in paths if path is not None]
