"""The hosts a node agent reaches over plain `http://` without being told to (this machine's
loopback), one rule for the agent that enforces it and for the control plane that writes an
agent's settings (the enroll wizard's `.env`, a Slurm job script)."""

from __future__ import annotations

import ipaddress


def ip_address_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`host` (as `urlsplit(...).hostname` gives it: no brackets) as an IP address; None for a
    name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def is_loopback_host(host: str) -> bool:
    """`localhost` or a loopback address: traffic to it never leaves the machine."""
    address = ip_address_of(host)
    return host == "localhost" or (address is not None and address.is_loopback)
