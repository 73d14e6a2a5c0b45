"""One GPU's judgement from what NVML showed of it: the rules of issue 28, without NVML.

The watcher (node_agent.gpu_health) feeds each GPU's `GpuFaults` the XID events and the polled
samples; `report()` is that GPU's entry of the report (`healthy`, `degraded` or `unhealthy`,
with its reason and evidence). It judges what it sees *now*: a fault that goes away (a reset
cleared the counters, the GPU answers again) leaves the report, and the control plane keeps
`unhealthy` sticky on its side.

An event (a hardware XID, the aggregate uncorrected ECC count growing) has no "now" of its own:
it is held until the GPU is seen reset (it was lost and answers again, or a volatile ECC counter
went down: only a reset or a reboot clears those) or until `hold_seconds` passed since it last
came, whichever is first.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from modelforge_contracts.gpu_health import (
    DEGRADED,
    HEALTHY,
    MAX_DETAIL,
    MAX_EVIDENCE,
    MAX_REASON,
    MAX_XID_COUNTS,
    UNHEALTHY,
    UNHEALTHY_KINDS,
    EvidenceKind,
    XidClass,
    describe_xid,
    xid_class,
)

#: The throttle reasons that say the GPU cannot hold its clocks by itself: a hardware slowdown
#: (HW_SLOWDOWN 0x8), hardware thermal slowdown (0x40) and the power brake (0x80). Software power
#: capping, idle and application clocks are normal under load and never evidence.
HW_SLOWDOWN_MASK = 0x8 | 0x40 | 0x80
_SLOWDOWN_NAMES = {0x8: "hw_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown"}


def utc_now() -> str:
    """The wall clock as evidence carries it: ISO-8601 UTC with milliseconds and `Z`."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Observed:
    """When something was seen: monotonic seconds (for windows), wall clock (for people)."""

    mono: float
    at: str


@dataclass(frozen=True)
class Sample:
    """One poll of one GPU; None: NVML cannot read that value here (not supported, say)."""

    seen: Observed
    lost: bool = False
    uncorrected_volatile: int | None = None
    uncorrected_aggregate: int | None = None
    corrected_volatile: int | None = None
    #: (correctable rows, uncorrectable rows, pending, failure)
    remapped_rows: tuple[int, int, int, int] | None = None
    retired_pages_pending: int | None = None
    throttle_mask: int | None = None


def _evidence(
    kind: EvidenceKind, seen: Observed, detail: str, *, xid: int | None = None, value: int | None
) -> dict[str, Any]:
    item: dict[str, Any] = {"kind": kind.value, "at": seen.at, "detail": detail[:MAX_DETAIL]}
    if xid is not None:
        item["xid"] = xid
    if value is not None:
        item["value"] = value
    return item


