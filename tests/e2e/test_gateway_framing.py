"""The gateway's HTTP framing and header policy (issue 40, "framing first"), probed with raw
sockets at both ends of the control plane (`MODELFORGE_GATEWAY_FRONT=python|native`, as
`test_gateway.py` runs its fleet, whose helpers this module uses) and a real node whose agent
relays to a replica that speaks HTTP/1.1 by hand (`PROBE`, a command service): it logs every
request as it framed it, and answers some paths with framing that contradicts itself.

- A request with both `Content-Length` and `Transfer-Encoding` is 400, and no request of it (nor
  one smuggled in its body) reaches the replica; a body cut short never reaches it complete.
- The replica gets a length the gateway checked, or a chunked body: never the client's framing.
- A replica's answer whose framing contradicts itself is 502, the client's next answer on the
  same connection is its own, and the replica's connection is not used again.
- A replica's one `Content-Length` reaches the client in an answer to HEAD (no body to frame);
  two never do.
- No `Set-Cookie`, `Set-Cookie2`, `Clear-Site-Data` or hop-by-hop header of a replica reaches the
  client; `X-Forwarded-For/-Host/-Proto` are the gateway's own, the client's dropped with
  `Forwarded` and `X-Real-IP`.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.netns import Fabric, NamespacedNode
from tests.e2e.node import wait_ready, wait_until
from tests.e2e.test_gateway import FAST, Fleet, _deploy

pytestmark = pytest.mark.e2e

#: A replica that frames HTTP/1.1 by hand: each request it read is logged as a JSON line (its
#: connection, method, target, headers and body); `/split` answers chunked with a
#: `Content-Length: 0` (an attacker's page in the chunk), `/two-lengths` with two lengths,
#: `/cookies` with cookies and hop-by-hop headers, `/sized` with 1234 bytes, anything else its
#: request back as JSON; to HEAD, the same answer's head alone.
PROBE = r"""
import json, socketserver, sys, threading

LOG = sys.argv[2]
LOCK = threading.Lock()
PAGE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 22\r\n\r\n"
        b"<h1>attacker page</h1>")


class Probe(socketserver.StreamRequestHandler):
    def handle(self):
        while True:
            line = self.rfile.readline(65536)
            if not line:
                return
            if not line.strip():
                continue
            pairs = []
            while True:
                raw = self.rfile.readline(65536)
                if raw in (b"\r\n", b"\n", b""):
                    break
                name, _, value = raw.decode("latin-1").partition(":")
                pairs.append([name.strip().lower(), value.strip()])
            method, target = line.decode("latin-1").split(" ")[:2]
            names = dict(pairs)
            if names.get("transfer-encoding", "").lower() == "chunked":
                body = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    body += self.rfile.read(size)
                    self.rfile.readline()
                    if size == 0:
                        break
            else:
                length = int(names.get("content-length") or 0)
                body = self.rfile.read(length)
                if len(body) < length:
                    return  # cut short: not a request
            seen = {"peer": self.client_address[1], "method": method, "target": target,
                    "headers": pairs, "body": body.decode("latin-1")}
            with LOCK, open(LOG, "a") as log:
                log.write(json.dumps(seen) + "\n")
            answer = self.answer(target, seen)
            if method == "HEAD":
                answer = answer.partition(b"\r\n\r\n")[0] + b"\r\n\r\n"
            self.wfile.write(answer)

    def answer(self, target, seen):
        if target == "/split":
            chunk = b"%x\r\n%s\r\n0\r\n\r\n" % (len(PAGE), PAGE)
            return (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked"
                    b"\r\nContent-Length: 0\r\n\r\n" + chunk)
        if target == "/two-lengths":
            return (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 22\r\n\r\n"
                    + PAGE[-22:])
        if target == "/sized":
            return b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n" + b"x" * 1234
        if target == "/cookies":
            return (b"HTTP/1.1 200 OK\r\nSet-Cookie: modelforge_session=evil; Path=/\r\n"
                    b"Set-Cookie2: a=1\r\nClear-Site-Data: \"*\"\r\nKeep-Alive: timeout=5\r\n"
                    b"Proxy-Authenticate: Basic\r\nX-Replica: yes\r\nContent-Length: 7\r\n\r\n"
                    b"cookies")
        out = json.dumps(seen).encode()
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d"
                b"\r\n\r\n%s" % (len(out), out))


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


