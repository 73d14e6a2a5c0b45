"""The native gateway front beside Granian (`MODELFORGE_GATEWAY_FRONT=native`, issue 27).

`modelforge-gateway-front` (`native/gateway_front`, Rust, built by `make install` into
`control_plane/bin/`) listens on the control plane's address. It carries the gateway's requests
(`/v2/...`, `/services/{name}/...`) to the replicas through the agents' tunnels, which it holds
itself, and passes every other request, unchanged, to Granian, which then listens on a loopback
port of its own. The gateway's decisions stay in Python (`api/gateway_native.py`): the front asks
over a Unix socket in a private directory (mode 0700) that the served process listens on.

It is the default (`MODELFORGE_GATEWAY_FRONT` unset); a missing binary stops the start. With
`MODELFORGE_TLS_CERT`/`MODELFORGE_TLS_KEY` it terminates TLS itself, reading both files (their
paths on its standard input, never the key's bytes), and Granian behind it stays plain HTTP on
loopback. It does not forward to other control-plane replicas yet: with a peer address the
gateway runs in Python (logged at start; `MODELFORGE_GATEWAY_FRONT=native` with a peer address is
refused by the settings).

The front tells Granian the client's address in `x-modelforge-client` and the client's scheme in
`x-modelforge-scheme`, trusted only beside
`x-modelforge-front-key`, a random key of this start (`api/rsgi.py`, `FrontTrust`); the served
process (forked from this one) reads the socket's path and the key from the environment this
process set for it (in memory: not in `/proc/<pid>/environ`), and the front from its standard
input. The front ends when its standard input does (this
process stopping, however it stops).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

from control_plane.api.edge import SECURITY_HEADERS
from control_plane.api.gateway import body_timeout_message, too_large_message
from control_plane.api.gateway_native import CONTROL_ENV
from control_plane.api.rsgi import FRONT_KEY_ENV
from control_plane.settings import Settings
from modelforge_contracts.tunnel import IDLE_TIMEOUT, MAX_STREAMS, TUNNEL_PATH

log = logging.getLogger("modelforge.control_plane.front")

#: Seconds before a front that exited is started again.
RESTART_AFTER = 1.0

BINARY = Path(__file__).parent / "bin" / "modelforge-gateway-front"


class FrontUnavailable(Exception):
    """The native front cannot run here (the message says why and what to do)."""


#: Why a peer address keeps the gateway in Python (logged at start; docs/services.md).
PEERS_REASON = (
    "MODELFORGE_GATEWAY_PEER_ADDRESS is set and the native front does not forward requests to "
    "other control-plane replicas yet"
)


def why_not(settings: Settings) -> str | None:
    """Why the gateway runs in Python with these settings (None: the native front serves).

    Unset or `native`, `MODELFORGE_GATEWAY_FRONT` means the native front; a missing binary is
    `NativeFront`'s start-up error naming the fix, never a fallback to the Python gateway."""
    if settings.gateway_front == "python":
        return "MODELFORGE_GATEWAY_FRONT=python"
    if settings.gateway_peer_address:
        return PEERS_REASON  # `native` with a peer address is refused by the settings
    return None


