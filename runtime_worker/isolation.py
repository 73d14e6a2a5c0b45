"""Linux process controls for running jobs, through libc with ctypes (the standard library has
no prctl, and os.unshare only from Python 3.12). Linux only.

- `set_parent_death_signal`, `become_subreaper`, `set_dumpable`: prctl(2) settings that let a
  job's supervisor learn of its worker's death from the kernel, see every orphan the job leaves,
  and keep other processes of the same user out of its memory and /proc entries.
- `hide_paths`: a view of the file system, for this process and what it starts, in which each
  path is covered (an empty, read-only tmpfs over a directory; /dev/null over a file). It takes a
  user and a mount namespace, then a second pair nested in the first, so that the covers are
  locked: nothing started afterwards can unmount one to see what is underneath. It needs no
  privilege where the kernel allows unprivileged user namespaces.
- `drop_capabilities`: no capability left, and none to regain by exec.

Failures raise `IsolationError` naming the step and the cause; nothing here is silent.
"""

from __future__ import annotations

import ctypes
import os
import stat
from collections.abc import Iterable
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


class IsolationError(OSError):
    """A process control the kernel refused; the message names the step."""


def _check(result: int, step: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise IsolationError(errno, f"{step}: {os.strerror(errno)}")


def _prctl(option: int, value: int, step: str) -> None:
    ulong = ctypes.c_ulong
    _check(_libc.prctl(option, ulong(value), ulong(0), ulong(0), ulong(0)), step)


def set_parent_death_signal(signum: int) -> None:
    """The kernel sends `signum` when the thread that started this process ends, however it
    ends (SIGKILL included). Check the parent's pid afterwards: it may already be gone."""
    _prctl(_PR_SET_PDEATHSIG, signum, "prctl(PR_SET_PDEATHSIG)")


def become_subreaper() -> None:
    """Orphaned descendants are reparented to this process instead of to init."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1, "prctl(PR_SET_CHILD_SUBREAPER)")


def set_dumpable(dumpable: bool) -> None:
    """Not dumpable: no core dump, and processes of the same user without CAP_SYS_PTRACE can
    neither ptrace this one nor read its /proc memory, environment, root or descriptors."""
    _prctl(_PR_SET_DUMPABLE, int(dumpable), "prctl(PR_SET_DUMPABLE)")


def hide_paths(paths: Iterable[str]) -> None:
    """Cover each of `paths` in this process's view of the file system (see the module)."""
    uid, gid = os.geteuid(), os.getegid()
    _unshare()
    # Covered before anything else: a process that is not dumpable keeps its view to itself
    # until then, and mounting needs no id mapping yet.
    _check(
        _libc.mount(None, b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None),
        "making the mounts private",
    )
    for path in paths:
        _cover(path)
    _map_ids(uid, gid)
    # Mounts copied into a namespace owned by a less privileged user namespace are locked.
    _unshare()
    _map_ids(uid, gid)


def _unshare() -> None:
    _check(_libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")


def _map_ids(uid: int, gid: int) -> None:
    """The same ids inside the new user namespace as outside: files keep their owners, sockets
    their permissions."""
    # A process that is not dumpable has its /proc files owned by root: writable only while
    # dumpable.
    was = _libc.prctl(_PR_GET_DUMPABLE, ctypes.c_ulong(0), ctypes.c_ulong(0))
    set_dumpable(True)
    try:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    except OSError as exc:
        raise IsolationError(exc.errno or 0, f"mapping ids in a user namespace: {exc}") from None
    finally:
        set_dumpable(was == 1)


def _cover(path: str) -> None:
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return  # nothing there to hide
    target = os.fsencode(path)
    if is_dir:
        flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        result = _libc.mount(b"tmpfs", target, b"tmpfs", ctypes.c_ulong(flags), b"size=4k,mode=0")
    else:
        result = _libc.mount(b"/dev/null", target, None, ctypes.c_ulong(_MS_BIND), None)
    _check(result, f"covering {path}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capabilities() -> None:
    """No capability left in any set, none to regain by exec, no privilege to gain by setuid."""
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last = 63
    for capability in range(last + 1):  # first, while CAP_SETPCAP is still held
        _prctl(_PR_CAPBSET_DROP, capability, "prctl(PR_CAPBSET_DROP)")
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()  # all zero
    _check(_libc.capset(ctypes.byref(header), data), "capset")
    _prctl(_PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")
