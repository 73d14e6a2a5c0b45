"""Autoscaling and scale to zero (issue 27): a service's `replicas` follows the requests in flight
to it at the gateway, within its `autoscale: {min, max, target_in_flight, idle_seconds,
scale_down_seconds}`.

- `Traffic` is what the gateway of this process reports, in memory: the requests of each service
  in flight (queued ones included) and the time of its last one. The autoscale loop reads it
  about once a second (`apply`), writes `Service.last_request_at` from it (so the gateway never
  writes per request) and this process's requests in flight to each autoscaled service into
  `gateway_traffic`, then sizes each service from the sum of every process's row written within
  `SHARED_FRESH_SECONDS`: with several control-plane processes behind a load balancer, each
  sees every request, not its own share (a process gone stops counting once its rows age).
- `decide` is the rule: `ceil(in_flight / target_in_flight)` clamped to `[min, max]`; more
  replicas at once; fewer only once the wish has stayed below the current count for the whole
  `scale_down_seconds` (then to the most it wished in that window: slowly, never below `min`);
  zero only after `idle_seconds` without a request.
- `wake` is the gateway's call for a service that has no warm replica: it asks for one at once.

Scaling itself is `rollout.scale`: new replicas `pending` at the service's revision, extra ones
drained (the gateway stops sending them requests) before they stop. Every change is an
`autoscale` event on the service. No decision is taken while a rollout runs.
"""

from __future__ import annotations

import math
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.models import GatewayTraffic, Service
from control_plane.services import rollout
from control_plane.services._changes import record_event

#: How long a wish to scale down must hold before it is acted on, unless the service says.
DEFAULT_SCALE_DOWN_SECONDS = 60.0
#: A process's requests in flight count while its row is younger than this (its loop writes it
#: about every second); rows older than `_SHARED_KEPT_SECONDS` are deleted by any process.
SHARED_FRESH_SECONDS = 5.0
_SHARED_KEPT_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Load:
    """One service's requests at this process's gateway."""

    in_flight: int
    last_request_at: datetime | None


class Traffic:
    """The gateway's requests per service, in this process (held on `AppContext`): `began` when
    a request for a service is admitted to wait or run, `ended` when it is answered."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # the loop reads it from a worker thread
        self._in_flight: dict[str, int] = {}
        self._last: dict[str, datetime] = {}

    def began(self, service_id: str) -> None:
        self.add(service_id, 1, requested=True)

    def ended(self, service_id: str) -> None:
        self.add(service_id, -1, requested=False)

    def add(self, service_id: str, in_flight: int, *, requested: bool) -> None:
        """`in_flight` more requests (fewer when negative), and a request just now when
        `requested`: one at a time from the Python gateway (`began`, `ended`), in batches from
        the native front's reports."""
        now = self._clock.now()
        with self._lock:
            left = self._in_flight.get(service_id, 0) + in_flight
            if left > 0:
                self._in_flight[service_id] = left
            else:
                self._in_flight.pop(service_id, None)
            if requested:
                self._last[service_id] = now

    def loads(self) -> dict[str, Load]:
        with self._lock:
            ids = set(self._in_flight) | set(self._last)
            return {i: Load(self._in_flight.get(i, 0), self._last.get(i)) for i in ids}


@dataclass
class _Wish:
    """Since when a service has wished for fewer replicas, and the most it wished since."""

    since: float
    peak: int


@dataclass
class Autoscaler:
    """The scale-down windows of this process (`decide`'s memory between rounds)."""

    clock: Clock
    wishes: dict[str, _Wish] = field(default_factory=dict)
    #: This process's name in `gateway_traffic` (a fresh one each start).
    process: str = field(default_factory=lambda: "cp-" + secrets.token_hex(8))
    #: Whether this process has rows there (else a round with nothing in flight writes nothing).
    shared: bool = False

    def decide(
        self,
        *,
        service_id: str,
        current: int,
        in_flight: int,
        settings: Mapping[str, Any],
        idle_for: float,
    ) -> int:
        """The replicas `service_id` should run now (`current` when nothing changes)."""
        lowest, highest = int(settings["min"]), int(settings["max"])
        want = math.ceil(in_flight / float(settings["target_in_flight"]))
        want = max(lowest, min(highest, want))
        if want == 0 and idle_for < float(settings["idle_seconds"]):
            want = min(1, highest)  # not idle long enough for zero
        if want >= current:
            self.wishes.pop(service_id, None)
            return want
        if want == 0:
            self.wishes.pop(service_id, None)
            return 0  # idle for `idle_seconds`: down to zero at once
        now = self.clock.monotonic()
        wish = self.wishes.get(service_id)
        if wish is None:
            self.wishes[service_id] = _Wish(now, want)
            return current
        wish.peak = max(wish.peak, want)
        window = float(settings.get("scale_down_seconds", DEFAULT_SCALE_DOWN_SECONDS))
        if now - wish.since < window:
            return current
        del self.wishes[service_id]
        return wish.peak


