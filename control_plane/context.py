"""Everything a running control plane holds, built once by the app factory."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from control_plane.access.admin_token import AdminTokenSource
from control_plane.access.console_sessions import SignInThrottle
from control_plane.access.oidc import OidcProvider
from control_plane.artifacts.store import ArtifactStore
from control_plane.clock import Clock
from control_plane.db import DatabaseAvailability
from control_plane.fleet.credentials import CredentialAuthority
from control_plane.fleet.heartbeats import HeartbeatBuffer
from control_plane.fleet.liveness import ContactGrace, Liveness, LivenessThresholds
from control_plane.gateway.tunnels import TunnelHub
from control_plane.lanes import WorkerLanes
from control_plane.metrics import Metrics
from control_plane.provisioning.config import load_provisioners
from control_plane.provisioning.provisioner import Provisioner
from control_plane.scheduling.completions import Completions
from control_plane.scheduling.dispatch import Dispatcher
from control_plane.scheduling.scheduler import Scheduler
from control_plane.services.autoscale import Autoscaler, Traffic
from control_plane.settings import Settings
from control_plane.vault.vault import Vault


@dataclass
class AppContext:
    settings: Settings
    clock: Clock
    engine: Engine
    #: The engine of `read_session_factory` (on PostgreSQL, `engine` itself).
    read_engine: Engine
    session_factory: sessionmaker[Session]
    #: Read-only sessions (GET and HEAD requests): on SQLite they take no lock (`db.py`).
    read_session_factory: sessionmaker[Session]
    #: None in a process that takes no admin token (the artifact host: no route asks for one).
    admin_token: AdminTokenSource | None
    authority: CredentialAuthority
    heartbeats: HeartbeatBuffer = field(default_factory=HeartbeatBuffer)
    #: This app's Prometheus instruments and registry (`GET /metrics`).
    metrics: Metrics = field(default_factory=Metrics)
    sign_in_throttle: SignInThrottle = field(default_factory=SignInThrottle)
    #: Wrong passwords per client address, counted apart from wrong admin tokens.
    password_throttle: SignInThrottle = field(
        default_factory=lambda: SignInThrottle(what="passwords", source="your name and password")
    )
    #: Outages of the database, each logged once (the app factory makes it watch `engine`); its
    #: settling second counted on `clock`.
    database: DatabaseAvailability = field(init=False)
    #: The agents' tunnels this process holds, through which the gateway reaches replicas.
    hub: TunnelHub = field(default_factory=TunnelHub)
    #: The gateway's requests per service in this process, which the autoscaler sizes from.
    traffic: Traffic = field(init=False)
    #: The autoscaler's scale-down windows (this process's).
    autoscaler: Autoscaler = field(init=False)
    #: The threads blocking routes run on, one share per kind of request (`lanes.py`).
    lanes: WorkerLanes = field(init=False)
    #: Wakes long polls and the scheduler when jobs change, across replicas.
    dispatcher: Dispatcher = field(init=False)
    #: Matches this process's waiting claims to queued jobs (started in the app's lifespan).
    scheduler: Scheduler = field(init=False)
    #: Commits agents' job outcomes in groups (started in the app's lifespan).
    completions: Completions = field(init=False)
    #: Encrypts and decrypts secrets (WL-6a), with keys in the data dir.
    vault: Vault = field(init=False)
    #: Starts node agents on Slurm clusters when work waits (PV-1); idle without provisioners.
    provisioner: Provisioner = field(init=False)
    #: Since when the nodes could reach this process: no contact deadline counts before it.
    contact_grace: ContactGrace = field(init=False)
    #: Single sign-on through the OpenID provider; None when it is not configured.
    oidc: OidcProvider | None = field(init=False)

    def __post_init__(self) -> None:
        self.database = DatabaseAvailability(monotonic=self.clock.monotonic)
        self.dispatcher = Dispatcher(clock=self.clock)
        self.traffic = Traffic(self.clock)
        self.autoscaler = Autoscaler(self.clock)
        self.lanes = WorkerLanes.create(queue_seconds=self.settings.request_queue_seconds)
        self.contact_grace = ContactGrace(clock=self.clock, database=self.database)
        self.oidc = OidcProvider(self.settings, self.clock) if self.settings.oidc_issuer else None
        self.vault = Vault(self.settings.data_dir)
        self.completions = Completions(session_factory=self.session_factory, clock=self.clock)
        self.scheduler = Scheduler(
            session_factory=self.session_factory,
            clock=self.clock,
            liveness=lambda: self.liveness,
            dispatcher=self.dispatcher,
            on_placed=lambda latencies: self.metrics.observe_placements(latencies),
            vault=self.vault,
        )
        self.provisioner = Provisioner(
            provisioners=load_provisioners(self.settings.provisioners_path),
            session_factory=self.session_factory,
            clock=self.clock,
            authority=self.authority,
            liveness=lambda: self.liveness,
            fleet=lambda session: self.scheduler.fleet(session),
        )

    @property
    def artifacts(self) -> ArtifactStore:
        return ArtifactStore(self.settings.data_dir)

    @property
    def liveness(self) -> Liveness:
        """The one liveness reader: stored heartbeats merged with those not yet flushed."""
        return Liveness(self.heartbeats, self.thresholds)

    @property
    def thresholds(self) -> LivenessThresholds:
        return LivenessThresholds(
            stale_after=timedelta(seconds=self.settings.node_stale_after_seconds),
            offline_after=timedelta(seconds=self.settings.node_offline_after_seconds),
            grace=self.contact_grace,
        )

    @property
    def telemetry_max_age(self) -> timedelta:
        return timedelta(seconds=3 * self.settings.telemetry_interval_seconds)
