"""Per-GPU health as the node agent reports it and the control plane reads it (issue 28).

The agent judges each GPU `healthy`, `degraded` or `unhealthy` from what NVML shows (XID events,
ECC counters, row remapping, retired pages, a GPU that is lost, throttling that persists) and
sends every GPU's judgement, with its evidence, to `POST /api/v1/agent/gpu-health`. Both sides
agree here on the states, the evidence kinds, the limits of a report, and NVIDIA's XID
catalogue: which XIDs are the hardware's fault (the GPU is unhealthy) and which are an
application's (counted, never disqualifying alone).

Nothing here imports anything of ours, and nothing here talks to NVML.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

HEALTHY: Final = "healthy"
DEGRADED: Final = "degraded"
UNHEALTHY: Final = "unhealthy"
#: What the agent may report for a GPU, best first.
REPORTED_STATES: Final = (HEALTHY, DEGRADED, UNHEALTHY)


class EvidenceKind(StrEnum):
    """What an evidence item of a report is about."""

    #: An XID event (`xid` holds its code).
    XID = "xid"
    #: Uncorrected ECC errors: volatile ones present, or the aggregate count growing.
    ECC = "ecc"
    #: Row remapping pending (waiting for a reset) or failed.
    REMAP = "remap"
    #: Pages waiting for retirement (older GPUs without row remapping).
    RETIRED_PAGES = "retired_pages"
    #: NVML answers "GPU is lost" (it fell off the bus or needs a reset).
    LOST = "lost"
    #: A hardware, thermal or power-brake slowdown present in every sample over a window.
    THROTTLE = "throttle"
    #: Corrected ECC errors growing fast.
    CORRECTED_ECC = "corrected_ecc"


#: Evidence kinds that make a GPU unhealthy; the others make it degraded.
UNHEALTHY_KINDS: Final = frozenset(
    {
        EvidenceKind.XID,
        EvidenceKind.ECC,
        EvidenceKind.REMAP,
        EvidenceKind.RETIRED_PAGES,
        EvidenceKind.LOST,
    }
)

# The limits of one report (`POST /api/v1/agent/gpu-health`).
MAX_GPUS: Final = 64
MAX_EVIDENCE: Final = 16
MAX_REASON: Final = 500
MAX_DETAIL: Final = 300
MAX_XID_COUNTS: Final = 64


class XidClass(StrEnum):
    #: The GPU itself failed: it is unhealthy until it is reset and checked.
    HARDWARE = "hardware"
    #: An application's fault (a bad kernel, a bad address): counted, never a change alone.
    APPLICATION = "application"


@dataclass(frozen=True)
class Xid:
    code: int
    cls: XidClass
    description: str


def _catalogue(*entries: Xid) -> dict[int, Xid]:
    return {entry.code: entry for entry in entries}


_H = XidClass.HARDWARE
_A = XidClass.APPLICATION

#: NVIDIA's XID catalogue, the codes that decide something
#: (https://docs.nvidia.com/deploy/xid-errors/). An XID not listed here is counted like an
#: application's: the driver emits many that concern one context, and a GPU must not leave the
#: schedule on a code nobody has classified (its counters and "lost" still catch real faults).
XID_CATALOGUE: Final = _catalogue(
    Xid(13, _A, "Graphics Engine Exception"),
    Xid(31, _A, "GPU memory page fault"),
    Xid(43, _A, "GPU stopped processing"),
    Xid(45, _A, "Preemptive cleanup, due to previous errors"),
    Xid(48, _H, "Double Bit ECC Error"),
    Xid(63, _H, "ECC page retirement or row remapping recording event"),
    Xid(64, _H, "ECC page retirement or row remapper recording failure"),
    Xid(74, _H, "NVLink Error"),
    Xid(79, _H, "GPU has fallen off the bus"),
    Xid(92, _H, "High single-bit ECC error rate"),
    Xid(94, _H, "Contained ECC error"),
    Xid(95, _H, "Uncontained ECC error"),
    Xid(119, _H, "GSP RPC timeout"),
    Xid(120, _H, "GSP error"),
)


def xid_class(code: int) -> XidClass:
    """The class of XID `code`; one not in the catalogue counts as an application's."""
    entry = XID_CATALOGUE.get(code)
    return entry.cls if entry is not None else XidClass.APPLICATION


def describe_xid(code: int) -> str:
    """`XID 79 (GPU has fallen off the bus)`; an unlisted code says so."""
    entry = XID_CATALOGUE.get(code)
    return f"XID {code} ({entry.description if entry else 'not in the catalogue'})"


def describe_evidence(evidence: dict[str, object]) -> str:
    """One evidence item for people: its detail and when it was observed, e.g.
    `XID 79 (GPU has fallen off the bus) at 2025-01-01T00:00:00.000+00:00`."""
    return f"{evidence.get('detail', '')} at {evidence.get('at', '')}"