class GpuFaults:
    """The evidence against one GPU, and its judgement."""

    def __init__(
        self,
        *,
        index: int,
        uuid: str,
        hold_seconds: float,
        corrected_ecc_window: float,
        corrected_ecc_threshold: int,
        throttle_window: float,
    ) -> None:
        self.index = index
        self.uuid = uuid
        self.hold_seconds = hold_seconds
        self.corrected_ecc_window = corrected_ecc_window
        self.corrected_ecc_threshold = corrected_ecc_threshold
        self.throttle_window = throttle_window
        self.xid_counts: Counter[int] = Counter()
        #: Events held until a reset or `hold_seconds`: key -> (when it last came, evidence).
        self._held: dict[str, tuple[float, dict[str, Any]]] = {}
        #: Conditions present in the last sample: key -> evidence (its `at`: when it began).
        self._conditions: dict[str, dict[str, Any]] = {}
        self._last: Sample | None = None
        self._corrected: deque[tuple[float, int]] = deque()
        self._throttled_since: Observed | None = None

    # -- what NVML showed -------------------------------------------------------------------

    def xid(self, code: int, seen: Observed) -> dict[str, Any] | None:
        """An XID event; the evidence when it counts against the GPU (hardware class)."""
        self.xid_counts[code] += 1
        if xid_class(code) is not XidClass.HARDWARE:
            return None
        evidence = _evidence(EvidenceKind.XID, seen, describe_xid(code), xid=code, value=None)
        self._held[f"xid:{code}"] = (seen.mono, evidence)
        return evidence

    def sample(self, sample: Sample) -> list[dict[str, Any]]:
        """A poll's readings; the evidence that appeared with it."""
        last, self._last = self._last, sample
        if last is not None and _was_reset(last, sample):
            self._held.clear()
            self._corrected.clear()
        fresh: list[dict[str, Any]] = []
        held = self._aggregate_growth(last, sample)
        if held is not None:
            fresh.append(held)
        conditions = self._conditions_of(sample, last)
        for key, evidence in conditions.items():
            if key in self._conditions:
                # The same condition going on: it began when it was first seen.
                evidence["at"] = self._conditions[key]["at"]
            else:
                fresh.append(evidence)
        self._conditions = conditions
        return fresh

    def _aggregate_growth(self, last: Sample | None, sample: Sample) -> dict[str, Any] | None:
        before = last.uncorrected_aggregate if last is not None else None
        now = sample.uncorrected_aggregate
        if before is None or now is None or now <= before:
            return None
        detail = f"aggregate uncorrected ECC errors grew from {before} to {now}"
        evidence = _evidence(EvidenceKind.ECC, sample.seen, detail, value=now)
        self._held["ecc:aggregate"] = (sample.seen.mono, evidence)
        return evidence

    def _conditions_of(self, sample: Sample, last: Sample | None) -> dict[str, dict[str, Any]]:
        seen = sample.seen
        if sample.lost:
            # A lost GPU answers nothing else: what its counters last showed still stands.
            kept = {k: v for k, v in self._conditions.items() if k != "lost"}
            detail = "NVML answers GPU is lost: it fell off the bus or needs a reset"
            return {"lost": _evidence(EvidenceKind.LOST, seen, detail, value=None), **kept}
        found: dict[str, dict[str, Any]] = {}
        if sample.uncorrected_volatile:
            count = sample.uncorrected_volatile
            detail = f"volatile uncorrected ECC errors: {count}"
            found["ecc"] = _evidence(EvidenceKind.ECC, seen, detail, value=count)
        if sample.remapped_rows is not None:
            _, uncorrectable, pending, failure = sample.remapped_rows
            if failure:
                detail = "row remapping failed: the GPU has no spare row left"
                found["remap"] = _evidence(EvidenceKind.REMAP, seen, detail, value=uncorrectable)
            elif pending:
                detail = (
                    f"row remapping pending ({uncorrectable} rows remapped for uncorrectable "
                    "errors): reset the GPU to apply it"
                )
                found["remap"] = _evidence(EvidenceKind.REMAP, seen, detail, value=uncorrectable)
        if sample.retired_pages_pending:
            detail = "retired pages pending: reset the GPU to retire them"
            found["retired_pages"] = _evidence(EvidenceKind.RETIRED_PAGES, seen, detail, value=None)
        growth = self._corrected_growth(sample)
        if growth is not None:
            found["corrected_ecc"] = growth
        slowdown = self._slowdown(sample)
        if slowdown is not None:
            found["throttle"] = slowdown
        return found

    def _corrected_growth(self, sample: Sample) -> dict[str, Any] | None:
        count = sample.corrected_volatile
        if count is None:
            return None
        now = sample.seen.mono
        self._corrected.append((now, count))
        while self._corrected and self._corrected[0][0] < now - self.corrected_ecc_window:
            self._corrected.popleft()
        grown = count - min(value for _, value in self._corrected)
        if grown < self.corrected_ecc_threshold:
            return None
        detail = (
            f"corrected ECC errors grew by {grown} within {self.corrected_ecc_window:g} s "
            f"(threshold {self.corrected_ecc_threshold})"
        )
        return _evidence(EvidenceKind.CORRECTED_ECC, sample.seen, detail, value=count)

    def _slowdown(self, sample: Sample) -> dict[str, Any] | None:
        mask = sample.throttle_mask
        if mask is None or not mask & HW_SLOWDOWN_MASK:
            self._throttled_since = None
            return None
        if self._throttled_since is None:
            self._throttled_since = sample.seen
        if sample.seen.mono - self._throttled_since.mono < self.throttle_window:
            return None
        names = ", ".join(name for bit, name in _SLOWDOWN_NAMES.items() if mask & bit)
        detail = f"{names} in every sample for {self.throttle_window:g} s"
        return _evidence(EvidenceKind.THROTTLE, sample.seen, detail, value=mask)

    # -- the judgement ----------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Forget held events older than `hold_seconds`."""
        for key, (mono, _) in list(self._held.items()):
            if mono < now - self.hold_seconds:
                del self._held[key]

    def report(self) -> dict[str, Any]:
        """This GPU's entry of the report body."""
        evidence = [item for _, item in self._held.values()] + list(self._conditions.values())
        against = [item for item in evidence if item["kind"] in UNHEALTHY_KINDS]
        others = [item for item in evidence if item["kind"] not in UNHEALTHY_KINDS]
        against.sort(key=lambda item: item["at"])
        others.sort(key=lambda item: item["at"])
        state = UNHEALTHY if against else DEGRADED if others else HEALTHY
        reasons = against or others
        entry: dict[str, Any] = {
            "index": self.index,
            "uuid": self.uuid,
            "state": state,
            "reason": "; ".join(item["detail"] for item in reasons)[:MAX_REASON],
            "evidence": [dict(item) for item in (against + others)[:MAX_EVIDENCE]],
        }
        if self.xid_counts:
            common = self.xid_counts.most_common(MAX_XID_COUNTS)
            entry["xid_counts"] = {str(code): count for code, count in sorted(common)}
        return entry


def _was_reset(last: Sample, now: Sample) -> bool:
    """Whether the GPU was reset between two samples: it was lost and answers again, or a
    volatile ECC counter went down (only a reset or a reboot clears them)."""
    if last.lost and not now.lost:
        return True
    pairs = (
        (last.uncorrected_volatile, now.uncorrected_volatile),
        (last.corrected_volatile, now.corrected_volatile),
    )
    return any(
        before is not None and after is not None and after < before for before, after in pairs
    )
