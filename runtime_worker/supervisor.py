"""The supervisor of one job or service: the process the runtime worker starts for it, between
the two.

`python -m runtime_worker.supervisor`, in the job's work directory, reads one JSON object from
stdin — `{"worker_pid", "hide", "spec", "python"}` — and runs the job (runtime_worker.job_host,
under `python` when given: runtime_worker.job_python) in a process group of its own. With
`"argv": [...]` instead of `"spec"` (a service, runtime_worker.services) it execs that argv
instead, with stdin from /dev/null; with
`"report_fd"` it writes `{"pid": <the process it started>}` (or `{"error": {"code", "message"}}`
when it could not start it) as one JSON line to that descriptor and closes it. Everything below
holds for both. It exists so that nothing a job starts can outlive its worker, even a worker
killed with SIGKILL, which gets no chance to clean up:

- The kernel tells it when the worker dies (PR_SET_PDEATHSIG): no cooperation from the worker.
- It is a child subreaper (PR_SET_CHILD_SUBREAPER): whatever the job starts and orphans — a
  daemon that double-forked and called setsid included — is reparented to it, not to init.
- When the job's process ends, when the worker asks (SIGTERM), or when the worker dies, it ends
  every process below it: SIGTERM, half a second's grace, then SIGKILL, reaping until none is
  left. Then it removes the work directory and exits with the job's status.
- `hide` lists paths the job must not see (the agent's state directory): the job gets a view
  where they are covered and no capabilities (runtime_worker.isolation). If that is not
  possible the job does not run, and fails with `JOB_ISOLATION_UNAVAILABLE` (a service: the
  report says `SERVICE_ISOLATION_UNAVAILABLE`).

It is not dumpable, so other jobs of the same user cannot reach into it. It writes nothing to
the job's output. A job that deliberately kills its own supervisor can leave processes behind;
only a separate user or a container (cgroup) bounds that.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modelforge_contracts.job_records import job_error
from runtime_worker import isolation
from runtime_worker.job import write_record

#: How long the job's processes have between SIGTERM and SIGKILL.
GRACE = 0.5
ISOLATION_UNAVAILABLE = "JOB_ISOLATION_UNAVAILABLE"
SERVICE_ISOLATION_UNAVAILABLE = "SERVICE_ISOLATION_UNAVAILABLE"
_WATCHED = {signal.SIGTERM, signal.SIGCHLD}


def main() -> int:
    # Signals are taken synchronously (sigtimedwait), never as exceptions at random points.
    signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
    isolation.set_parent_death_signal(signal.SIGTERM)
    isolation.become_subreaper()
    isolation.set_dumpable(False)
    workdir = Path.cwd()
    status: int | None = None
    try:
        envelope = json.loads(sys.stdin.buffer.read() or b"null")
        if not isinstance(envelope, dict) or os.getppid() != envelope.get("worker_pid"):
            return 1  # the worker is already gone: nothing to run for
        report = _Report(envelope.get("report_fd"))
        argv = envelope.get("argv")
        if argv is not None and (not isinstance(argv, list) or not argv):
            return 1  # not an envelope the worker writes
        hide = [str(path) for path in envelope.get("hide") or []]
        if hide:
            try:
                isolation.hide_paths(hide)
            except isolation.IsolationError as exc:
                if argv is None:
                    write_record(job_error(ISOLATION_UNAVAILABLE, _unavailable(hide, exc, "job")))
                else:
                    message = _unavailable(hide, exc, "service")
                    report.send(
                        {"error": {"code": SERVICE_ISOLATION_UNAVAILABLE, "message": message}}
                    )
                return 1
        if signal.SIGTERM not in signal.sigpending():
            if argv is None:
                python = str(envelope.get("python") or sys.executable)
                child = _start_job(envelope.get("spec"), isolated=bool(hide), python=python)
            else:
                child = _start_argv([str(arg) for arg in argv], isolated=bool(hide))
            report.send({"pid": child})
            status = _wait_for(child)
        report.close()
    finally:
        _end_descendants()
        remove_tree(workdir)
    return _exit_like(status)


def remove_tree(path: Path) -> None:
    """Remove `path` and all below it, also what the job made unwritable (chmod 0)."""

    def writable_then_again(function: Callable[..., Any], name: str, _exc: Any) -> None:
        try:
            parent = os.path.dirname(name)
            os.chmod(parent, os.stat(parent).st_mode | stat.S_IRWXU)
            if os.path.isdir(name) and not os.path.islink(name):
                os.chmod(name, stat.S_IRWXU)
                shutil.rmtree(name, onerror=writable_then_again)
            else:
                function(name)
        except OSError:
            pass  # what cannot be removed stays; the next worker start tries again

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=writable_then_again)
    else:
        path.unlink(missing_ok=True)


class _Report:
    """The descriptor the worker reads what it started from; nothing when it gave none. It is
    not inherited by what this process starts."""

    def __init__(self, fd: Any) -> None:
        self._fd = fd if isinstance(fd, int) and not isinstance(fd, bool) else None
        if self._fd is not None:
            try:
                os.set_inheritable(self._fd, False)
            except OSError:
                self._fd = None

    def send(self, message: dict[str, Any]) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, (json.dumps(message) + "\n").encode())
        except OSError:
            pass  # the worker stopped listening; its own checks see the rest
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


def _unavailable(hide: list[str], exc: OSError, what: str) -> str:
    return (
        f"the node agent's private files ({', '.join(hide)}) are readable by the runtime "
        f"worker's user, and this host does not let the worker hide them from the {what} "
        f"({exc}). "
        "Run the runtime worker and its jobs as a user that cannot read them (docs/nodes.md, "
        "separate users), or allow unprivileged user namespaces"
    )


def _start_job(spec: Any, *, isolated: bool, python: str) -> int:
    """Fork and exec the job host under `python` in a process group of its own; it reads `spec`
    on stdin."""
    supervisor = os.getpid()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(write_end)
            os.setpgid(0, 0)
            isolation.set_parent_death_signal(signal.SIGKILL)
            if os.getppid() != supervisor:
                os._exit(1)
            isolation.set_dumpable(True)
            if isolated:
                isolation.drop_capabilities()
            os.dup2(read_end, 0)
            os.close(read_end)
            for signum in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(signum, signal.SIG_DFL)  # as subprocess leaves them for a child
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            os.execv(python, [python, "-m", "runtime_worker.job_host"])  # noqa: S606 - fixed argv
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(127)
    os.close(read_end)
    try:
        with os.fdopen(write_end, "wb") as handle:
            handle.write(json.dumps(spec).encode())
    except BrokenPipeError:
        pass  # the job ended before reading it; its status says why
    return pid


def _start_argv(argv: list[str], *, isolated: bool) -> int:
    """Fork and exec `argv` (searched on the PATH of this environment, which the worker made
    the service's) in a process group of its own, stdin from /dev/null. A failed exec prints
    why to the service's output and exits 127."""
    supervisor = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            isolation.set_parent_death_signal(signal.SIGKILL)
            if os.getppid() != supervisor:
                os._exit(1)
            isolation.set_dumpable(True)
            if isolated:
                isolation.drop_capabilities()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            for signum in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            os.execvp(argv[0], argv)  # noqa: S606 - the service's command, as deployed
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(127)
    return pid


def _wait_for(job: int) -> int | None:
    """The job's wait status, or None when the worker asked to stop or died first. Orphans
    reparented here are reaped on the way."""
    while True:
        info = signal.sigtimedwait(_WATCHED, 1.0)
        if info is not None and info.si_signo == signal.SIGTERM:
            return None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return None  # cannot happen while the job runs; nothing left to wait for
            if pid == 0:
                break
            if pid == job:
                return status


def _descendants() -> list[tuple[int, str]]:
    """(pid, state) of every process below this one, from /proc."""
    children: dict[int, list[tuple[int, str]]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append((int(name), fields[0]))
    found: list[tuple[int, str]] = []
    todo = [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _end_descendants() -> None:
    """SIGTERM everything below, a grace, then SIGKILL until no child is left to reap."""
    living = [pid for pid, state in _descendants() if state != "Z"]
    if living:
        _signal_all(living, signal.SIGTERM)
        deadline = time.monotonic() + GRACE
        while time.monotonic() < deadline:
            _reap()
            if not any(state != "Z" for _, state in _descendants()):
                break
            time.sleep(0.02)
    while True:
        # Killing a process reparents its children here; each round catches them.
        _signal_all([pid for pid, _ in _descendants()], signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        _reap()


def _exit_like(status: int | None) -> int:
    """Exit as the job did: its exit code, or the signal that ended it."""
    if status is None:
        return 128 + signal.SIGTERM
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # these two have no handler to reset
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
        return 128 + signum
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
