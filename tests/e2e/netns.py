"""Nodes that accept no inbound connection, for end-to-end tests: each node's processes (agent and
runtime worker) run in a network namespace of its own, joined to the host by a veth pair on a
bridge the control plane listens on, so that everything the node serves is out of the control
plane's reach while the node's outbound connections reach it (issue 27's acceptance).

    with Fabric() as fabric:                 # a bridge with an address of a private /24
        server = fabric.server(...)           # a LiveServer listening on the bridge's address
        ns = fabric.namespace()               # a namespace with a veth to the bridge
        node = NamespacedNode(ns, root, server.url, token=...)

Needs root (`ip netns`, `ip link`). Every name carries this process's id, so two runs never share
one; leaving the fabric (even on a failure) kills whatever still runs in its namespaces, deletes
them (their veths go with them) and the bridge; a fabric left behind by a killed run is swept by
the next one (its owner's process id is gone)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.e2e.node import Node
from tests.e2e.server import LiveServer

#: Every name this module creates starts so: `mfe<pid hex>...`, at most 15 characters (IFNAMSIZ).
PREFIX = "mfe"
_OWNED = re.compile(rf"^{PREFIX}([0-9a-f]{{1,7}})[bhn]")


def ip(*args: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(name: str) -> None:
    """SIGKILL whatever runs in namespace `name`, then delete it (its veth ends go with it)."""
    pids = [int(pid) for pid in ip("netns", "pids", name, check=False).split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while ip("netns", "pids", name, check=False).split() and time.monotonic() < deadline:
        time.sleep(0.05)
    ip("netns", "del", name, check=False)


def sweep_abandoned() -> None:
    """Remove namespaces and links of earlier runs whose process is gone."""
    for line in ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        owner = _OWNED.match(name)
        if owner and not _pid_alive(int(owner.group(1), 16)):
            _kill_namespace(name)
    for line in ip("-o", "link", "show", check=False).splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        link = parts[1].strip().split("@")[0]
        owner = _OWNED.match(link)
        if owner and not _pid_alive(int(owner.group(1), 16)):
            ip("link", "del", link, check=False)


def _free_subnet() -> int:
    """A third octet `k` such that 10.239.k.0/24 is on no interface of the host."""
    used = ip("-o", "-4", "addr", "show", check=False)
    for k in [(os.getpid() + step) % 250 + 1 for step in range(250)]:
        if f"10.239.{k}." not in used:
            return k
    raise RuntimeError("no free 10.239.k.0/24 subnet")


@dataclass
class Namespace:
    name: str
    #: The node's own address, on its veth end inside the namespace.
    address: str

    def command(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *args]

    def pids(self) -> list[int]:
        return [int(pid) for pid in ip("netns", "pids", self.name, check=False).split()]

    def listening(self) -> list[tuple[str, int]]:
        """Every TCP socket listening in the namespace (IPv4 and IPv6): (address, port)."""
        found: list[tuple[str, int]] = []
        for table in ("tcp", "tcp6"):
            text = subprocess.run(
                self.command(["cat", f"/proc/net/{table}"]),
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
            for row in text.splitlines()[1:]:
                fields = row.split()
                if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                    address, port = fields[1].rsplit(":", 1)
                    found.append((_address(address), int(port, 16)))
        return found


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether a TCP connection from here to host:port is accepted."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class Fabric:
    """A bridge on the host holding 10.239.k.1/24 and namespaces at .2, .3, ..."""

    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid():x}")
    subnet: int = 0
    namespaces: list[Namespace] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.tag}b"

    @property
    def host_address(self) -> str:
        return f"10.239.{self.subnet}.1"

    def __enter__(self) -> Fabric:
        sweep_abandoned()
        self.subnet = _free_subnet()
        try:
            ip("link", "add", "name", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        return self

    def namespace(self) -> Namespace:
        index = len(self.namespaces)
        name = f"{self.tag}n{index}"
        host_end, node_end = f"{self.tag}h{index}", f"{self.tag}n{index}"
        address = f"10.239.{self.subnet}.{index + 2}"
        ip("netns", "add", name)
        namespace = Namespace(name, address)
        self.namespaces.append(namespace)
        ip("link", "add", host_end, "type", "veth", "peer", "name", node_end)
        ip("link", "set", node_end, "netns", name)
        ip("link", "set", host_end, "master", self.bridge)
        ip("link", "set", host_end, "up")
        inside = ["netns", "exec", name, "ip"]
        ip(*inside, "addr", "add", f"{address}/24", "dev", node_end)
        ip(*inside, "link", "set", node_end, "up")
        ip(*inside, "link", "set", "lo", "up")
        return namespace

    def server(self, root: Path, env_overrides: dict[str, str]) -> NamespacedServer:
        """A control plane (not started) listening on the bridge's address only."""
        return NamespacedServer(
            root / "cp",
            f"sqlite:///{root / 'cp.db'}",
            env_overrides={**env_overrides, "MODELFORGE_HOST": self.host_address},
            host=self.host_address,
        )

    def close(self) -> None:
        for namespace in self.namespaces:
            _kill_namespace(namespace.name)
        self.namespaces.clear()
        ip("link", "del", self.bridge, check=False)

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class NamespacedServer(LiveServer):
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(kw_only=True)
class NamespacedNode(Node):
    """A `Node` whose agent and runtime worker run inside `namespace`."""

    namespace: Namespace

    def env(self) -> dict[str, str]:
        # The bridge is a private link of this machine: plain HTTP to its address is the test's.
        return {**super().env(), "MODELFORGE_AGENT_ALLOW_INSECURE_HTTP": "true"}

    def _start_worker(self, args: list[str]) -> Node:
        return super()._start_worker(self.namespace.command(args))

    def start_agent(self, *args: str) -> Node:
        import sys

        from tests.e2e.node import _spawn

        self.root.mkdir(parents=True, exist_ok=True)
        self.agent = _spawn(
            self.namespace.command([sys.executable, "-m", "node_agent", *args]),
            self.env(),
            self.agent_log,
        )
        return self

    def kill(self) -> None:
        """SIGKILL its agent and worker (and everything the worker started: the whole
        namespace), as a node lost at once."""
        for pid in self.namespace.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in (self.agent, self.worker):
            if process is not None:
                process.wait(timeout=20)
        self.agent = self.worker = None

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
