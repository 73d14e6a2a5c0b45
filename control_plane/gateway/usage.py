"""The tokens the OpenAI API's calls use, per access token and service (issue 43; docs/llm.md).

The native front reads each call's answer for the engine's own count (`native/gateway_front/
src/meter.rs`: the answer's `usage`, asked of the engine for every streamed call) and reports
it with the call's end. `UsageBook` adds the counts up per (token, service, minute) in memory
and writes them at most `FLUSH_SECONDS` later, one upsert per row that adds to what the
minute's row holds, so several control-plane processes sum into the same rows. A call whose
answer carried no count (the engine failed, the client left before the end) is counted as a
request with no tokens. What a process had not written when it died is lost (at most
`FLUSH_SECONDS` of calls); nothing is counted twice.

`usage_of` reads a service's rows over a window, per token: the answer of
`GET /api/v1/services/{id}/usage`.

A key may be limited in tokens per minute (`tokens_per_minute`): the book also keeps, per key,
the tokens its calls used in each of the last `WINDOW_SECONDS` seconds, and `wait_for` says how
long a key at its limit must wait (the gateway answers 429 with that `Retry-After`). A call is
let through while the key's last minute is under the limit, and counted when it ends, so calls
already in flight when the limit is reached may take the key past it (by at most what they
use). Like the request rate, each control-plane process holds the window of its own calls.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.db import dialect_insert
from control_plane.models import LlmUsage, ServiceAccessToken

log = logging.getLogger(__name__)

#: The longest a counted call waits to be written.
FLUSH_SECONDS = 1.0
#: The window a key's `tokens_per_minute` is counted over, in seconds.
WINDOW_SECONDS = 60


@dataclass
class _Counts:
    requests: int = 0
    prompt: int = 0
    completion: int = 0


class UsageBook:
    """One per control-plane process (held with the gateway)."""

    def __init__(self, *, write_sessions: Callable[[], Session], clock: Clock) -> None:
        self._write_sessions = write_sessions
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, datetime], _Counts] = {}
        self._flushing: asyncio.Task[None] | None = None
        #: Per key: [second, tokens] of its calls' ends within the window, oldest first.
        self._recent: dict[str, deque[list[int]]] = {}

    def record(self, token_id: str, service_id: str, usage: tuple[int, int] | None) -> None:
        """One call's end on the event loop: its tokens (None: the engine counted none)."""
        minute = self._clock.now().replace(second=0, microsecond=0)
        with self._lock:
            counts = self._counts.setdefault((token_id, service_id, minute), _Counts())
            counts.requests += 1
            if usage is not None:
                counts.prompt += usage[0]
                counts.completion += usage[1]
                self._spend(token_id, usage[0] + usage[1])
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush_soon())

    def wait_for(self, token_id: str, limit: int) -> int | None:
        """Whole seconds until the key's calls of the last minute used fewer than `limit`
        tokens (None: they already do)."""
        now = math.floor(self._clock.monotonic())
        with self._lock:
            seconds = self._recent.get(token_id)
            if seconds is None:
                return None
            self._forget(token_id, seconds, now)
            spent = sum(tokens for _, tokens in seconds)
            if spent < limit:
                return None
            for second, tokens in seconds:
                spent -= tokens
                if spent < limit:
                    return max(1, second + WINDOW_SECONDS - now)
        return WINDOW_SECONDS  # not reached: with every second gone, 0 tokens are spent

    def _spend(self, token_id: str, tokens: int) -> None:
        """Under the lock."""
        now = math.floor(self._clock.monotonic())
        seconds = self._recent.setdefault(token_id, deque())
        if seconds and seconds[-1][0] == now:
            seconds[-1][1] += tokens
        else:
            seconds.append([now, tokens])
        self._forget(token_id, seconds, now)

    def _forget(self, token_id: str, seconds: deque[list[int]], now: int) -> None:
        """Under the lock: the seconds that left the window go (and the key, with its last)."""
        while seconds and seconds[0][0] <= now - WINDOW_SECONDS:
            seconds.popleft()
        if not seconds:
            del self._recent[token_id]

    async def _flush_soon(self) -> None:
        await asyncio.sleep(FLUSH_SECONDS)
        try:
            await asyncio.to_thread(self.flush)
        except Exception as exc:  # noqa: BLE001 - kept for the next write
            log.warning("could not record the OpenAI calls' usage: %s", type(exc).__name__)

    def flush(self) -> int:
        """Write what was counted since the last write (blocking); the rows written. On a
        failure the counts are kept for the next write."""
        with self._lock:
            counts, self._counts = self._counts, {}
            now = math.floor(self._clock.monotonic())
            for token_id, seconds in list(self._recent.items()):
                self._forget(token_id, seconds, now)
        if not counts:
            return 0
        try:
            with self._write_sessions() as session, session.begin():
                for (token_id, service_id, minute), count in counts.items():
                    insert = dialect_insert(session, LlmUsage).values(
                        token_id=token_id,
                        service_id=service_id,
                        minute=minute,
                        requests=count.requests,
                        prompt_tokens=count.prompt,
                        completion_tokens=count.completion,
                    )
                    excluded = insert.excluded
                    session.execute(
                        insert.on_conflict_do_update(
                            index_elements=["token_id", "service_id", "minute"],
                            set_={
                                "requests": LlmUsage.requests + excluded.requests,
                                "prompt_tokens": LlmUsage.prompt_tokens + excluded.prompt_tokens,
                                "completion_tokens": LlmUsage.completion_tokens
                                + excluded.completion_tokens,
                            },
                        )
                    )
        except Exception:
            with self._lock:
                for key, count in counts.items():
                    kept = self._counts.setdefault(key, _Counts())
                    kept.requests += count.requests
                    kept.prompt += count.prompt
                    kept.completion += count.completion
            raise
        return len(counts)