def apply(
    *, session_factory: Any, clock: Clock, autoscaler: Autoscaler, loads: Mapping[str, Load]
) -> int:
    """One round: write each service's last request time from `loads` and size every autoscaled
    service (one transaction per service that changes); returns how many were resized."""
    with session_factory() as session:
        rows = session.execute(
            select(Service.id, Service.replicas, Service.autoscale, Service.last_request_at).where(
                Service.state != "stopped", Service.autoscale.is_not(None)
            )
        ).all()
    resized = 0
    now = clock.now()
    scaled = {row[0] for row in rows if row[2]}  # a JSON null: autoscaling turned off
    if not scaled and not autoscaler.shared:
        return 0
    own = {i: load.in_flight for i, load in loads.items() if i in scaled and load.in_flight > 0}
    with session_factory.begin() as session:
        everyone = share(session, autoscaler, own, now)
    for service_id, current, settings, last_stored in rows:
        if service_id not in scaled:
            continue
        load = loads.get(service_id, Load(0, None))
        load = Load(everyone.get(service_id, 0), load.last_request_at)
        last = _latest(last_stored, load.last_request_at)
        idle_for = float("inf") if last is None else (now - last).total_seconds()
        want = autoscaler.decide(
            service_id=service_id,
            current=current,
            in_flight=load.in_flight,
            settings=settings,
            idle_for=idle_for,
        )
        if want == current and last == last_stored:
            continue
        with session_factory.begin() as session:
            resized += _resize(session, clock, service_id, want, load, last)
    return resized


def share(
    session: Session, autoscaler: Autoscaler, own: Mapping[str, int], now: datetime
) -> dict[str, int]:
    """Write this process's requests in flight (`own`, the nonzero ones) as its rows of
    `gateway_traffic` (nothing written when it had none and has none), and return every
    process's fresh ones summed by service."""
    mine = GatewayTraffic.process == autoscaler.process
    if own or autoscaler.shared:
        session.execute(delete(GatewayTraffic).where(mine))
        session.add_all(
            GatewayTraffic(process=autoscaler.process, service_id=i, in_flight=n, reported_at=now)
            for i, n in own.items()
        )
        # And what processes gone long ago left (ignored meanwhile: not fresh).
        old = GatewayTraffic.reported_at < now - timedelta(seconds=_SHARED_KEPT_SECONDS)
        session.execute(delete(GatewayTraffic).where(old))
        session.flush()
        autoscaler.shared = bool(own)
    fresh = now - timedelta(seconds=SHARED_FRESH_SECONDS)
    summed = session.execute(
        select(GatewayTraffic.service_id, func.sum(GatewayTraffic.in_flight))
        .where(GatewayTraffic.reported_at >= fresh)
        .group_by(GatewayTraffic.service_id)
    ).all()
    return {service_id: int(total) for service_id, total in summed}


def _resize(
    session: Session, clock: Clock, service_id: str, want: int, load: Load, last: datetime | None
) -> int:
    service = session.get(Service, service_id, with_for_update=True)
    if service is None or service.state == "stopped" or not service.autoscale:
        return 0
    service.last_request_at = _latest(service.last_request_at, last)
    if rollout.in_progress(service) or want == service.replicas:
        return 0
    now = clock.now()
    data: dict[str, Any] = {"from": service.replicas, "to": want, "in_flight": load.in_flight}
    if want == 0:
        data["reason"] = f"no request for {service.autoscale['idle_seconds']:g} s"
    record_event(session, service, now, "autoscale", data)
    rollout.scale(session, service, now, want)
    return 1


def wake(*, session: Session, clock: Clock, service_id: str) -> bool:
    """A request came for `service_id` and no replica of it is warm: ask for one at once (its
    `replicas` at least 1, counted as a request now, so it is not scaled down again before the
    request is served). Returns whether it asked for a replica."""
    service = session.get(Service, service_id, with_for_update=True)
    if service is None or service.state == "stopped" or not service.autoscale:
        return False
    now = clock.now()
    service.last_request_at = _latest(service.last_request_at, now)
    if service.replicas >= 1 or int(service.autoscale["max"]) < 1:
        return False
    record_event(
        session,
        service,
        now,
        "autoscale",
        {"from": service.replicas, "to": 1, "reason": "a request arrived at the gateway"},
    )
    rollout.scale(session, service, now, 1)
    return True


def _latest(a: datetime | None, b: datetime | None) -> datetime | None:
    if a is None or b is None:
        return a or b
    return max(a, b)