def _loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class NativeFront:
    """One run of the front: `prepare` before Granian starts, `start`, and `stop` at the end."""

    def __init__(self, settings: Settings, binary: Path = BINARY) -> None:
        if not binary.is_file():
            raise FrontUnavailable(
                f"the native gateway front is not installed ({binary}); run `make install`, "
                "or set MODELFORGE_GATEWAY_FRONT=python"
            )
        self.binary = binary
        self.settings = settings
        self.directory = Path(tempfile.mkdtemp(prefix="modelforge-front-"))  # mode 0700
        self.control = self.directory / "control.sock"
        self.upstream_port = _loopback_port()
        self._key = secrets.token_hex(32)
        self._process: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        try:
            self._check()
        except FrontUnavailable:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def _check(self) -> None:
        """The front reads its configuration and loads the TLS certificate and key as it will
        when it starts, and exits (`--check`): a file it cannot use ends the start here, with
        the front's own message naming the file and the fix."""
        try:
            done = subprocess.run(  # noqa: S603 - our own binary, no shell
                [str(self.binary), "--check"],
                input=self._config_line(),
                capture_output=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FrontUnavailable(
                f"the native gateway front ({self.binary}) cannot run: {exc}"
            ) from exc
        if done.returncode != 0:
            lines = done.stderr.decode("utf-8", "replace").strip().splitlines() or ["no message"]
            _, _, message = lines[-1].partition(" ")
            raise FrontUnavailable(message or lines[-1])

    def prepare(self) -> None:
        """Where the served process (forked by Granian later) finds the socket and the key."""
        os.environ[CONTROL_ENV] = str(self.control)
        os.environ[FRONT_KEY_ENV] = self._key

    def start(self) -> None:
        """Start the front, and start it again whenever it exits until `stop` (a thread)."""
        self._spawn()
        settings = self.settings
        log.info(
            "the native gateway front serves %s://%s:%s (Granian behind it on 127.0.0.1:%s)",
            "https" if settings.tls_cert is not None else "http",
            settings.host,
            settings.port,
            self.upstream_port,
        )
        threading.Thread(target=self._watch, name="gateway-front-watch", daemon=True).start()

    def _config_line(self) -> bytes:
        settings = self.settings
        config = {
            "listen": f"{settings.host}:{settings.port}",
            "upstream": f"127.0.0.1:{self.upstream_port}",
            "control": str(self.control),
            "front_key": self._key,
            "tunnel_path": TUNNEL_PATH,
            "max_streams": MAX_STREAMS,
            "idle_timeout": IDLE_TIMEOUT,
            "body_bytes": settings.gateway_max_body_bytes,
            "retry_bytes": settings.gateway_retry_body_bytes,
            "body_timeout": settings.gateway_body_timeout_seconds,
            "security_headers": [[k.decode(), v.decode()] for k, v in SECURITY_HEADERS],
            "too_large": too_large_message(settings.gateway_max_body_bytes),
            "body_timeout_message": body_timeout_message(settings.gateway_body_timeout_seconds),
            # The files' paths; the front reads them (the key's bytes are in no pipe or log).
            "tls_cert": None if settings.tls_cert is None else str(settings.tls_cert.resolve()),
            "tls_key": None if settings.tls_key is None else str(settings.tls_key.resolve()),
        }
        return json.dumps(config).encode() + b"\n"

    def _spawn(self) -> None:
        # The key and the socket's path go on its stdin only, not in its environment.
        env = {k: v for k, v in os.environ.items() if k not in (CONTROL_ENV, FRONT_KEY_ENV)}
        process = subprocess.Popen(  # noqa: S603 - our own binary, no shell
            [str(self.binary)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            close_fds=True,
        )
        assert process.stdin is not None and process.stderr is not None  # noqa: S101 - piped
        process.stdin.write(self._config_line())
        process.stdin.flush()
        self._process = process
        threading.Thread(
            target=_relay_log, args=(process.stderr,), name="gateway-front-log", daemon=True
        ).start()

    def _watch(self) -> None:
        """The port is the front's: should it exit (killed, a fault), it starts again within a
        second; the control plane forgets what the old one held (its channel closed), and the
        agents open their tunnels again."""
        while not self._stopping.is_set():
            process = self._process
            assert process is not None  # noqa: S101 - started before this thread
            code = process.wait()
            if self._stopping.wait(RESTART_AFTER):
                return
            log.error("the native gateway front exited with code %s; starting it again", code)
            try:
                self._spawn()
            except OSError as exc:  # the binary gone: tried again each second
                log.error("could not start the native gateway front: %s", exc)
                self._stopping.wait(RESTART_AFTER)

    def stop(self) -> None:
        self._stopping.set()
        process = self._process
        if process is not None:
            assert process.stdin is not None  # noqa: S101 - piped
            try:
                process.stdin.close()
                process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                process.kill()
                process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO}


def _relay_log(stream: object) -> None:
    """The front's stderr lines (`<level> <message>`) as this process's log lines."""
    for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
        level, _, message = raw.decode("utf-8", "replace").rstrip().partition(" ")
        log.log(_LEVELS.get(level, logging.INFO), "gateway front: %s", message)