def reported_usage(value: object) -> tuple[int, int] | None:
    """The front's `done` report's `usage` (`[prompt, completion]`), or None."""
    if isinstance(value, list) and len(value) == 2 and all(isinstance(n, int) for n in value):
        return int(value[0]), int(value[1])
    return None


def reported_timing(value: object) -> tuple[float, float] | None:
    """The front's `done` report's `timing` (`[to_first, first_to_last]` seconds), or None."""
    if isinstance(value, list) and len(value) == 2:
        if all(isinstance(n, int | float) and 0 <= n < 86_400 for n in value):
            return float(value[0]), float(value[1])
    return None


def usage_of(
    session: Session, service_id: str, since: datetime, until: datetime
) -> list[dict[str, object]]:
    """The service's calls from `since` to `until` (whole minutes: a minute's row counts when
    the minute starts within the window), one entry per token, most tokens first."""
    start = since.replace(second=0, microsecond=0)
    rows = session.execute(
        select(
            LlmUsage.token_id,
            ServiceAccessToken.name,
            ServiceAccessToken.hint,
            func.sum(LlmUsage.requests),
            func.sum(LlmUsage.prompt_tokens),
            func.sum(LlmUsage.completion_tokens),
        )
        .join(ServiceAccessToken, ServiceAccessToken.id == LlmUsage.token_id)
        .where(
            LlmUsage.service_id == service_id,
            LlmUsage.minute >= start,
            LlmUsage.minute < until + timedelta(microseconds=1),
        )
        .group_by(LlmUsage.token_id, ServiceAccessToken.name, ServiceAccessToken.hint)
    ).all()
    rows = sorted(rows, key=lambda row: -(int(row[4] or 0) + int(row[5] or 0)))
    return [
        {
            "token_id": token_id,
            "name": name,
            "hint": hint,
            "requests": int(requests or 0),
            "prompt_tokens": int(prompt or 0),
            "completion_tokens": int(completion or 0),
        }
        for token_id, name, hint, requests, prompt, completion in rows
    ]
