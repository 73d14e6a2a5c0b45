"""The tunnel's floor (issue 27): what one request costs through a Granian server that hands it
to a peer over a connection the peer opened, with no work on either side, by transport.

bench/gateway.py measures the whole gateway; this measures what no gateway built on the same
transport can beat. Each variant is a minimal RSGI app on Granian (one worker, uvloop, HTTP/1.1,
as the control plane runs) and a minimal peer (the agent's part, on uvloop) in processes of
their own; `wrk` (in its own process, bench/serving.py's runner) posts a small body at 8
connections:

- ``plain``: the app answers at once (Granian's own floor, no peer);
- ``granian-ws``: the app sends the request's id over Granian's WebSocket to the peer (the
  `websockets` client, as the agent) and answers when the id comes back; the control plane's
  tunnel today;
- ``loop-ws``: the same over a WebSocket server run by the `websockets` library on the app's
  own event loop, on a second port (no hand-over to Granian's threads);
- ``loop-tcp``: the same over a plain TCP connection on the app's event loop (length-prefixed
  ids): the least any transport costs here.

Each variant runs ``--rounds`` times (the round of median requests/s shown), alternating, so a
busy machine skews them alike. Run::

    python bench/tunnel_floor.py --rounds 3    # about a minute; needs wrk
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serving import HEADER, Body, Result, free_port, wrk_load  # noqa: E402

VARIANTS = ("plain", "granian-ws", "loop-ws", "loop-tcp")

APP = """
import asyncio, os, sys
HDR = [("content-type", "application/json")]
ANSWER = b'{"ok":1}'
VARIANT = os.environ["FLOOR_VARIANT"]
PEER_PORT = int(os.environ["FLOOR_PEER_PORT"])


class Tcp(asyncio.Protocol):
    def __init__(self, app):
        self.app, self.buffer = app, b""

    def connection_made(self, transport):
        self.transport = transport
        self.app.send = lambda sid, body: transport.write(
            sid.to_bytes(4, "big") + len(body).to_bytes(4, "big") + body
        )

    def data_received(self, data):
        self.buffer += data
        whole = len(self.buffer) // 4 * 4
        ids, self.buffer = self.buffer[:whole], self.buffer[whole:]
        for at in range(0, whole, 4):
            self.app.answered(int.from_bytes(ids[at : at + 4], "big"))


class App:
    def __init__(self):
        self.send, self.pending, self.next = None, {}, 0

    def answered(self, sid):
        future = self.pending.pop(sid, None)
        if future is not None:
            future.set_result(ANSWER)

    async def serve_ws(self, websocket):
        async def send(sid, body):
            await websocket.send(sid.to_bytes(4, "big") + body)
        self.send = send
        async for message in websocket:
            for at in range(0, len(message), 4):
                self.answered(int.from_bytes(message[at : at + 4], "big"))

    def __rsgi_init__(self, loop):
        sys.setswitchinterval(0.0005)  # as the control plane (api/rsgi.py)
        if VARIANT == "loop-tcp":
            loop.run_until_complete(loop.create_server(lambda: Tcp(self), "127.0.0.1", PEER_PORT))
        elif VARIANT == "loop-ws":
            from websockets.asyncio.server import serve

            async def start():
                return await serve(self.serve_ws, "127.0.0.1", PEER_PORT, compression=None)

            self.server = loop.run_until_complete(start())

    def __rsgi_del__(self, loop):
        pass

    async def __rsgi__(self, scope, protocol):
        if scope.proto == "ws":  # granian-ws: the peer's connection
            transport = await protocol.accept()

            async def send(sid, body):
                await transport.send_bytes(sid.to_bytes(4, "big") + body)

            self.send = send
            while True:
                message = await transport.receive()
                if int(message.kind) != 1:
                    return
                data = message.data
                for at in range(0, len(data), 4):
                    self.answered(int.from_bytes(data[at : at + 4], "big"))
        body = await protocol()
        if VARIANT == "plain":
            protocol.response_bytes(200, HDR, ANSWER)
            return
        if self.send is None:  # the peer has not connected yet (the bench waits for this)
            protocol.response_bytes(503, HDR, b'{"error":"no peer yet"}')
            return
        self.next += 1
        future = asyncio.get_running_loop().create_future()
        self.pending[self.next] = future
        sent = self.send(self.next, body)
        if sent is not None:
            await sent
        protocol.response_bytes(200, HDR, await future)


