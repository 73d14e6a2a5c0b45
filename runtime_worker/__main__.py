"""`python3 -m runtime_worker`: serve the local endpoint until SIGTERM/SIGINT.

`MODELFORGE_WORKER_SOCKET` is where it listens (mode 0600); with `MODELFORGE_WORKER_SOCKET_GROUP`
the socket is 0660 for that group — the agent's, when the worker runs under a user of its own.

At start it makes itself not dumpable (jobs run as the same user cannot ptrace it or read its
/proc entries) and removes the work directories a previous worker on the same socket left. On
SIGTERM/SIGINT it stops every service and every job, with all they started, before it exits."""

from __future__ import annotations

import grp
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from modelforge_contracts.protocol import PROTOCOL_VERSION
from runtime_worker import WORKER_VERSION, isolation
from runtime_worker.execution import (
    JobsDirectoryError,
    jobs_directory,
    prepare_jobs_directory,
    stop_all,
)
from runtime_worker.server import WorkerServer, serve

DEFAULT_SOCKET = "/run/modelforge/runtime-worker.sock"


def main() -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log = logging.getLogger("modelforge.runtime_worker")
    isolation.set_dumpable(False)
    socket_path = Path(os.environ.get("MODELFORGE_WORKER_SOCKET", DEFAULT_SOCKET))
    jobs_dir = jobs_directory(socket_path)
    try:
        server = _listen(socket_path, os.environ.get("MODELFORGE_WORKER_SOCKET_GROUP") or None)
        removed = prepare_jobs_directory(jobs_dir)  # before serving: no job runs meanwhile
    except _CannotStart as exc:
        print(f"runtime-worker: {exc}", file=sys.stderr)
        return 2
    except JobsDirectoryError as exc:
        server.server_close()
        socket_path.unlink(missing_ok=True)
        print(f"runtime-worker: unusable jobs directory: {exc}", file=sys.stderr)
        return 2
    if removed:
        log.info(
            "removed %d work directories a previous runtime worker left in %s", removed, jobs_dir
        )
    stopped = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stopped.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(
        "runtime worker %s (protocol %d) on unix socket %s",
        WORKER_VERSION,
        PROTOCOL_VERSION,
        socket_path,
    )
    with server:
        server.serve_forever(poll_interval=0.5)
    server.services.stop_all()  # no service outlives the worker
    stop_all()  # nor any job
    try:
        jobs_dir.rmdir()  # empty once every supervisor has cleaned up
    except OSError:
        pass  # something was left: the next start removes it
    socket_path.unlink(missing_ok=True)
    return 0


class _CannotStart(Exception):
    """The socket cannot be served as configured; the message names the variable."""


def _listen(socket_path: Path, group: str | None) -> WorkerServer:
    """The worker's socket, bound (0600, or 0660 for `group`) but not yet served."""
    try:
        server = serve(socket_path, jobs_dir=jobs_directory(socket_path))
    except OSError as exc:
        raise _CannotStart(
            f"cannot listen on MODELFORGE_WORKER_SOCKET {socket_path} ({exc.strerror})"
        ) from None
    if group is None:
        return server
    try:
        gid = grp.getgrgid(int(group)).gr_gid if group.isdigit() else grp.getgrnam(group).gr_gid
        os.chown(socket_path, -1, gid)
        os.chmod(socket_path, 0o660)
    except (KeyError, OSError) as exc:
        server.server_close()
        socket_path.unlink(missing_ok=True)
        cause = f"no group {group!r}" if isinstance(exc, KeyError) else exc.strerror
        raise _CannotStart(
            f"MODELFORGE_WORKER_SOCKET_GROUP: cannot give group {group!r} the socket "
            f"{socket_path} ({cause}); the worker's user must be a member of it"
        ) from None
    return server


if __name__ == "__main__":
    sys.exit(main())
