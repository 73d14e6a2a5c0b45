"""The gateway's routing table: which replicas of which service take traffic, held in memory.

The table is read from the database (`read`: the services' deployed targets, and the last stored
heartbeat of each node they run on) at most every `interval` seconds, and only while requests
come: a request finds it in memory, never queries. A request that finds it older than `max_age`
(the first one, or after a quiet while) waits for one read; younger, it is served from what is
held while a read runs beside it. Liveness is judged per request, in memory, from the stored
heartbeat and those not yet flushed (`fleet.liveness.Liveness`), so a replica whose node turns
stale leaves the rotation at once, not at the next read. A request is never refused from a copy
older than itself: what the API said of a service (healthy) may be newer than the table held,
so before a refusal the gateway asks for a read begun after the request (`routed`).

It never decides who may call a service (`auth.py`) nor which replica a request gets
(`balancer.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.models import ModelAlias, Node, Service, ServiceReplica
from control_plane.services.schemas import LLM_RUNNERS

log = logging.getLogger(__name__)

#: Replica states the gateway sends requests to (a draining replica finishes what it holds).
_SERVING = "healthy"


@dataclass(frozen=True, slots=True)
class ReplicaTarget:
    """One replica as the gateway sees it."""

    id: str
    node_id: str | None
    state: str
    ready_at: datetime | None
    revision: int = 1
    draining: bool = False

    @property
    def warm(self) -> bool:
        """Healthy, ready once (its model loaded), and not draining."""
        return (
            self.state == _SERVING
            and self.ready_at is not None
            and not self.draining
            and self.node_id is not None
        )


@dataclass(frozen=True, slots=True)
class ServiceTarget:
    """A deployed service: what the gateway needs to route to it."""

    id: str
    name: str
    #: `onnx` (the Open Inference Protocol at /v2), `llm` (an LLM runner's engine: the OpenAI
    #: API at /v1) or `command` (at /services/{name}/...); every one also at /services/{name}/.
    kind: str
    #: The model's name on the replicas' own servers (`/v2/models/{model_name}`).
    model_name: str
    state: str
    replicas: tuple[ReplicaTarget, ...] = ()
    autoscale: dict[str, Any] | None = None
    #: An `llm` service's most `max_tokens` a request may ask for (None: up to its context).
    max_tokens: int | None = None

    @property
    def scales_from_zero(self) -> bool:
        return bool(self.autoscale) and int((self.autoscale or {}).get("min", 1)) == 0


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    """What one read gave: the services by name, each node's stored last heartbeat, and the LLM
    services' aliases (alias -> the service's name)."""

    services: dict[str, ServiceTarget] = field(default_factory=dict)
    heartbeats: dict[str, datetime | None] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def named(self, name: str, *, alias: bool = False) -> ServiceTarget | None:
        """The service `name` names (with `alias`, also the LLM service it is an alias of)."""
        found = self.services.get(name)
        if found is None and alias:
            found = self.services.get(self.aliases.get(name, ""))
        return found


#: Reads a snapshot (blocking: it runs on a worker thread).
SnapshotReader = Callable[[], RoutingSnapshot]
#: Judges a node's liveness state from its id and stored heartbeat (`Liveness.state_of`).
NodeState = Callable[[str, "datetime | None", datetime], str]


def snapshot_of(
    services: Iterable[ServiceTarget],
    heartbeats: dict[str, datetime | None],
    aliases: dict[str, str] | None = None,
) -> RoutingSnapshot:
    return RoutingSnapshot(
        {service.name: service for service in services}, heartbeats, aliases or {}
    )


def read_snapshot(session: Session) -> RoutingSnapshot:
    """Every deployed service with its replicas, the stored heartbeat of their nodes, and the
    aliases: three queries, whatever the number of services."""
    rows = session.execute(
        select(
            Service.id,
            Service.name,
            Service.state,
            Service.command,
            Service.runner,
            Service.autoscale,
            Service.params,
            ServiceReplica.id,
            ServiceReplica.node_id,
            ServiceReplica.state,
            ServiceReplica.ready_at,
            ServiceReplica.revision,
        )
        .outerjoin(ServiceReplica, ServiceReplica.service_id == Service.id)
        .where(Service.state != "stopped")
        .order_by(Service.id, ServiceReplica.ordinal)
    ).all()
    heads: dict[str, tuple[Any, ...]] = {}
    replicas: dict[str, list[ReplicaTarget]] = {}
    for sid, name, state, command, runner, autoscale, params, rid, node, rstate, ready, rev in rows:
        heads.setdefault(sid, (name, state, command, runner, autoscale, params))
        group = replicas.setdefault(sid, [])
        if rid is not None:
            draining = rstate == "draining"
            group.append(ReplicaTarget(rid, node, rstate, ready, rev or 1, draining))
    services = []
    for sid, (name, state, command, runner, autoscale, params) in heads.items():
        kind = "command" if command is not None and runner is None else "onnx"
        max_tokens = None
        if runner in LLM_RUNNERS:
            kind = "llm"
            max_tokens = ((params or {}).get("llm") or {}).get("max_tokens")
        services.append(
            ServiceTarget(sid, name, kind, name, state, tuple(replicas[sid]), autoscale, max_tokens)
        )
    nodes = {r.node_id for group in replicas.values() for r in group if r.node_id is not None}
    heartbeats: dict[str, datetime | None] = {}
    if nodes:
        found = session.execute(
            select(Node.id, Node.last_heartbeat_at).where(Node.id.in_(sorted(nodes)))
        ).all()
        heartbeats = {node_id: at for node_id, at in found}
    names = {service.id: service.name for service in services}
    held = {
        alias: names[service_id]
        for alias, service_id in session.execute(select(ModelAlias.alias, ModelAlias.service_id))
        if service_id in names
    }
    return snapshot_of(services, heartbeats, held)


class RoutingTable:
    """The snapshot in memory, refreshed while requests come (see the module's docstring)."""

    def __init__(
        self,
        *,
        read: SnapshotReader,
        node_state: NodeState,
        clock: Clock,
        interval: float = 0.25,
        max_age: float = 2.0,
    ) -> None:
        self._read = read
        self._node_state = node_state
        self._clock = clock
        self.interval = interval
        self.max_age = max_age
        self._snapshot: RoutingSnapshot | None = None
        self._read_at = float("-inf")
        #: Reads begun so far, and the number of the one the snapshot held came from.
        self._begun = 0
        self._held_from = 0
        self._reading: asyncio.Task[None] | None = None
        #: The last read failed (logged once until one succeeds).
        self._failing = False
        #: Set each time a read lands (a request held for a cold service waits on it).
        self._landed = asyncio.Event()

    @property
    def age(self) -> float:
        return self._clock.monotonic() - self._read_at

    def ready(self) -> bool:
        """Whether the table was read within `max_age` (the gateway's own readiness)."""
        return self._snapshot is not None and self.age <= self.max_age

    async def current(self) -> RoutingSnapshot:
        """The snapshot, read first when there is none younger than `max_age`."""
        age = self.age
        if self._snapshot is not None and age <= self.max_age:
            if age > self.interval:
                self._start_read()
            return self._snapshot
        await self.refresh()
        assert self._snapshot is not None  # noqa: S101 - `refresh` raised otherwise
        return self._snapshot

    async def routed(
        self, snapshot: RoutingSnapshot, service: ServiceTarget, *, confirm: bool
    ) -> tuple[RoutingSnapshot, ServiceTarget, list[ReplicaTarget]]:
        """The table as it is now (`current`), the service in it and its rotation; with
        `confirm`, an empty rotation is looked at again in a read begun after this call, so a
        refusal never comes from a copy older than the request (the API may have called the
        service healthy since; such reads are shared by every request waiting for one). What
        was read before stands when the database cannot be read now."""
        begun = self._begun
        for again in (False, True) if confirm else (False,):
            try:
                snapshot = await (self._since(begun) if again else self.current())
            except Exception:  # noqa: BLE001 - the database: logged once by the read
                break
            service = snapshot.services.get(service.name, service)
            if self.rotation(snapshot, service):
                break
        return snapshot, service, self.rotation(snapshot, service)

    async def _since(self, begun: int) -> RoutingSnapshot:
        """The snapshot of a read begun after `begun` reads had (waiting for one)."""
        while self._snapshot is None or self._held_from <= begun:
            await self.refresh()
        return self._snapshot

    async def refresh(self) -> None:
        """Read now (joining a read already running); raises what the read raised."""
        task = self._start_read()
        await asyncio.shield(task)

    async def next_read(self, timeout: float) -> None:
        """Wait for the next read to land (starting one), at most `timeout` seconds."""
        self._start_read()
        landed = self._landed
        try:
            await asyncio.wait_for(landed.wait(), timeout)
        except TimeoutError:
            return

    def _start_read(self) -> asyncio.Task[None]:
        if self._reading is None or self._reading.done():
            self._begun += 1
            self._reading = asyncio.get_running_loop().create_task(self._read_once(self._begun))
            # A read started beside a request that was served from memory has nobody awaiting
            # it: its failure (the database away) is logged by `_read_once`, and taken here.
            self._reading.add_done_callback(_taken)
        return self._reading

    async def _read_once(self, number: int) -> None:
        started = self._clock.monotonic()
        try:
            snapshot = await asyncio.to_thread(self._read)
        except Exception as exc:
            # Once per outage, and quietly: the database's watcher logs the outage itself, and
            # the native front's routes read the table ten times a second.
            if not self._failing:
                self._failing = True
                log.info("the gateway cannot read its routing table: %s", type(exc).__name__)
            raise
        if self._failing:
            self._failing = False
            log.info("the gateway reads its routing table again")
        self._snapshot, self._read_at, self._held_from = snapshot, started, number
        landed, self._landed = self._landed, asyncio.Event()
        landed.set()

    def set(self, snapshot: RoutingSnapshot) -> None:
        """Hold `snapshot` as if just read (a read that lands later replaces it)."""
        self._begun += 1
        self._snapshot, self._read_at = snapshot, self._clock.monotonic()
        self._held_from = self._begun
        landed, self._landed = self._landed, asyncio.Event()
        landed.set()

    def live(self, snapshot: RoutingSnapshot, replica: ReplicaTarget) -> bool:
        """Whether the replica's node is online now (in memory: the stored heartbeat and the
        ones not yet flushed)."""
        node_id = replica.node_id
        if node_id is None:
            return False
        stored = snapshot.heartbeats.get(node_id)
        return self._node_state(node_id, stored, self._clock.now()) == "online"

    def rotation(self, snapshot: RoutingSnapshot, service: ServiceTarget) -> list[ReplicaTarget]:
        """The replicas that take requests now: warm, on an online node."""
        return [r for r in service.replicas if r.warm and self.live(snapshot, r)]


def _taken(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()
