"""The agent's end of the tunnel (issue 27): `modelforge-tunnel-relay` (native/tunnel_relay,
Rust, built by `make install`, in the node agent's image) holds the WebSocket to the control
plane (`modelforge_contracts.tunnel`) and relays each stream to the replica's local port itself,
so a gateway request crosses no Python on the node. It is the only end: a missing binary stops
the agent at start, naming the fix (`check_relay`), never a fallback.

`NativeTunnel` keeps the relay running for as long as the agent runs:

- the relay gets its configuration, the credential with it, as the first line of its stdin
  (never in its arguments or environment), then `{"ports": ...}` whenever the replicas' local
  ports change (`replica_ports` of the worker's view, asked every second, and at once when the
  relay meets an unknown replica id);
- its stdout says when the tunnel opens and closes and how many requests each replica has in
  flight (a draining replica's drain ends at 0); its stderr lines are logged here;
- the agent stopping closes its stdin: the relay closes the tunnel (1001) and exits. A relay
  that exits on its own is started again after a pause (1 s doubling to 16 s).

It reaches an `http://` or `https://` control plane named by a DNS name or an IP address (its
TLS, rustls, trusts what the agent's HTTP client trusts: the system's roots and
`ca_cert_path`, or nothing checked with `tls_verify` off; it checks the certificate against the
name or the address in the URL).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from modelforge_contracts.tunnel import MAX_STREAMS, TUNNEL_PATH
from node_agent.config import ConfigError

log = logging.getLogger("modelforge.node_agent.tunnel")

#: Where `make install` puts the relay (package data: the agent's image carries it).
RELAY = Path(__file__).resolve().parent / "bin" / "modelforge-tunnel-relay"
#: How often the replicas' ports are compared with what the relay was last told.
_PORTS_EVERY = 1.0
_RESTART_FIRST = 1.0
_RESTART_MAX = 16.0
_STOP_WAIT = 5.0
_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO}


def check_relay(binary: Path = RELAY) -> Path:
    """The relay's binary, or `ConfigError` naming the fix when it is not there."""
    if not os.access(binary, os.X_OK):
        raise ConfigError(
            f"the tunnel relay is not installed ({binary} is missing or not executable); run "
            "make install, or use the node agent image, which holds it"
        )
    return binary


def replica_ports(view: dict[str, Any]) -> dict[str, int]:
    """Replica id -> the local port its server listens on, from the runtime worker's view
    (`GET /v1/services`)."""
    services = view.get("services", [])
    return {
        str(entry["service_id"]): int(entry["port"])
        for entry in services
        if isinstance(entry, dict) and isinstance(entry.get("port"), int)
    }


class NativeTunnel:
    """See the module's docstring."""

    def __init__(
        self,
        *,
        binary: Path,
        control_plane_url: str,
        credential: str,
        ports: Callable[[], dict[str, int]],
        stop: threading.Event,
        tls_verify: bool = True,
        ca_cert_path: Path | None = None,
        max_streams: int = MAX_STREAMS,
        local_host: str = "127.0.0.1",
    ) -> None:
        parts = urlsplit(control_plane_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("the native relay reaches an http:// or https:// control plane")
        secure = parts.scheme == "https"
        self._binary = binary
        tls = None
        if secure:
            ca = None if ca_cert_path is None else str(ca_cert_path)
            tls = {"server_name": parts.hostname, "verify": tls_verify, "ca_cert_path": ca}
        self._config = {
            "connect_host": parts.hostname,
            "connect_port": parts.port or (443 if secure else 80),
            "host_header": parts.netloc.rpartition("@")[2],
            "path": parts.path + TUNNEL_PATH,
            "local_host": local_host,
            "max_streams": max_streams,
            "tls": tls,
        }
        self._credential = credential
        self._ports = ports
        self._stop = stop
        scheme = "wss" if secure else "ws"
        self._url = f"{scheme}://{self._config['host_header']}{self._config['path']}"
        #: Set while a tunnel is open.
        self.connected = threading.Event()
        #: How many tunnels were opened since the start (across the relay's restarts).
        self.connections = 0
        #: The most of one request body a stream held at once (the relay's figure).
        self.peak_buffered = 0
        self._in_flight: dict[str, int] = {}
        self._counted_before = 0
        self._want_ports = threading.Event()
        self._lock = threading.Lock()
        #: The relay running now (None between two).
        self.process: subprocess.Popen[str] | None = None

    def __repr__(self) -> str:
        return f"<NativeTunnel {self._url}>"

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, daemon=True, name="tunnel")
        thread.start()
        return thread

    def in_flight(self, replica_id: str) -> int:
        with self._lock:
            return self._in_flight.get(replica_id, 0)

    def run(self) -> None:
        pause = _RESTART_FIRST
        while not self._stop.is_set():
            started = time.monotonic()
            code = self._run_once()
            if self._stop.is_set():
                return
            log.error("the tunnel relay exited with code %s; starting it again", code)
            if time.monotonic() - started > 60:
                pause = _RESTART_FIRST
            self._stop.wait(pause)
            pause = min(pause * 2, _RESTART_MAX)

    def _run_once(self) -> int | None:
        process = subprocess.Popen(  # noqa: S603 - our own binary, no shell
            [str(self._binary)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # the agent's Ctrl-C reaches it through its stdin's end
        )
        assert process.stdin and process.stdout and process.stderr  # noqa: S101 - pipes above
        self.process = process
        self._counted_before = self.connections
        readers = [
            threading.Thread(target=self._events, args=(process.stdout,), daemon=True),
            threading.Thread(target=self._logs, args=(process.stderr,), daemon=True),
        ]
        for reader in readers:
            reader.start()
        told: dict[str, int] | None = None
        try:
            config = dict(self._config, credential=self._credential)
            process.stdin.write(json.dumps(config) + "\n")
            process.stdin.flush()
            while process.poll() is None and not self._stop.is_set():
                ports = self._read_ports(told)
                if ports != told:
                    process.stdin.write(json.dumps({"ports": ports}) + "\n")
                    process.stdin.flush()
                    told = ports
                self._want_ports.wait(_PORTS_EVERY)
                self._want_ports.clear()
        except (BrokenPipeError, OSError):
            pass  # the relay went: its exit code says why
        finally:
            try:
                process.stdin.close()
            except OSError:
                pass
            try:
                code = process.wait(_STOP_WAIT)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
            for reader in readers:
                reader.join(1.0)
            for pipe in (process.stdout, process.stderr):
                pipe.close()
            self.connected.clear()
            self.process = None
            with self._lock:
                self._in_flight = {}
        return code

    def _read_ports(self, told: dict[str, int] | None) -> dict[str, int] | None:
        try:
            return dict(self._ports())
        except Exception:  # noqa: BLE001 - the worker away: the relay keeps what it was told
            return told

    def _events(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                event: dict[str, Any] = json.loads(line)
            except ValueError:
                continue
            if "connected" in event:
                if event["connected"]:
                    self.connections = self._counted_before + int(event.get("connections", 1))
                    self.connected.set()
                else:
                    self.connected.clear()
            if isinstance(event.get("in_flight"), dict):
                with self._lock:
                    self._in_flight = {str(k): int(v) for k, v in event["in_flight"].items()}
                self.peak_buffered = max(self.peak_buffered, int(event.get("peak_buffered", 0)))
            if event.get("want_ports"):
                self._want_ports.set()

    @staticmethod
    def _logs(stream: IO[str]) -> None:
        for line in stream:
            level, _, message = line.rstrip("\n").partition(" ")
            log.log(_LEVELS.get(level, logging.INFO), "tunnel relay: %s", message)