Server(("127.0.0.1", int(sys.argv[1])), Probe).serve_forever()
"""


class Probed(Fleet):
    """The fleet, which end carries its gateway, and where its replica logs what it read."""

    front: str
    log: Path

    def seen(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        return [entry for entry in map(json.loads, lines) if entry["target"] != "/"]

    def targets(self) -> list[str]:
        return [entry["target"] for entry in self.seen()]


@pytest.fixture(scope="module", params=["python", "native"])
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Probed]:
    """One node and the probe service, the gateway in the control plane's Python or in its
    native front."""
    root = tmp_path_factory.mktemp(f"framing-{request.param}")
    with Fabric() as fabric:
        server = fabric.server(root, {**FAST, "MODELFORGE_GATEWAY_FRONT": request.param})
        with server:
            node = NamespacedNode(
                root / "node",
                server.url,
                token=server.mint()["token"],
                namespace=fabric.namespace(),
            )
            try:
                node_id = node.start_worker().start_agent().node_id()
                wait_ready(server, node_id, 60)
                found = Probed(server, [node], [node_id])
                found.front, found.log = request.param, root / "probe.log"
                script = root / "probe.py"
                script.write_text(PROBE)
                _deploy(
                    found,
                    "probe",
                    {
                        "command": [sys.executable, str(script), "{port}", str(found.log)],
                        "health": {"path": "/", "interval_seconds": 0.5},
                        "resources": {"cpus": 0.25},
                    },
                    1,
                    60,
                )
                yield found
            finally:
                node.__exit__(None, None, None)


# -- raw HTTP/1.1 ------------------------------------------------------------------------------


def _connect(fleet: Fleet) -> socket.socket:
    sock = socket.create_connection((fleet.server.host, fleet.server.port), timeout=10)
    sock.settimeout(10)
    return sock


def _head(fleet: Fleet, method: str, path: str, *lines: str) -> bytes:
    token = fleet.tokens["probe"]
    head = [f"{method} {path} HTTP/1.1", f"Host: {fleet.host_port()}"]
    head += [f"Authorization: Bearer {token}", *lines]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")


class _Reader:
    """Reads answers off one connection as a client does: by their own framing."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buffer += data
        return bool(data)

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            if not self._fill():
                raise EOFError("the connection closed")
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        return line

    def _exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            if not self._fill():
                raise EOFError("the connection closed inside a body")
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def answer(self, *, head: bool = False) -> tuple[int, list[tuple[str, str]], bytes]:
        """The next answer; `head`: to a HEAD request, so without a body whatever it says."""
        status = int(self._line().split(b" ")[1])
        headers: list[tuple[str, str]] = []
        while line := self._line():
            name, _, value = line.decode("latin-1").partition(":")
            headers.append((name.strip().lower(), value.strip()))
        names = dict(headers)
        if head:
            body = b""
        elif names.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while size := int(self._line().split(b";")[0], 16):
                body += self._exactly(size)
                self._line()
            while self._line():
                pass
        else:
            body = self._exactly(int(names.get("content-length", "0")))
        return status, headers, body

    def rest(self, wait: float = 1.0) -> bytes:
        """Whatever else comes within `wait` seconds (until the connection closes)."""
        self.sock.settimeout(wait)
        try:
            while self._fill():
                pass
        except OSError:
            pass
        return self.buffer


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _settled(fleet: Probed, marker: str) -> None:
    """Wait until the replica logged a request for `marker` sent now (so whatever the gateway
    was still carrying to it before has arrived), and a moment more."""
    sock = _connect(fleet)
    try:
        sock.sendall(_head(fleet, "GET", f"/services/probe/{marker}"))
        assert _Reader(sock).answer()[0] == 200
    finally:
        sock.close()
    wait_until(lambda: f"/{marker}" in fleet.targets(), 10, f"the replica logging /{marker}")
    time.sleep(0.5)


# -- requests ----------------------------------------------------------------------------------

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"


