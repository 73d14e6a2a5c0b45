"""The agent's side of the local runtime worker link: a unix socket, never the network.

Plain `http.client` over AF_UNIX: it is small, and it closes the socket when the worker is not
there (httpx's unix transport leaks the socket on a failed connect, which an agent polling a
stopped worker every second would turn into a descriptor leak).

`WorkerWatch` is the agent's one judgement of whether its worker is there: a loop asks the worker
every second (`watch_once`), and whatever else meets a worker that does not answer (the services'
sync, a job's stream) tells it too. A worker that refuses connections, or whose socket is gone,
is lost at once; one that is only slow is lost after two missed answers in a row. A loss is
logged once when it starts and once when it ends, and everything waiting on `wake_on_change`
events is woken, so the agent reports it at once: its services `failed`, its health `degraded`
naming the worker, its inventory without a worker.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from modelforge_contracts.ipc import UnixHTTPConnection

log = logging.getLogger("modelforge.node_agent")

#: A worker that answers nothing for this long counts as not answering (it is busy at most).
ANSWER_TIMEOUT = 2.0


class WorkerUnanswered(Exception):
    """The worker gave no usable answer; `busy` when it may only be slow (a timeout)."""

    def __init__(self, reason: str, *, busy: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.busy = busy


def ask_runtime_worker(socket_path: Path, *, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
    """The worker's version, protocol and health; `WorkerUnanswered` when it does not answer."""
    if not socket_path.exists():
        raise WorkerUnanswered("its socket does not exist", busy=False)
    connection = UnixHTTPConnection(socket_path, timeout)
    try:
        connection.request("GET", "/v1/health")
        response = connection.getresponse()
        if response.status != 200:
            raise WorkerUnanswered(f"GET /v1/health answered {response.status}", busy=False)
        data = json.loads(response.read())
        if not isinstance(data, dict):
            raise WorkerUnanswered("its health answer is not a JSON object", busy=False)
    except TimeoutError:
        raise WorkerUnanswered(f"no answer within {timeout:g} s", busy=True) from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise WorkerUnanswered(type(exc).__name__, busy=False) from None
    finally:
        connection.close()
    return {
        "version": str(data.get("version", "unknown")),
        "protocol_version": data.get("protocol_version"),
        "healthy": bool(data.get("healthy", False)),
    }


def query_runtime_worker(
    socket_path: Path, *, timeout: float = ANSWER_TIMEOUT
) -> dict[str, Any] | None:
    """The worker's version, protocol and health, or None when it does not answer."""
    try:
        return ask_runtime_worker(socket_path, timeout=timeout)
    except WorkerUnanswered:
        return None


def wait_or_wake(
    stop: threading.Event, seconds: float, wake: threading.Event | None, *, check: float = 0.25
) -> bool:
    """Wait `seconds`, or less when `wake` is set (which is then cleared); True when `stop` is
    set (the caller's loop ends)."""
    if wake is None:
        return stop.wait(seconds)
    deadline = time.monotonic() + seconds
    while not stop.is_set():
        left = deadline - time.monotonic()
        if left <= 0 or wake.wait(min(left, check)):
            wake.clear()
            return stop.is_set()
    return True


class WorkerWatch:
    """Whether the local runtime worker is there, as the agent last found it."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._lock = threading.Lock()
        self._report: dict[str, Any] | None = None
        self._misses = 0
        #: When the current loss began (wall clock, for people; monotonic, for its duration).
        self._lost_at: datetime | None = None
        self._lost_since: float | None = None
        self._listeners: list[threading.Event] = []

    def wake_on_change(self) -> threading.Event:
        """An event set whenever the worker is lost or comes back (the caller clears it)."""
        event = threading.Event()
        with self._lock:
            self._listeners.append(event)
        return event

    @property
    def report(self) -> dict[str, Any] | None:
        """The worker's last health answer, or None while it is lost (or never answered)."""
        with self._lock:
            return None if self._lost_since is not None else self._report

    @property
    def lost(self) -> bool:
        with self._lock:
            return self._lost_since is not None

    def problem(self) -> str | None:
        """What the agent's health says while the worker is lost (stable for the whole loss,
        so a heartbeat's body does not change every second)."""
        with self._lock:
            if self._lost_at is None:
                return None
            at = self._lost_at.strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"the runtime worker at {self.socket_path} has not answered since {at}"

    def watch_once(self) -> dict[str, Any] | None:
        """Ask the worker now; record what it said (or that it did not answer)."""
        try:
            report = ask_runtime_worker(self.socket_path)
        except WorkerUnanswered as exc:
            self.unanswered(exc.reason, busy=exc.busy)
            return None
        self.answered(report)
        return report

    def answered(self, report: dict[str, Any] | None = None) -> None:
        """The worker answered (with this health report, when the caller asked for it)."""
        with self._lock:
            self._misses = 0
            if report is not None:
                self._report = report
            since, self._lost_since, self._lost_at = self._lost_since, None, None
            listeners = list(self._listeners) if since is not None else []
        if since is not None:
            log.info(
                "the runtime worker at %s answers again after %.1f s; its services are started "
                "again and jobs are claimed again",
                self.socket_path,
                time.monotonic() - since,
            )
        for event in listeners:
            event.set()

    def unanswered(self, reason: str, *, busy: bool = False) -> None:
        """The worker did not answer (`busy`: it may only be slow; twice in a row is a loss)."""
        with self._lock:
            self._misses += 1
            if self._lost_since is not None or (busy and self._misses < 2):
                return
            self._lost_since, self._lost_at = time.monotonic(), datetime.now(UTC)
            listeners = list(self._listeners)
        log.error(
            "the runtime worker at %s does not answer (%s): its services are reported down and "
            "no job is claimed until it answers again; start it (or check that it shares the "
            "socket's directory with the agent)",
            self.socket_path,
            reason,
        )
        for event in listeners:
            event.set()
