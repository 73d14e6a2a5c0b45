"""Who may call a service through the gateway: its access tokens, checked with a short cache, and
each token's rate limit.

- A presented token's grant (`services.access_tokens.verify`) is cached by its SHA-256 digest for
  at most `ttl` seconds (1 s), so a request costs no query while a revoked token stops opening
  its service within that second. Wrong tokens are cached too (as no grant), so a client
  retrying one costs one read a second, not one per request.
- A token with a rate has a token bucket (`burst` requests, refilled at `rate_per_second`) in
  this process: with several control-plane replicas, each enforces the rate on its own share.
- A refusal is a `GatewayDenied`: 401 (no token, a wrong, revoked or another service's token,
  a node credential, the admin token: one message for all, so it tells a guesser nothing) or 429
  past the rate, in the Open Inference Protocol's error shape `{"error": "<message>"}`.

The raw token lives only for the call: never stored, logged or put in a message. Time is the
injected clock's (`monotonic` for the cache and the buckets), so tests drive it. The last use
of each token is gathered in memory and written in batches (`flush_last_used`), never on a
request's path.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.security import sha256_hex
from control_plane.services import access_tokens
from control_plane.services.access_tokens import Grant

log = logging.getLogger(__name__)

#: Seconds a verified (or refused) token is taken from memory before it is read again.
GRANT_TTL_SECONDS = 1.0
#: Tokens the cache holds at most; past this the expired ones go, then all.
MAX_CACHED = 10_000
#: Seconds between two writes of the tokens' last use.
LAST_USED_EVERY_SECONDS = 60.0

_MINT = "an administrator mints one with POST /api/v1/services/{id}/access-tokens"
UNAUTHORIZED = "unauthorized"
RATE_LIMITED = "rate_limited"


class GatewayDenied(Exception):
    """A gateway request refused before it reaches a replica. `cause` names it for the
    metrics (`unauthorized`, `rate_limited`); `body()` and `headers` are the answer's."""

    def __init__(
        self, status: int, cause: str, message: str, *, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.cause = cause
        self.message = message
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str]:
        if self.status == 401:
            return {"WWW-Authenticate": 'Bearer realm="modelforge"'}
        if self.retry_after is not None:
            return {"Retry-After": str(self.retry_after)}
        return {}

    def body(self) -> dict[str, str]:
        """The Open Inference Protocol's error shape."""
        return {"error": self.message}


def _missing() -> GatewayDenied:
    return GatewayDenied(
        401,
        UNAUTHORIZED,
        "This service needs an access token: send it as `Authorization: Bearer <token>` "
        f"({_MINT}).",
    )


def _not_valid() -> GatewayDenied:
    return GatewayDenied(
        401,
        UNAUTHORIZED,
        "The access token is not valid for this service (unknown, revoked, or another "
        f"service's). Use a token minted for this service; {_MINT}.",
    )