def test_a_request_with_both_lengths_is_400_and_nothing_reaches_the_replica(
    fleet: Probed,
) -> None:
    """`Content-Length` before `Transfer-Encoding: chunked`, a chunk holding `hello` and a second
    request: the native front refuses it 400, and neither request reaches the replica. Where the
    HTTP server keeps only the chunked framing (Granian, in either order; hyper in the native
    front, with the length second) the replica may get the request, but as one request with the
    whole chunk for its body: the smuggled one never."""
    for index, order in enumerate(
        (
            ("Content-Length: 5", "Transfer-Encoding: chunked"),
            ("Transfer-Encoding: chunked", "Content-Length: 5"),
        )
    ):
        sock = _connect(fleet)
        try:
            sock.sendall(
                _head(fleet, "POST", f"/services/probe/both{index}", *order)
                + _chunk(b"hello" + SMUGGLED)
                + b"0\r\n\r\n"
            )
            status, headers, body = _Reader(sock).answer()
        finally:
            sock.close()
        if index == 0 and fleet.front == "native":
            assert status == 400, (status, body)
            assert dict(headers)["content-type"] == "application/json"
            message = json.loads(body)["error"]
            assert "Content-Length" in message and "Transfer-Encoding" in message, message
        else:
            assert status in (200, 400), (status, body)
    _settled(fleet, "after-both")
    seen = fleet.seen()
    targets = [entry["target"] for entry in seen]
    assert "/smuggled" not in targets, seen
    if fleet.front == "native":
        assert "/both0" not in targets, seen
    for entry in seen:
        if entry["target"] in ("/both0", "/both1"):  # whole: chunked, or by its real length
            assert entry["body"].encode("latin-1") == b"hello" + SMUGGLED, entry
            names = [name for name, _ in entry["headers"]]
            assert names.count("content-length") + names.count("transfer-encoding") == 1, entry


def test_conflicting_or_bad_lengths_and_codings_are_400(fleet: Probed) -> None:
    for index, lines in enumerate(
        (
            ("Content-Length: 5", "Content-Length: 7"),
            ("Content-Length: 5x",),
            ("Transfer-Encoding: gzip",),
            ("Transfer-Encoding: gzip, chunked", "Content-Length: 3"),
        )
    ):
        sock = _connect(fleet)
        try:
            sock.sendall(_head(fleet, "POST", f"/services/probe/bad{index}", *lines) + b"hello12")
            status, _, body = _Reader(sock).answer()
        finally:
            sock.close()
        assert status == 400, (lines, status, body)
    _settled(fleet, "after-bad")
    assert not [target for target in fleet.targets() if target.startswith("/bad")]


def test_the_replica_gets_the_length_checked_or_a_chunked_body(fleet: Probed) -> None:
    """The client's own framing never crosses: a declared length reaches the replica as the
    number of bytes that came (small and large bodies, through the native front's fast path
    too: the same request twice), a chunked body as chunked, a body cut short never."""
    large = bytes(range(256)) * 1024  # past one DATA frame: streamed
    for attempt in range(2):
        for name, body in (("small", b"x" * 10), ("large", large)):
            sock = _connect(fleet)
            try:
                target = f"/services/probe/{name}{attempt}"
                sock.sendall(_head(fleet, "POST", target, f"Content-Length: {len(body)}") + body)
                status, _, answer = _Reader(sock).answer()
            finally:
                sock.close()
            assert status == 200, answer[:200]
            seen = json.loads(answer)
            assert seen["body"].encode("latin-1") == body
            lengths = [value for key, value in seen["headers"] if key == "content-length"]
            assert lengths == [str(len(body))], seen["headers"]
            assert "transfer-encoding" not in dict(seen["headers"])
    sock = _connect(fleet)
    try:
        sock.sendall(
            _head(fleet, "POST", "/services/probe/chunked", "Transfer-Encoding: chunked")
            + _chunk(b"abc")
            + _chunk(large)
            + b"0\r\n\r\n"
        )
        status, _, answer = _Reader(sock).answer()
    finally:
        sock.close()
    assert status == 200, answer[:200]
    seen = json.loads(answer)
    assert seen["body"].encode("latin-1") == b"abc" + large
    assert dict(seen["headers"]).get("transfer-encoding") == "chunked", seen["headers"]
    assert "content-length" not in dict(seen["headers"])
    # Cut short: a declared length never reached, a chunked body without its last chunk.
    for target, head, part in (
        ("/services/probe/short-length", "Content-Length: 200000", large[:70000]),
        ("/services/probe/short-chunked", "Transfer-Encoding: chunked", _chunk(large[:70000])),
    ):
        sock = _connect(fleet)
        sock.sendall(_head(fleet, "POST", target, head) + part)
        time.sleep(0.5)  # on its way to the replica
        sock.close()
    _settled(fleet, "after-short")
    assert not [target for target in fleet.targets() if target.startswith("/short")]


# -- answers -----------------------------------------------------------------------------------


