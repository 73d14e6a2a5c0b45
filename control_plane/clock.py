"""Time as a dependency, so that liveness, expiry and the scheduler's holds and deadlines can be
tested without sleeping."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol


class Clock(Protocol):
    def now(self) -> datetime: ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: what holds, waits and deadlines count in
        (only differences between two readings mean anything)."""
        ...

    def on_advance(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback`, on the thread that moves the clock, each time it jumps ahead rather
        than flowing; returns what stops that. `wait_until` uses it to see a deadline pass."""
        ...


def _nothing() -> None:
    return None


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()

    def on_advance(self, callback: Callable[[], None]) -> Callable[[], None]:
        # It flows, never jumps: a waiter's own timer meets its deadline.
        return _nothing


class ManualClock:
    """A clock that moves only when told to (tests and simulations)."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
        self._monotonic = 0.0
        self._lock = threading.Lock()
        self._watchers: dict[object, Callable[[], None]] = {}

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._monotonic

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += timedelta(seconds=seconds)
            self._monotonic += seconds
            watchers = list(self._watchers.values())
        for watcher in watchers:
            watcher()

    def on_advance(self, callback: Callable[[], None]) -> Callable[[], None]:
        token = object()
        with self._lock:
            self._watchers[token] = callback

        def stop() -> None:
            with self._lock:
                self._watchers.pop(token, None)

        return stop


async def wait_until(clock: Clock, deadline: float, done: asyncio.Future[Any]) -> bool:
    """Wait until `done` completes or `clock.monotonic()` reaches `deadline`, whichever comes
    first: True when `done` did. The waiting itself is real (asyncio's timer, or the clock's
    jump noticed at once); the deadline is the clock's. `done` is never cancelled here."""
    loop = asyncio.get_running_loop()
    while not done.done():
        jumped: asyncio.Future[None] = loop.create_future()

        def wake(jumped: asyncio.Future[None] = jumped) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, jumped)

        # Watched before the clock is read, so a jump between the two is not missed.
        stop = clock.on_advance(wake)
        try:
            remaining = deadline - clock.monotonic()
            if remaining <= 0:
                return False
            await asyncio.wait(
                (done, jumped), timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stop()
            jumped.cancel()
    return True


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
