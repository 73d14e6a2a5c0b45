"""Whether this node has anything to do, for the idle exit (`MODELFORGE_AGENT_MAX_IDLE_SECONDS`).

The node is busy while a work slot holds a job (from the moment its claim is answered until the
job's outcome is reported) or while there is a service the runtime worker runs or the control
plane wants on this node (a failed one included: the control plane still places it here). A
claim waiting for work is not work. It never decides anything itself: the agent reads
`idle_for()` and stops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Activity:
    """The node's jobs in hand and services, and since when it has had none."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs = 0
        self._services = 0
        self._idle_since: float | None = clock()

    def job_claimed(self) -> None:
        with self._lock:
            self._jobs += 1
            self._idle_since = None

    def job_ended(self) -> None:
        with self._lock:
            self._jobs = max(0, self._jobs - 1)
            self._settle()

    def services(self, count: int) -> None:
        """The services the worker runs or the control plane wants here, as last learned."""
        with self._lock:
            self._services = count
            if count:
                self._idle_since = None
            else:
                self._settle()

    def idle_for(self) -> float:
        """Seconds since the node last had a job or a service; 0 while it has one."""
        with self._lock:
            return 0.0 if self._idle_since is None else self._clock() - self._idle_since

    def _settle(self) -> None:
        if self._jobs == 0 and self._services == 0 and self._idle_since is None:
            self._idle_since = self._clock()