@dataclass(slots=True)
class _Cached:
    grant: Grant | None
    expires: float


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class GatewayAuth:
    """One per control-plane process (held with the gateway): the grant cache and the
    buckets. `read_sessions` opens a read-only session (the token check); `write_sessions`
    one that may write (the last-use batches)."""

    def __init__(
        self,
        *,
        read_sessions: Callable[[], Session],
        write_sessions: Callable[[], Session],
        clock: Clock,
        ttl: float = GRANT_TTL_SECONDS,
        max_cached: int = MAX_CACHED,
    ) -> None:
        self._read_sessions = read_sessions
        self._write_sessions = write_sessions
        self._clock = clock
        self.ttl = ttl
        self.max_cached = max_cached
        self._cache: dict[str, _Cached] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._last_used: dict[str, datetime] = {}
        self._flushed_at = clock.monotonic()
        self._flushing: asyncio.Task[int] | None = None
        self._lock = threading.Lock()

    def authorize(self, presented: str | None, service: str, kind: str = "") -> Grant:
        """The grant of the `Authorization` header's token for `service` (its id; a service's
        own token also by its name), a service of `kind`, or `GatewayDenied`. Blocking: a token
        not in the cache is read from the database."""
        return self._admit(self._look_up(_bearer(presented)), service, kind)

    async def holder_async(self, presented: str | None) -> Grant | None:
        """What the `Authorization` header's token opens, whichever service that is (None: no
        valid token): how the OpenAI API tells a model a valid key does not open (404) from
        a key that opens nothing (401). Takes nothing from the token's rate; the same cache."""
        try:
            token = _bearer(presented)
        except GatewayDenied:
            return None
        cached = self._fresh(sha256_hex(token))
        if cached is not None:
            return cached.grant
        return await asyncio.to_thread(self._look_up, token)

    def _look_up(self, token: str) -> Grant | None:
        digest = sha256_hex(token)
        cached = self._fresh(digest)
        if cached is None:
            # Counted from before the read: a revoke committed during it still ends in `ttl`.
            read_at = self._clock.monotonic()
            with self._read_sessions() as session:
                grant = access_tokens.verify(session, token)
            cached = self._remember(digest, grant, read_at)
        return cached.grant

    def standing(self, presented: str | None) -> float:
        """Seconds the remembered answer for this `Authorization` value still stands (0: none):
        how long another may act on a grant it was given (the native front's fast path), so
        that a revoked token stops there when it stops here."""
        cached = self._fresh(sha256_hex(_bearer(presented)))
        return 0.0 if cached is None else max(0.0, cached.expires - self._clock.monotonic())

    def authorize_cached(self, presented: str | None, service: str, kind: str = "") -> Grant | None:
        """As `authorize`, from memory only: None when the token must be read first (then call
        `authorize` off the event loop). Never blocks."""
        token = _bearer(presented)
        cached = self._fresh(sha256_hex(token))
        return None if cached is None else self._admit(cached.grant, service, kind)

    async def authorize_async(self, presented: str | None, service: str, kind: str = "") -> Grant:
        """`authorize` for the event loop: the database read, when one is needed, on a worker
        thread; and now and then the last uses written, beside the request."""
        grant = self.authorize_cached(presented, service, kind)
        if grant is None:
            grant = await asyncio.to_thread(self.authorize, presented, service, kind)
        self._maybe_flush()
        return grant

    def flush_last_used(self) -> int:
        """Write the last uses gathered since the previous write (blocking); the rows changed."""
        with self._lock:
            used, self._last_used = self._last_used, {}
            self._flushed_at = self._clock.monotonic()
        if not used:
            return 0
        try:
            with self._write_sessions() as session, session.begin():
                return access_tokens.record_use(session, used)
        except Exception:
            with self._lock:  # kept for the next batch (a newer use wins)
                for token_id, at in used.items():
                    if self._last_used.get(token_id, at) <= at:
                        self._last_used[token_id] = at
            raise

    # -- inside ---------------------------------------------------------------------------------

    def _fresh(self, digest: str) -> _Cached | None:
        cached = self._cache.get(digest)
        if cached is None or cached.expires <= self._clock.monotonic():
            return None
        return cached

    def _remember(self, digest: str, grant: Grant | None, read_at: float) -> _Cached:
        now = self._clock.monotonic()
        cached = _Cached(grant, read_at + self.ttl)
        with self._lock:
            if len(self._cache) >= self.max_cached:
                for key in [k for k, v in self._cache.items() if v.expires <= now]:
                    del self._cache[key]
                if len(self._cache) >= self.max_cached:
                    self._cache.clear()
            self._cache[digest] = cached
        return cached

    def _admit(self, grant: Grant | None, service: str, kind: str) -> Grant:
        if grant is None or not grant.opens(service, kind):
            raise _not_valid()
        if grant.rate_per_second is not None:
            self._take(grant, grant.rate_per_second, grant.burst or 1)
        with self._lock:
            self._last_used[grant.token_id] = self._clock.now()
        return grant

    def _take(self, grant: Grant, rate: float, burst: int) -> None:
        now = self._clock.monotonic()
        with self._lock:
            bucket = self._buckets.get(grant.token_id)
            if bucket is None:
                bucket = self._buckets[grant.token_id] = _Bucket(float(burst), now)
            bucket.tokens = min(float(burst), bucket.tokens + (now - bucket.updated) * rate)
            bucket.updated = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return
            wait = (1.0 - bucket.tokens) / rate
        raise GatewayDenied(
            429,
            RATE_LIMITED,
            f"This access token's rate limit is reached ({rate:g} requests per second, bursts "
            f"of {burst}). Retry after {math.ceil(wait)} s, or send fewer requests at once; an "
            "administrator can mint a token with a higher rate.",
            retry_after=max(1, math.ceil(wait)),
        )

    def _maybe_flush(self) -> None:
        if self._clock.monotonic() - self._flushed_at < LAST_USED_EVERY_SECONDS:
            return
        if self._flushing is not None and not self._flushing.done():
            return
        self._flushed_at = self._clock.monotonic()
        self._flushing = asyncio.get_running_loop().create_task(self._flush_beside())

    async def _flush_beside(self) -> int:
        try:
            return await asyncio.to_thread(self.flush_last_used)
        except Exception as exc:  # the next batch carries them again
            log.warning("could not record access tokens' last use: %s", type(exc).__name__)
            return 0


def _bearer(presented: str | None) -> str:
    scheme, _, token = (presented or "").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise _missing()
    return token
