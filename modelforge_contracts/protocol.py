"""The agent protocol: what the node agent and runtime worker speak, and what a control plane
accepts. Defined here once; every component reports `PROTOCOL_VERSION` and the control plane
judges it against the inclusive range `PROTOCOL_MIN`..`PROTOCOL_MAX` (docs/COMPATIBILITY.md).
"""

from __future__ import annotations

#: The protocol this release's components speak.
PROTOCOL_VERSION = 1
#: The inclusive range of protocols this release's control plane accepts.
PROTOCOL_MIN = 1
PROTOCOL_MAX = 1


def accepted() -> list[int]:
    """Every protocol version a control plane of this release accepts, ascending."""
    return list(range(PROTOCOL_MIN, PROTOCOL_MAX + 1))