def test_a_replicas_answer_with_contradicting_framing_is_502_and_its_connection_dropped(
    fleet: Probed,
) -> None:
    for path in ("/split", "/two-lengths"):
        sock = _connect(fleet)
        try:
            sock.sendall(_head(fleet, "GET", f"/services/probe{path}"))
            reader = _Reader(sock)
            status, _, body = reader.answer()
            assert status == 502, (path, status, body)
            assert "attacker" not in body.decode("latin-1")
            # The next answer on this connection is the client's own, the page nowhere.
            try:
                sock.sendall(_head(fleet, "GET", "/v2/health/live"))
                status, _, body = reader.answer()
                assert (status, json.loads(body)) == (200, {"live": True})
            except (EOFError, OSError):
                pass  # the front closed the connection: nothing to mistake either
            assert b"attacker" not in reader.rest(0.5)
        finally:
            sock.close()
    _settled(fleet, "after-split")
    seen = fleet.seen()
    split = {entry["peer"] for entry in seen if entry["target"] in ("/split", "/two-lengths")}
    later = {entry["peer"] for entry in seen if entry["target"] == "/after-split"}
    assert split and later and not split & later, seen


def test_an_answer_to_head_keeps_the_replicas_one_length(fleet: Probed) -> None:
    """An answer to HEAD frames no body: the replica's length (what a GET would get) reaches
    the client, and the next answer on the connection is read where it begins; two lengths
    never cross. A GET's length is the body's, as ever."""
    for _ in range(2):  # the native front's fast path the second time
        for path, kept in (("/sized", True), ("/two-lengths", False)):
            sock = _connect(fleet)
            try:
                sock.sendall(_head(fleet, "HEAD", f"/services/probe{path}"))
                reader = _Reader(sock)
                status, headers, body = reader.answer(head=True)
                lengths = [value for name, value in headers if name == "content-length"]
                if kept:
                    assert (status, lengths) == (200, ["1234"]), headers
                elif status != 502:  # the agent's relay refuses the contradiction itself
                    assert status == 200 and not {"5", "22"} & set(lengths), headers
                sock.sendall(_head(fleet, "GET", "/v2/health/live"))
                status, _, body = reader.answer()
                assert (status, json.loads(body)) == (200, {"live": True})
                sock.sendall(_head(fleet, "GET", "/services/probe/sized"))
                status, headers, body = reader.answer()
                assert (status, body) == (200, b"x" * 1234)
                assert [value for name, value in headers if name == "content-length"] in (
                    ["1234"],
                    [],  # chunked
                )
            finally:
                sock.close()


def test_replica_cookies_and_hop_by_hop_headers_never_reach_the_client(fleet: Probed) -> None:
    for _ in range(2):  # the native front's fast path the second time
        sock = _connect(fleet)
        try:
            sock.sendall(_head(fleet, "GET", "/services/probe/cookies"))
            status, headers, body = _Reader(sock).answer()
        finally:
            sock.close()
        names = [name for name, _ in headers]
        assert (status, body) == (200, b"cookies")
        assert ("x-replica", "yes") in headers
        for dropped in ("set-cookie", "set-cookie2", "clear-site-data", "keep-alive"):
            assert dropped not in names, headers
        assert "proxy-authenticate" not in names
        assert names.count("content-length") + names.count("transfer-encoding") == 1


def test_x_forwarded_headers_are_the_gateways_own(fleet: Probed) -> None:
    spoofed = (
        "X-Forwarded-For: 6.6.6.6",
        "X-Forwarded-Host: evil.example",
        "X-Forwarded-Proto: https",
        "Forwarded: for=6.6.6.6;proto=https",
        "X-Real-IP: 6.6.6.6",
    )
    for _ in range(2):  # the native front's fast path the second time
        sock = _connect(fleet)
        try:
            sock.sendall(_head(fleet, "GET", "/services/probe/forwarded", *spoofed))
            status, _, answer = _Reader(sock).answer()
            client = sock.getsockname()[0]
        finally:
            sock.close()
        assert status == 200, answer
        headers = json.loads(answer)["headers"]
        assert [value for name, value in headers if name == "x-forwarded-for"] == [client]
        assert [value for name, value in headers if name == "x-forwarded-proto"] == ["http"]
        assert [value for name, value in headers if name == "x-forwarded-host"] == [
            fleet.host_port()
        ]
        names = [name for name, _ in headers]
        assert "forwarded" not in names and "x-real-ip" not in names, headers
