"""`python3 -m runtime_worker`: serve the local health endpoint until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from modelforge_contracts.protocol import PROTOCOL_VERSION
from runtime_worker import WORKER_VERSION
from runtime_worker.execution import kill_all
from runtime_worker.server import serve

DEFAULT_SOCKET = "/run/modelforge/runtime-worker.sock"


def main() -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log = logging.getLogger("modelforge.runtime_worker")
    socket_path = Path(os.environ.get("MODELFORGE_WORKER_SOCKET", DEFAULT_SOCKET))
    try:
        server = serve(socket_path)
    except OSError as exc:
        print(
            f"runtime-worker: cannot listen on MODELFORGE_WORKER_SOCKET {socket_path} "
            f"({exc.strerror})",
            file=sys.stderr,
        )
        return 2
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
    kill_all()  # no job outlives the worker
    socket_path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
