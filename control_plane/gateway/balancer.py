"""Which replica a request gets, and how many requests a service takes at once.

- `Balancer.choose`: among the replicas in rotation (`routing.RoutingTable.rotation`), the one
  with the fewest requests outstanding in this process; ties go round-robin, so equal replicas
  share a steady trickle evenly. The counts are per process: with several control-plane
  replicas each balances its own share.
- `Admission`: a service takes at most `limit` requests at once in this process; the next
  `queue` wait in arrival order for at most `wait` seconds each; more, or a wait run out, is
  refused (`Refused`), so a flood on one service never holds the gateway's memory.

All of it runs on the event loop: no locks.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict, deque
from collections.abc import Sequence

from control_plane.gateway.routing import ReplicaTarget


class Balancer:
    """Least outstanding requests, ties round-robin."""

    def __init__(self) -> None:
        self.outstanding: dict[str, int] = defaultdict(int)
        self._turn = itertools.count()

    def choose(
        self, replicas: Sequence[ReplicaTarget], *, exclude: frozenset[str] = frozenset()
    ) -> ReplicaTarget | None:
        candidates = [r for r in replicas if r.id not in exclude]
        if not candidates:
            return None
        fewest = min(self.outstanding.get(r.id, 0) for r in candidates)
        tied = [r for r in candidates if self.outstanding.get(r.id, 0) == fewest]
        return tied[next(self._turn) % len(tied)]

    def started(self, replica_id: str) -> None:
        self.outstanding[replica_id] += 1

    def ended(self, replica_id: str) -> None:
        left = self.outstanding[replica_id] - 1
        if left > 0:
            self.outstanding[replica_id] = left
        else:
            del self.outstanding[replica_id]


class Refused(Exception):
    """The service's queue was full (`full`), or the request's wait ran out."""

    def __init__(self, *, full: bool) -> None:
        super().__init__("queue full" if full else "wait ran out")
        self.full = full


class _ServiceGate:
    __slots__ = ("running", "waiting")

    def __init__(self) -> None:
        self.running = 0
        self.waiting: deque[asyncio.Future[None]] = deque()


class Admission:
    """Per service: `limit` at once, `queue` more waiting at most `wait` seconds."""

    def __init__(self, *, limit: int, queue: int, wait: float) -> None:
        self.limit, self.queue, self.wait = limit, queue, wait
        self._gates: dict[str, _ServiceGate] = {}
        #: Requests of each service carried elsewhere in this process (the native front's fast
        #: path, as it last reported): they count against `limit` too.
        self.held: dict[str, int] = {}

    def queued(self, service: str) -> int:
        gate = self._gates.get(service)
        return 0 if gate is None else len(gate.waiting)

    def running(self, service: str) -> int:
        gate = self._gates.get(service)
        return 0 if gate is None else gate.running

    async def enter(self, service: str) -> None:
        """Take a place for one request of `service` (waiting if need be); raises `Refused`."""
        gate = self._gates.setdefault(service, _ServiceGate())
        if gate.running + self.held.get(service, 0) < self.limit and not gate.waiting:
            gate.running += 1
            return
        if len(gate.waiting) >= self.queue:
            raise Refused(full=True)
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        gate.waiting.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.wait)
        except TimeoutError:
            if turn.done():  # given the place as the wait ran out: keep it
                return
            turn.cancel()
            gate.waiting.remove(turn)
            raise Refused(full=False) from None
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.leave(service)  # the place was given to a request that went away
            elif turn in gate.waiting:
                gate.waiting.remove(turn)
            raise

    def leave(self, service: str) -> None:
        """Give back a place `enter` took: the next waiting request gets it."""
        gate = self._gates[service]
        while gate.waiting:
            turn = gate.waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # `running` passes on unchanged
                return
        gate.running -= 1
        if gate.running == 0:
            del self._gates[service]
