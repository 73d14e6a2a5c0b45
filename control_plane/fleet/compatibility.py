"""Protocol compatibility: one verdict function for agents and runtime workers, against the
range in `modelforge_contracts.protocol` (read at call time)."""

from __future__ import annotations

from typing import Any

from control_plane.errors import ProtocolIncompatible
from modelforge_contracts import protocol

_NEXT_STEP = {
    "TOO_OLD": "Upgrade the {component} to a release that speaks protocol {lo}..{hi}.",
    "TOO_NEW": "Upgrade the control plane, or run a {component} release that speaks protocol "
    "{lo}..{hi}.",
    "UNKNOWN": "Report `protocol_version` as an integer; this control plane accepts {lo}..{hi}.",
}


def judge_protocol(value: Any, *, component: str) -> int:
    """Return the protocol integer, or raise `ProtocolIncompatible` with TOO_OLD/TOO_NEW/UNKNOWN."""
    lo, hi = protocol.PROTOCOL_MIN, protocol.PROTOCOL_MAX
    if isinstance(value, bool) or not isinstance(value, int):
        code = "UNKNOWN"
        message = f"The {component} did not report a protocol version this control plane can read."
    elif value < lo:
        code = "TOO_OLD"
        message = f"The {component} speaks a protocol older than {lo}."
    elif value > hi:
        code = "TOO_NEW"
        message = f"The {component} speaks a protocol newer than {hi}."
    else:
        return value
    next_step = _NEXT_STEP[code].format(component=component, lo=lo, hi=hi)
    raise ProtocolIncompatible(message, next_step, code=code, component=component)