app = App()
"""

PEER = """
import asyncio, os, uvloop
VARIANT = os.environ["FLOOR_VARIANT"]
APP_PORT, PEER_PORT = os.environ["FLOOR_APP_PORT"], int(os.environ["FLOOR_PEER_PORT"])


class Tcp(asyncio.Protocol):
    buffer = b""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buffer += data
        ids = []
        while len(self.buffer) >= 8:
            size = int.from_bytes(self.buffer[4:8], "big")
            if len(self.buffer) < 8 + size:
                break
            ids.append(self.buffer[:4])
            self.buffer = self.buffer[8 + size :]
        if ids:
            self.transport.write(b"".join(ids))


async def main():
    if VARIANT == "loop-tcp":
        await asyncio.get_running_loop().create_connection(Tcp, "127.0.0.1", PEER_PORT)
        await asyncio.Event().wait()
    from websockets.asyncio.client import connect
    url = f"ws://127.0.0.1:{APP_PORT}/" if VARIANT == "granian-ws" else f"ws://127.0.0.1:{PEER_PORT}/"
    async with connect(url, compression=None) as websocket:
        async for message in websocket:
            await websocket.send(message[:4])


uvloop.run(main())
"""


def _wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"nothing listens on port {port} after {timeout:g} s")


def _wait_answered(url: str, timeout: float = 15.0) -> None:
    """Until the app answers 200: its peer has connected."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, data=b"x", timeout=2) as answer:  # noqa: S310
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not answer 200 within {timeout:g} s: its peer never connected")


class Pair:
    """The app under Granian and its peer, for one variant; `cpu_seconds` is both together."""

    def __init__(self, variant: str, scratch: Path) -> None:
        self.name = variant
        self.port, peer_port = free_port(), free_port()
        env = {
            **os.environ,
            "FLOOR_VARIANT": variant,
            "FLOOR_APP_PORT": str(self.port),
            "FLOOR_PEER_PORT": str(peer_port),
        }
        granian = Path(sys.executable).with_name("granian")
        self.processes: list[subprocess.Popen[bytes]] = []
        try:
            self._start(granian, variant, env, scratch, peer_port)
        except BaseException:
            self.stop()
            raise

    def _start(
        self, granian: Path, variant: str, env: dict[str, str], scratch: Path, peer_port: int
    ) -> None:
        self.processes += [
            subprocess.Popen(  # noqa: S603 - this environment's own granian
                [str(granian), "--interface", "rsgi", "--loop", "uvloop", "--http", "1", "--ws",
                 "--port", str(self.port), "--log-level", "warning", "floor_app:app"],
                cwd=scratch, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        ]  # fmt: skip
        _wait_port(self.port)
        if variant != "plain":
            if variant != "granian-ws":
                _wait_port(peer_port)
            self.processes.append(
                subprocess.Popen(  # noqa: S603
                    [sys.executable, str(scratch / "floor_peer.py")], env=env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            )  # fmt: skip
            _wait_answered(f"http://127.0.0.1:{self.port}/")

    def cpu_seconds(self) -> float:
        total = 0.0
        for process in self.processes:
            try:
                root = psutil.Process(process.pid)
                for member in (root, *root.children(recursive=True)):
                    times = member.cpu_times()
                    total += times.user + times.system
            except psutil.NoSuchProcess:
                continue
        return total

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=5, help="seconds per run")
    parser.add_argument("--connections", type=int, default=8)
    args = parser.parse_args()
    runs: dict[str, list[Result]] = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        (scratch / "floor_app.py").write_text(APP)
        (scratch / "floor_peer.py").write_text(PEER)
        body = Body(scratch / "body", "application/octet-stream", "")
        body.path.write_bytes(b"x" * 1100)  # about the small model's binary request
        for _ in range(args.rounds):
            for variant in VARIANTS:
                pair = Pair(variant, scratch)
                try:
                    result = wrk_load(
                        pair, body, args.connections, args.duration, variant, scratch,
                        url=f"http://127.0.0.1:{pair.port}/",
                    )  # fmt: skip
                finally:
                    pair.stop()
                runs[variant].append(result)
    print(HEADER)
    failed = 0
    for variant in VARIANTS:
        kept = sorted(runs[variant], key=lambda result: result.rps)
        median = kept[len(kept) // 2]
        failed += median.failed
        print(median.row())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
