"""Prometheus metrics (OB-1), served by `GET /metrics` in the text exposition format.

Every app owns its own `CollectorRegistry` (`Metrics.registry`), never the library's global one:
a process may build several apps (tests, replicas side by side), and each counts only its own.

Two kinds of value:

- counted as things happen, in memory, per process: placements and their dispatch latency
  (`observe_placements`, called by the scheduler), heartbeats accepted (`accept_heartbeat`) and
  job outcomes. An outcome is counted only once its transaction commits: the job service calls
  `job_finished(session, …)`, and `Metrics.attach(session_factory)` counts it after the commit
  and forgets it after a rollback — the pattern of `dispatch.jobs_changed`.
- read at scrape time from the database (`_StoreCollector`): nodes by liveness state, jobs by
  state, services by state, each deployed service's state and restarts, artifact store bytes,
  each GPU's health state, each LLM service's engines' own requests processing and waiting
  (as the nodes read them from the engines); one short read-only session of a few queries a
  scrape.

This module never holds or prints a token; authentication is the router's (`api/metrics.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import NamedTuple, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock
from control_plane.models import Artifact, GpuHealth, Job, Node, Service, ServiceReplica

#: The Prometheus text format (0.0.4), as the library writes it with `generate_latest`.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
#: Seconds; from 1 ms to 10 s, finer where the target lies (claims answered within 250 ms).
DISPATCH_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: A job's error code comes from the node (and the job's own code may choose it): past this many
#: distinct codes in one process, further new ones are counted as `OTHER`, so a misbehaving
#: node or job cannot grow the number of series without bound.
MAX_ERROR_CODES = 100
OTHER_CODE = "OTHER"
#: The liveness states (the fleet's `NodeState`) as label values; this floor module imports no
#: domain.
NODE_STATES: tuple[str, ...] = ("online", "stale", "offline")
#: The job states counted at scrape time; finished jobs are counted as outcomes instead.
ACTIVE_JOB_STATES = ("queued", "running")
#: The service states counted at scrape time (WL-5a); undeployed (`stopped`) ones are not.
SERVICE_STATES = (
    "pending",
    "starting",
    "healthy",
    "degraded",
    "unhealthy",
    "restarting",
    "failed",
    "idle",
)
#: A GPU's health states (issue 28: the fleet's `gpu_health.STATES`); this floor module imports
#: no domain.
GPU_STATES = ("healthy", "degraded", "unhealthy", "quarantined")
#: `Session.info` key: the outcomes `job_finished` registered, counted once the session commits.
_OUTCOMES = "modelforge.job_outcomes"


def job_finished(session: Session, *, state: str, code: str | None) -> None:
    """Count a job's outcome (`succeeded`, `failed`, `cancelled`, with its error code; none for
    a success) once `session` commits; a rolled-back outcome is never counted."""
    session.info.setdefault(_OUTCOMES, []).append((state, code or ""))


class NodeStates(Protocol):
    """How the scrape judges a node's liveness state: the fleet's one liveness reader
    (`fleet.liveness.Liveness`), handed in by the app factory, since this floor module imports
    no domain."""

    def state_of(self, node_id: str, stored: datetime | None, now: datetime) -> str: ...


class Metrics:
    """The control plane's instruments and its registry; one per app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.placements = Counter(
            "modelforge_placements",
            "Jobs placed on a node (claims answered with a job).",
            registry=self.registry,
        )
        self.dispatch_latency = Histogram(
            "modelforge_dispatch_latency_seconds",
            "Seconds from a fitting job being queued, or the claim starting if later, to the "
            "claim being answered with it.",
            buckets=DISPATCH_LATENCY_BUCKETS,
            registry=self.registry,
        )
        #: Incremented by `accept_heartbeat` on the hot path: one `inc()` a heartbeat.
        self.heartbeats_accepted = Counter(
            "modelforge_heartbeats_accepted",
            "Heartbeats accepted from node agents (by the fast path or the route).",
            registry=self.registry,
        )
        self.jobs_finished = Counter(
            "modelforge_jobs_finished",
            "Jobs that ended, by final state and error code (empty for a success; at most "
            f"{MAX_ERROR_CODES} codes, then {OTHER_CODE}).",
            ["state", "code"],
            registry=self.registry,
        )
        self._codes: set[str] = set()
        self._codes_lock = threading.Lock()

    def observe_placements(self, latencies: Sequence[float]) -> None:
        """Count a committed batch of placements: one latency per placed job, in seconds from
        "fitting job queued or claim started, whichever is later" to "claim answered"."""
        if not latencies:
            return
        self.placements.inc(len(latencies))
        for latency in latencies:
            # Clocks of two replicas may disagree by a little; a placement is never negative.
            self.dispatch_latency.observe(max(0.0, latency))

    def attach(self, session_factory: sessionmaker[Session]) -> None:
        """Count the outcomes `job_finished` registers on sessions of `session_factory`."""
        event.listen(session_factory, "after_commit", self._after_commit)
        event.listen(session_factory, "after_rollback", _forget)

    def read_store(
        self, *, session_factory: sessionmaker[Session], liveness: NodeStates, clock: Clock
    ) -> None:
        """Add the values read from the database at each scrape."""
        self.registry.register(_StoreCollector(session_factory, liveness, clock))

    def render(self) -> bytes:
        """Everything, in the Prometheus text format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def _after_commit(self, session: Session) -> None:
        for state, code in session.info.pop(_OUTCOMES, ()):
            self.jobs_finished.labels(state=state, code=self._code_label(code)).inc()

    def _code_label(self, code: str) -> str:
        with self._codes_lock:
            if code in self._codes:
                return code
            if len(self._codes) >= MAX_ERROR_CODES:
                return OTHER_CODE
            self._codes.add(code)
            return code


class _ServiceSample(NamedTuple):
    id: str
    name: str
    state: str
    restarts: int
    #: An LLM service's engines' own requests (processing, waiting), its replicas' summed as
    #: their nodes last reported them; None when none reported one.
    engine: tuple[int, int] | None = None


class _GpuSample(NamedTuple):
    node_id: str
    uuid: str
    state: str


class _StoreReading(NamedTuple):
    nodes: dict[str, int]
    needs_upgrade: int
    jobs: dict[str, int]
    artifact_bytes: int
    services: list[_ServiceSample]
    gpus: list[_GpuSample]


def _forget(session: Session) -> None:
    session.info.pop(_OUTCOMES, None)


class _StoreCollector:
    """Values that live in the database, read when Prometheus scrapes (never cached: every
    replica reports the same fleet). A database outage propagates: the scrape is answered 503
    `DATABASE_UNAVAILABLE`, as `/api/v1/health` is."""

    def __init__(
        self, session_factory: sessionmaker[Session], liveness: NodeStates, clock: Clock
    ) -> None:
        self._session_factory = session_factory
        self._liveness = liveness
        self._clock = clock

    def describe(self) -> Iterable[Metric]:
        return _families()

    def collect(self) -> Iterable[Metric]:
        reading = self._read()
        families = _families()
        (
            by_state,
            upgrade,
            by_job_state,
            store,
            by_service_state,
            service_state,
            restarts,
            gpu_health,
            engine_requests,
        ) = families
        for state in NODE_STATES:
            by_state.add_metric([state], reading.nodes[state])
        upgrade.add_metric([], reading.needs_upgrade)
        for job_state in ACTIVE_JOB_STATES:
            by_job_state.add_metric([job_state], reading.jobs.get(job_state, 0))
        store.add_metric([], reading.artifact_bytes)
        counted = dict.fromkeys(SERVICE_STATES, 0)
        for service in reading.services:
            counted[service.state] = counted.get(service.state, 0) + 1
            # Every state, 1 for the one it is in: an alert on `== 0` for `healthy` works
            # without knowing which other state a service went to.
            for one in SERVICE_STATES:
                service_state.add_metric(
                    [service.name, service.id, one], float(service.state == one)
                )
            restarts.add_metric([service.name, service.id], service.restarts)
            if service.engine is not None:
                processing, waiting = service.engine
                engine_requests.add_metric([service.name, service.id, "processing"], processing)
                engine_requests.add_metric([service.name, service.id, "waiting"], waiting)
        for service_state_name in SERVICE_STATES:
            by_service_state.add_metric([service_state_name], counted[service_state_name])
        for gpu in reading.gpus:
            for one in GPU_STATES:
                gpu_health.add_metric([gpu.node_id, gpu.uuid, one], float(gpu.state == one))
        return families

    def _read(self) -> _StoreReading:
        nodes: dict[str, int] = dict.fromkeys(NODE_STATES, 0)
        needs_upgrade = 0
        #: Every GPU of every node's inventory (healthy without a row), and any reported one
        #: its inventory does not list yet.
        gpus: dict[tuple[str, str], str] = {}
        # One short transaction, never committed: it changes nothing.
        with self._session_factory() as session:
            now = self._clock.now()
            # Liveness merges heartbeats not flushed yet, so it is judged here per node by the
            # one liveness reader, from one query of two narrow columns.
            for node_id, stored, flagged, inventory in session.execute(
                select(
                    Node.id, Node.last_heartbeat_at, Node.compat_code.is_not(None), Node.inventory
                )
            ):
                nodes[self._liveness.state_of(node_id, stored, now)] += 1
                needs_upgrade += bool(flagged)
                for gpu in (inventory or {}).get("gpus") or []:
                    if isinstance(gpu, dict) and gpu.get("uuid"):
                        gpus[(node_id, str(gpu["uuid"]))] = "healthy"
            for node_id, uuid, gpu_state in session.execute(
                select(GpuHealth.node_id, GpuHealth.uuid, GpuHealth.state)
            ):
                gpus[(node_id, uuid)] = gpu_state
            jobs = {
                state: int(count)
                for state, count in session.execute(
                    select(Job.state, func.count())
                    .where(Job.state.in_(ACTIVE_JOB_STATES))
                    .group_by(Job.state)
                )
            }
            artifact_bytes = session.execute(
                select(func.coalesce(func.sum(Artifact.size_bytes), 0))
            ).scalar_one()
            engines: dict[str, tuple[int, int]] = {}
            for service_id, load in session.execute(
                select(ServiceReplica.service_id, ServiceReplica.engine).where(
                    ServiceReplica.state != "stopped"
                )
            ):
                if isinstance(load, dict):
                    had = engines.get(service_id, (0, 0))
                    engines[service_id] = (
                        had[0] + int(load.get("processing", 0)),
                        had[1] + int(load.get("waiting", 0)),
                    )
            services = [
                _ServiceSample(service_id, name, state, int(restarts or 0), engines.get(service_id))
                for service_id, name, state, restarts in session.execute(
                    select(Service.id, Service.name, Service.state, Service.restarts)
                    .where(Service.state != "stopped")
                    .order_by(Service.name, Service.id)
                )
            ]
        return _StoreReading(
            nodes,
            needs_upgrade,
            jobs,
            int(artifact_bytes),
            services,
            [_GpuSample(node_id, uuid, state) for (node_id, uuid), state in sorted(gpus.items())],
        )


def _families() -> list[GaugeMetricFamily]:
    """The store's families, without samples (`describe`) or to be filled (`collect`)."""
    return [
        GaugeMetricFamily(
            "modelforge_nodes",
            "Enrolled nodes by liveness state (online, stale, offline), as the node views show.",
            labels=["state"],
        ),
        GaugeMetricFamily(
            "modelforge_nodes_needs_upgrade",
            "Nodes flagged Needs upgrade: their agent or runtime worker speaks a protocol this "
            "control plane does not accept.",
        ),
        GaugeMetricFamily(
            "modelforge_jobs",
            "Jobs waiting for a node (queued) or running.",
            labels=["state"],
        ),
        GaugeMetricFamily(
            "modelforge_artifact_store_bytes",
            "Bytes of the artifacts in the artifact store (the sum of their sizes).",
        ),
        GaugeMetricFamily(
            "modelforge_services",
            "Services by state (pending, starting, healthy, unhealthy, restarting, failed); "
            "undeployed ones are not counted.",
            labels=["state"],
        ),
        GaugeMetricFamily(
            "modelforge_service_state",
            "Each deployed service's state: 1 for the state it is in, 0 for the others.",
            labels=["name", "service", "state"],
        ),
        GaugeMetricFamily(
            "modelforge_service_restarts",
            "Each deployed service's restarts (crashes, failed health checks and asked-for "
            "restarts), as its view shows them.",
            labels=["name", "service"],
        ),
        GaugeMetricFamily(
            "modelforge_gpu_health",
            "Each GPU's health (by node id and GPU uuid): 1 for its state (healthy, degraded, "
            "unhealthy, quarantined), 0 for the other three.",
            labels=["node", "gpu", "state"],
        ),
        GaugeMetricFamily(
            "modelforge_llm_engine_requests",
            "Each LLM service's requests its engines generate for (processing) and hold in "
            "their own queues (waiting), read from the engines' metrics by their nodes.",
            labels=["name", "service", "state"],
        ),
    ]
