"""A TCP proxy whose traffic can be dropped and let through again: what a node behind it sees of
a network partition while the control plane stays up (tests of a node cut off, issue 42).

While `cut`, connections it carried are closed and new ones are accepted and held, nothing
passed either way and nothing answered, so the agent's calls time out as across a partition;
`mend` lets new connections through again (those held during the cut are closed then).
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType

from tests.e2e.server import free_port


class CuttableProxy:
    """127.0.0.1:`port` relayed to 127.0.0.1:`target` (see the module's docstring)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._carried: list[socket.socket] = []
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        with self._lock:
            self._cut.set()
            carried, self._carried = self._carried, []
        for sock in carried:
            _close(sock)

    def mend(self) -> None:
        with self._lock:
            self._cut.clear()
            held, self._held = self._held, []
        for sock in held:
            _close(sock)

    def close(self) -> None:
        self._closed.set()
        _close(self._listener)
        self.cut()
        self.mend()

    def __enter__(self) -> CuttableProxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._cut.is_set():
                    self._held.append(client)  # accepted, never answered
                    continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._carried += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        _close(source)
        _close(sink)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
