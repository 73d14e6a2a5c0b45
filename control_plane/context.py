"""Everything a running control plane holds, built once by the app factory."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from control_plane.admin_token import AdminTokenSource
from control_plane.clock import Clock
from control_plane.dispatch import Dispatcher
from control_plane.models import Node
from control_plane.services.artifacts import ArtifactStore
from control_plane.services.console_sessions import SignInThrottle
from control_plane.services.credentials import CredentialAuthority
from control_plane.services.heartbeats import HeartbeatBuffer
from control_plane.services.nodes import LivenessThresholds
from control_plane.settings import Settings


@dataclass
class AppContext:
    settings: Settings
    clock: Clock
    engine: Engine
    session_factory: sessionmaker[Session]
    admin_token: AdminTokenSource
    authority: CredentialAuthority
    heartbeats: HeartbeatBuffer = field(default_factory=HeartbeatBuffer)
    dispatcher: Dispatcher = field(default_factory=Dispatcher)
    sign_in_throttle: SignInThrottle = field(default_factory=SignInThrottle)

    @property
    def artifacts(self) -> ArtifactStore:
        return ArtifactStore(self.settings.data_dir)

    def last_seen(self, node: Node) -> datetime | None:
        """The node's last heartbeat, counting one accepted but not yet flushed."""
        pending = self.heartbeats.peek(node.id)
        if pending is not None and (
            node.last_heartbeat_at is None or pending.at > node.last_heartbeat_at
        ):
            return pending.at
        return node.last_heartbeat_at

    @property
    def thresholds(self) -> LivenessThresholds:
        return LivenessThresholds(
            stale_after=timedelta(seconds=self.settings.node_stale_after_seconds),
            offline_after=timedelta(seconds=self.settings.node_offline_after_seconds),
        )

    @property
    def telemetry_max_age(self) -> timedelta:
        return timedelta(seconds=3 * self.settings.telemetry_interval_seconds)
