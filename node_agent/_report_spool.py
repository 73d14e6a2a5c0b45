"""A running job's reports on their way to the control plane (node_agent.work).

The thread reading the job's records from the runtime worker hands each event to the spool and
reads on; the spool's own thread sends them in order, in batches (every half second while some
wait, and at least every progress interval, empty, to renew the job's contact). Each batch is
retried under the client's one rule until the control plane takes it — through its restart or
its database outage too — so the job runs on while the control plane is away and nothing it
reported is dropped. The job's outcome goes after its last event (`close`, then `complete`).

Bounded: while `max_events` events or `max_bytes` of records wait, the reader waits for room;
the worker's stream then waits in its socket, and the job's records in the worker, so memory
stays bounded and nothing is dropped. Delivery is at least once: a batch the control plane took
but whose answer was lost (it was killed meanwhile) is sent again.

When the sending ends early (the credential revoked, the agent stopping), the reports can go
nowhere: the spool stops the job (`on_cancel`) and `add` raises what ended it, so the reader stops
reading and the job's stream closes, as a report failing on the reader's own thread did.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from node_agent.client import ControlPlane

#: At most this many events per report.
BATCH = 200
#: Events wait at most this long for the next report.
REPORT_EVERY = 0.5
MAX_EVENTS = 10_000
MAX_BYTES = 16 * 1024 * 1024


class ReportSpool:
    def __init__(
        self,
        *,
        control_plane: ControlPlane,
        job_id: str,
        progress_every: float,
        on_cancel: Callable[[], None],
        max_events: int = MAX_EVENTS,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self._control_plane = control_plane
        self._job_id = job_id
        self._progress_every = progress_every
        #: Stops the job: the control plane says so, or its reports can go nowhere.
        self._on_cancel = on_cancel
        self._max_events = max_events
        self._max_bytes = max_bytes
        self._cond = threading.Condition()
        self._events: deque[tuple[dict[str, Any], int]] = deque()
        self._bytes = 0
        self._closing = False
        #: What ended the sending early (the agent stopping), raised by `add` and `close`.
        self._failure: BaseException | None = None
        self._thread = threading.Thread(
            target=self._send_all, daemon=True, name=f"reports-{job_id}"
        )

    def start(self) -> ReportSpool:
        self._thread.start()
        return self

    def add(self, event: dict[str, Any], size: int) -> None:
        """Queue `event` (its record took `size` bytes); waits while the spool is full. Raises
        what ended the sending early, if it did: the reader must stop reading."""
        with self._cond:
            while self._failure is None and self._events and self._full(size):
                self._cond.wait()
            if self._failure is not None:
                raise self._failure
            self._events.append((event, size))
            self._bytes += size
            self._cond.notify_all()

    def close(self) -> None:
        """Send every event still waiting, then return; raises what stopped the sending."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        if self._failure is not None:
            raise self._failure

    def _full(self, size: int) -> bool:
        return len(self._events) >= self._max_events or self._bytes + size > self._max_bytes

    def _next_batch(self, last: float) -> list[dict[str, Any]] | None:
        """The next report's events (empty: a progress report), when it is due; None when
        closed with nothing left."""
        with self._cond:
            while True:
                waited = time.monotonic() - last
                if self._events and (
                    self._closing or len(self._events) >= BATCH or waited >= REPORT_EVERY
                ):
                    break
                if self._closing:
                    return None
                if waited >= self._progress_every:
                    return []
                due = REPORT_EVERY if self._events else self._progress_every
                self._cond.wait(timeout=due - waited)
            taken = [self._events.popleft() for _ in range(min(len(self._events), BATCH))]
            self._bytes -= sum(size for _, size in taken)
            self._cond.notify_all()  # room for the reader
            return [event for event, _ in taken]

    def _send_all(self) -> None:
        last = time.monotonic()
        try:
            while (batch := self._next_batch(last)) is not None:
                if self._control_plane.events(self._job_id, batch):
                    self._on_cancel()
                last = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - handed to the reader's thread by `add`
            with self._cond:
                self._failure = exc
                self._cond.notify_all()
            # A reader waiting for the job's next record would otherwise read on until it ends.
            self._on_cancel()
