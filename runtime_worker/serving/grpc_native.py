"""The native gRPC front: `modelforge-grpc-front` (Rust, `native/grpc_front/`) does HTTP/2 and
gRPC's framing outside Python's interpreter lock, and relays each call's message to this server
over loopback HTTP/1.1, where `Relay` answers it with `grpc_service.GrpcService`. So what a call
means is decided in Python, in one place; the native front only moves bytes, at a fraction of
grpcio's cost per call (docs/performance.md).

The relay's route (`http.RELAY_PREFIX`) answers only requests carrying the token this process
gave the front on its standard input (never in its arguments or environment); to anyone else it
does not exist (404). The front's standard input stays open: closing it (`stop`), or this
process ending, makes the front stop taking calls and exit once those running are done (within
the grace period).

It is the model server's only gRPC front: `make install` (and every worker image) builds it
into `bin/` beside this module, and a server asked for gRPC without it stops at start with the
fix (`FrontMissing`), never serving gRPC some other way.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime_worker._oip import ServingError
from runtime_worker.serving.batcher import CallerGone
from runtime_worker.serving.grpc_service import GRPC_CODE_NUMBERS, GrpcService, host_port
from runtime_worker.serving.http import WBITS, inflate

log = logging.getLogger("modelforge.onnx_server")

BUILT = Path(__file__).parent / "bin" / "modelforge-grpc-front"
TOKEN_HEADER = "x-modelforge-front"  # noqa: S105 - the header's name, not a token
ENCODING_HEADER = "x-grpc-encoding"
#: How long the front may take to bind its port and say so.
START_SECONDS = 10.0


class FrontMissing(OSError):
    """The native gRPC front's binary is not where `make install` puts it (the message says
    where, and the fix)."""


class Relay:
    """The model server's end of the relay: one call's message in, its answer out. A message
    the client compressed (gzip or deflate, which the front names in `ENCODING_HEADER`) is
    inflated here, never past `max_message_bytes` (RESOURCE_EXHAUSTED)."""

    def __init__(self, service: GrpcService, max_message_bytes: int) -> None:
        self.service, self.max_message_bytes = service, max_message_bytes
        self.token = secrets.token_hex(16)
        self._token = self.token.encode()

    def admits(self, headers: Any) -> bool:
        """Whether a request comes from this server's own front (its token)."""
        given = headers.get(TOKEN_HEADER)
        return given is not None and hmac.compare_digest(given.encode(), self._token)

    async def answer(self, method: str, headers: Any, protocol: Any) -> None:
        """Answer the relayed call of `method` whose message is the request's body: 200 and the
        response message, or the error's HTTP status, its gRPC code and its message."""
        message = await protocol()
        try:
            if (encoding := headers.get(ENCODING_HEADER)) is not None:
                if encoding not in WBITS:
                    problem = f"grpc-encoding {encoding[:40]} is not supported"
                    raise ServingError(501, problem, "UNIMPLEMENTED")
                message = inflate(message, encoding, self.max_message_bytes, "message")
            # The front closes the connection when its client cancels the call or its deadline
            # passes: a request still waiting then leaves the queue, and nobody is answered.
            reply = await self.service.call(method, message, gone=protocol.client_disconnect)
        except CallerGone:
            return
        except ServingError as exc:
            code = GRPC_CODE_NUMBERS.get(exc.grpc_code, GRPC_CODE_NUMBERS["UNKNOWN"])
            status = exc.http_status if exc.http_status != 200 else 500
            headers = [("content-type", "text/plain; charset=utf-8"), ("x-grpc-code", str(code))]
            protocol.response_bytes(status, headers, exc.message.encode())
            return
        protocol.response_bytes(200, [("content-type", "application/x-protobuf")], reply)


@dataclass
class NativeFront:
    """A started native front: its process and bound port; `stop` ends it. A front that ends
    before it is stopped ends the model server too (exit status 1), so that the service is
    restarted whole rather than left serving HTTP without gRPC."""

    process: subprocess.Popen[bytes]
    port: int
    stopping: bool = False

    def watch(self) -> None:
        """Watch the front's process on a thread of its own."""
        threading.Thread(target=self._watch, name="grpc-front-watch", daemon=True).start()

    def _watch(self) -> None:
        returncode = self.process.wait()
        if not self.stopping:
            log.error(
                "the native gRPC front exited (status %d); the model server ends with it, to "
                "be restarted whole",
                returncode,
            )
            os._exit(1)

    async def stop(self, grace: float) -> None:
        """Refuse new calls, let those running finish for up to `grace` seconds, end."""
        await asyncio.get_running_loop().run_in_executor(None, self._stop, grace)

    def _stop(self, grace: float) -> None:
        self.stopping = True
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(grace + 2)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start(
    host: str,
    port: int,
    backend_port: int,
    *,
    max_message_bytes: int,
    max_calls: int,
    grace_seconds: int,
    token: str,
    executable: Path = BUILT,
) -> NativeFront:
    """Start the front on host:port (0: any free port), relaying to this server's HTTP port.
    Raises `FrontMissing` when `executable` is not there, OSError when it cannot run or listen
    (its reason on the server's standard error)."""
    if not os.access(executable, os.X_OK):
        raise FrontMissing(
            f"the native gRPC front is not installed ({executable} is missing or not "
            "executable); run make install, or use a runtime worker image, which holds it"
        )
    address = host_port(host, port)
    command = [
        str(executable),
        "--listen", address,
        "--backend", _loopback(host, backend_port),
        "--max-message-bytes", str(max_message_bytes),
        "--max-calls", str(max_calls),
        "--grace-seconds", str(max(grace_seconds, 1)),
    ]  # fmt: skip
    # The binary is this package's own; no shell.
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # noqa: S603
    stdin, stdout = process.stdin, process.stdout
    if stdin is None or stdout is None:  # pragma: no cover - both are pipes
        raise OSError("the native front's pipes are missing")
    try:
        stdin.write(token.encode() + b"\n")
        stdin.flush()
    except BrokenPipeError:
        pass  # it ended at once: its reason is on standard error, its stdout empty
    said: list[bytes] = []
    reader = threading.Thread(target=lambda: said.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(START_SECONDS)
    words = said[0].split() if said else []
    if len(words) != 2 or words[0] != b"listening" or not words[1].isdigit():
        process.kill()
        process.wait()
        raise OSError(f"cannot listen for gRPC on {address} (the native front did not start)")
    front = NativeFront(process, int(words[1]))
    front.watch()
    return front


def _loopback(host: str, port: int) -> str:
    """Where this server's HTTP front is reached from the same host."""
    if host in ("", "0.0.0.0"):  # noqa: S104 - listening there, reached on loopback
        return f"127.0.0.1:{port}"
    return host_port("::1" if host == "::" else host, port)
