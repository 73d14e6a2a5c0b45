"""Each GPU's health, watched through NVML and reported at once when it changes (issue 28).

`GpuWatcher` is one thread holding one NVML session for its life. It waits on an NVML event set
for critical XID events (a short timeout, so an XID reaches `on_change` within about 100 ms) and
polls each GPU every `poll_seconds`: uncorrected ECC (volatile and aggregate), corrected ECC
(volatile), remapped rows, retired pages pending, "GPU is lost" (from any call) and the throttle
reasons. node_agent._gpu_faults judges each GPU from that; whenever a GPU's state or the kinds
of its evidence change, `on_change` gets the full snapshot. It must not block: the agent's
`GpuHealthReporter` only keeps the snapshot and wakes its sender thread, so the watch never waits
on HTTP.

An NVML failure of the watch (it cannot initialise, an event wait fails) is logged once and
retried with backoff; it never stops the agent. A GPU that does not support an event or a counter
is watched through what it does support.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import pynvml

from modelforge_contracts.gpu_health import describe_xid
from node_agent._gpu_faults import GpuFaults, Observed, Sample, utc_now
from node_agent.nvml import text

log = logging.getLogger("modelforge.node_agent")
T = TypeVar("T")

#: How long one event wait blocks: an XID is handled as soon as it comes, and the poll and a stop
#: are at most this late.
EVENT_WAIT_MS = 100
#: A hardware XID (or the aggregate uncorrected ECC count growing) is an event, not a state: the
#: GPU is reported unhealthy for this long after the last one unless a reset is seen first. Long
#: enough that a GPU failing again after a fault shows it; short enough that an operator who
#: reset the GPU can re-admit it without restarting the agent (the control plane keeps the
#: GPU unhealthy meanwhile anyway; only an active check brings it back).
XID_HOLD_SECONDS = 300.0
#: Corrected ECC errors growing by this many within this window: the memory is wearing out. A
#: few corrected errors a day are normal on HBM; 100 in 10 minutes is not (DCGM's own
#: single-bit-storm heuristics are of that order).
CORRECTED_ECC_THRESHOLD = 100
CORRECTED_ECC_WINDOW_SECONDS = 600.0
#: A hardware, thermal or power-brake slowdown present in every sample for this long: the GPU
#: cannot hold its clocks (cooling, power delivery), not a moment's peak.
THROTTLE_WINDOW_SECONDS = 60.0
#: After an event wait answered "GPU is lost", the poll that finds which one comes this soon.
_LOST_POLL_SECONDS = 1.0
#: Backoff between tries after an NVML failure of the watch.
_BACKOFF_FIRST, _BACKOFF_MAX = 1.0, 60.0
#: How many observations `seen()` keeps.
_SEEN_MAX = 1000


class _Lost(Exception):
    """NVML answered that the GPU is lost."""


def _read(read: Callable[[], T]) -> T | None:
    """A value, None when NVML cannot read it; `_Lost` when the GPU is lost."""
    try:
        return read()
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
            raise _Lost from None
        return None


def _address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


class _Gpu:
    def __init__(self, faults: GpuFaults, handle: Any) -> None:
        self.faults = faults
        self.handle = handle
        #: Registration done (or not worth trying again); `xid_events`: it succeeded.
        self.registered = False
        self.xid_events = False


class GpuWatcher:
    """Watch every GPU (or those of `gpus`, index -> uuid) and call `on_change(snapshot)` with
    the full snapshot once every GPU was read, then whenever a GPU's state or the kinds of its
    evidence change."""

    def __init__(
        self,
        *,
        on_change: Callable[[list[dict[str, Any]]], None],
        poll_seconds: float = 5.0,
        gpus: Mapping[int, str] | None = None,
        hold_seconds: float = XID_HOLD_SECONDS,
        corrected_ecc_threshold: int = CORRECTED_ECC_THRESHOLD,
        corrected_ecc_window: float = CORRECTED_ECC_WINDOW_SECONDS,
        throttle_window: float = THROTTLE_WINDOW_SECONDS,
    ) -> None:
        self.on_change = on_change
        self.poll_seconds = poll_seconds
        self._wanted = dict(gpus) if gpus is not None else None
        self.hold_seconds = hold_seconds
        self.corrected_ecc_threshold = corrected_ecc_threshold
        self.corrected_ecc_window = corrected_ecc_window
        self.throttle_window = throttle_window
        self._lock = threading.Lock()
        self._gpus: list[_Gpu] = []
        self._by_handle: dict[int | None, _Gpu] = {}
        self._seen: deque[dict[str, Any]] = deque(maxlen=_SEEN_MAX)
        self._reported: list[tuple[str, frozenset[tuple[str, int | None]]]] | None = None
        self._failing = False

    # -- what others read -------------------------------------------------------------------

    def snapshot(self) -> list[dict[str, Any]]:
        """Every watched GPU's judgement: the `gpus` of a report."""
        with self._lock:
            return [gpu.faults.report() for gpu in self._gpus]

    def seen(self) -> list[dict[str, Any]]:
        """Every XID event and every piece of evidence as it appeared (the latest 1,000)."""
        with self._lock:
            return list(self._seen)

    # -- the watch --------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Watch until `stop` is set."""
        backoff = _BACKOFF_FIRST
        while not stop.is_set():
            try:
                pynvml.nvmlInit()
                break
            except pynvml.NVMLError as exc:
                self._failed(f"cannot initialise NVML ({exc})")
            if stop.wait(backoff):
                return
            backoff = min(backoff * 2, _BACKOFF_MAX)
        else:
            return
        try:
            backoff = _BACKOFF_FIRST
            while not stop.is_set():
                try:
                    self._watch(stop)
                except pynvml.NVMLError as exc:
                    self._failed(f"NVML failed ({exc})")
                except Exception:  # a bug here must not end the watch for good
                    if not self._failing:
                        log.exception("GPU health watch: unexpected error")
                    self._failed("unexpected error")
                    if stop.wait(backoff):
                        return
                    backoff = min(backoff * 2, _BACKOFF_MAX)
        finally:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass

    def _failed(self, what: str) -> None:
        if not self._failing:
            log.warning("GPU health watch: %s; trying again with backoff up to 60 s", what)
        self._failing = True

    def _watch(self, stop: threading.Event) -> None:
        """One event set for the session; returns when `stop` is set, raises `NVMLError` when
        the watch itself fails (the caller backs off and starts it again)."""
        if not self._gpus:
            self._open()
        events = pynvml.nvmlEventSetCreate()
        try:
            for gpu in self._gpus:
                gpu.registered = gpu.xid_events = False
                self._register(gpu, events)
            self._poll()
            if self._failing:
                log.info("GPU health watch: NVML answers again")
                self._failing = False
            log.info(
                "GPU health watch: watching %d GPU(s), XID events on %d, counters every %g s",
                len(self._gpus),
                sum(1 for gpu in self._gpus if gpu.xid_events),
                self.poll_seconds,
            )
            polled = time.monotonic()
            while not stop.is_set():
                next_poll = polled + self.poll_seconds
                try:
                    data = pynvml.nvmlEventSetWait_v2(events, EVENT_WAIT_MS)
                except pynvml.NVMLError as exc:
                    if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                        # Which GPU: the poll finds out, soon but at most once a second, and a
                        # wait that keeps answering so must not become a busy loop.
                        next_poll = min(next_poll, polled + _LOST_POLL_SECONDS)
                        if stop.wait(EVENT_WAIT_MS / 1000):
                            return
                    elif exc.value != pynvml.NVML_ERROR_TIMEOUT:
                        raise
                else:
                    self._event(data)
                if time.monotonic() >= next_poll:
                    self._poll(events)
                    polled = time.monotonic()
        finally:
            try:
                pynvml.nvmlEventSetFree(events)
            except pynvml.NVMLError:
                pass

    def _open(self) -> None:
        """The GPUs to watch, each with its handle (None while NVML cannot give it: real NVML
        answers GPU_IS_LOST to the lookup of a GPU that fell off the bus; the poll reads it
        as lost and looks it up again)."""
        if self._wanted is not None:
            wanted = sorted(self._wanted.items())
        else:
            count = pynvml.nvmlDeviceGetCount()
            wanted = []
            for index in range(count):
                try:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                    uuid = text(pynvml.nvmlDeviceGetUUID(handle))
                except pynvml.NVMLError as exc:
                    if exc.value != pynvml.NVML_ERROR_GPU_IS_LOST:
                        raise
                    # Without its UUID it cannot be reported; the agent names its GPUs (the
                    # preflight's) and so watches a GPU lost from the start as lost.
                    log.warning("GPU %d is lost (%s): not watched", index, exc)
                    continue
                wanted.append((index, uuid))
        gpus = []
        for index, uuid in wanted:
            faults = GpuFaults(
                index=index,
                uuid=uuid,
                hold_seconds=self.hold_seconds,
                corrected_ecc_threshold=self.corrected_ecc_threshold,
                corrected_ecc_window=self.corrected_ecc_window,
                throttle_window=self.throttle_window,
            )
            gpus.append(_Gpu(faults, self._handle(index)))
        with self._lock:
            self._gpus = gpus

    @staticmethod
    def _handle(index: int) -> Any:
        try:
            return pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError:
            return None

    def _register(self, gpu: _Gpu, events: Any) -> None:
        """Register for the GPU's critical XID events; one that cannot (lost, not supported)
        is watched by the poll alone and registered again once it answers."""
        if gpu.handle is None:
            gpu.handle = self._handle(gpu.faults.index)
            if gpu.handle is None:
                return
        self._by_handle[_address(gpu.handle)] = gpu
        try:
            supported = pynvml.nvmlDeviceGetSupportedEventTypes(gpu.handle)
            if supported & pynvml.nvmlEventTypeXidCriticalError:
                pynvml.nvmlDeviceRegisterEvents(
                    gpu.handle, pynvml.nvmlEventTypeXidCriticalError, events
                )
                gpu.registered = gpu.xid_events = True
            else:
                log.warning(
                    "GPU %d (%s) reports no XID events; only its counters are watched",
                    gpu.faults.index,
                    gpu.faults.uuid,
                )
                gpu.registered = True  # asking again will not change the answer
        except pynvml.NVMLError as exc:
            if exc.value != pynvml.NVML_ERROR_GPU_IS_LOST:
                log.warning(
                    "GPU %d (%s): cannot register for XID events (%s); its counters are watched",
                    gpu.faults.index,
                    gpu.faults.uuid,
                    exc,
                )
                gpu.registered = True

    def _event(self, data: Any) -> None:
        if data.eventType != pynvml.nvmlEventTypeXidCriticalError:
            return
        gpu = self._by_handle.get(_address(data.device))
        if gpu is None:
            return
        code = int(data.eventData)
        seen = Observed(time.monotonic(), utc_now())
        with self._lock:
            evidence = gpu.faults.xid(code, seen)
            self._note(gpu, evidence or _counted(code, seen))
        self._changed()

    def _poll(self, events: Any = None) -> None:
        now = time.monotonic()
        for gpu in self._gpus:
            if events is not None and not gpu.registered:
                self._register(gpu, events)
            sample = self._sample(gpu, Observed(now, utc_now()))
            with self._lock:
                for evidence in gpu.faults.sample(sample):
                    self._note(gpu, evidence)
                gpu.faults.expire(now)
        self._changed()

    def _sample(self, gpu: _Gpu, seen: Observed) -> Sample:
        handle = gpu.handle if gpu.handle is not None else self._handle(gpu.faults.index)
        if handle is None:
            return Sample(seen, lost=True)
        gpu.handle = handle
        ecc = pynvml.nvmlDeviceGetTotalEccErrors
        uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        corrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        try:
            return Sample(
                seen,
                uncorrected_volatile=_read(
                    lambda: ecc(handle, uncorrected, pynvml.NVML_VOLATILE_ECC)
                ),
                uncorrected_aggregate=_read(
                    lambda: ecc(handle, uncorrected, pynvml.NVML_AGGREGATE_ECC)
                ),
                corrected_volatile=_read(lambda: ecc(handle, corrected, pynvml.NVML_VOLATILE_ECC)),
                remapped_rows=_read(lambda: pynvml.nvmlDeviceGetRemappedRows(handle)),
                retired_pages_pending=_read(
                    lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)
                ),
                throttle_mask=_read(lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)),
            )
        except _Lost:
            return Sample(seen, lost=True)

    def _note(self, gpu: _Gpu, evidence: dict[str, Any]) -> None:
        self._seen.append({"index": gpu.faults.index, "uuid": gpu.faults.uuid, **evidence})

    def _changed(self) -> None:
        """Call `on_change` when a GPU's state or evidence kinds differ from the last call."""
        snapshot = self.snapshot()
        digest = [
            (gpu["state"], frozenset((e["kind"], e.get("xid")) for e in gpu["evidence"]))
            for gpu in snapshot
        ]
        if digest == self._reported:
            return
        previous, self._reported = self._reported, digest
        for position, gpu in enumerate(snapshot):
            state = gpu["state"]
            before = previous[position][0] if previous else None
            if before is not None and before != state:
                log.warning(
                    "GPU %d (%s) is now %s (was %s): %s",
                    gpu["index"],
                    gpu["uuid"],
                    state,
                    before,
                    gpu["reason"] or "no evidence left",
                )
        self.on_change(snapshot)


def _counted(code: int, seen: Observed) -> dict[str, Any]:
    """What `seen()` keeps of an XID that is only counted."""
    return {
        "kind": "xid",
        "at": seen.at,
        "detail": describe_xid(code),
        "xid": code,
        "counted": True,
    }


#: A report is sent again this often even unchanged, so a control plane that restarted or missed
#: one catches up (idempotent).
REFRESH_SECONDS = 60.0


class GpuHealthReporter:
    """The latest snapshot and its sending, apart from the watch: `offer` (the watcher's
    `on_change`) only keeps the snapshot and sets `wake`; `send_latest`, on the agent's sender
    thread, posts it. A slow or failing control plane delays that thread, never the watch."""

    def __init__(self, send: Callable[[dict[str, Any]], object]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._latest: list[dict[str, Any]] | None = None
        #: Set on every offered snapshot (the sender's loop clears it).
        self.wake = threading.Event()

    def offer(self, snapshot: list[dict[str, Any]]) -> None:
        with self._lock:
            self._latest = snapshot
        self.wake.set()

    def send_latest(self) -> None:
        with self._lock:
            latest = self._latest
        if latest is not None:
            self._send({"gpus": latest})
