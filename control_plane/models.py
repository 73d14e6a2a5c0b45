"""ORM tables. Alembic owns the schema; these classes describe it for queries.

The services' and the gateway's tables live in `service_tables.py`, the base in `table_base.py`;
both are re-exported here, the one place to import a table from. Timestamps are UTC-aware
everywhere (`UTCDateTime` restores the zone SQLite drops). Secrets are never stored: enrollment
tokens and claim nonces as SHA-256 hashes, credentials by `jti` only.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from control_plane.people_tables import ApiKey, OidcLogin, User
from control_plane.service_tables import (
    SERVICES,
    AccessTokenService,
    GatewayPeerKey,
    GatewayTraffic,
    GatewayTunnel,
    LlmUsage,
    ModelAlias,
    Service,
    ServiceAccessToken,
    ServiceEvent,
    ServiceReplica,
    ServiceRevision,
)
from control_plane.table_base import NAMING_CONVENTION, Base, UTCDateTime

__all__ = [
    "JOB_EVENTS",
    "JOBS",
    "NAMING_CONVENTION",
    "SERVICES",
    "AccessTokenService",
    "ApiKey",
    "Artifact",
    "ArtifactUpload",
    "AuditEntry",
    "Base",
    "ConsoleSession",
    "ControlPlanePresence",
    "GatewayPeerKey",
    "GatewayTraffic",
    "GatewayTunnel",
    "GpuHealth",
    "GpuHealthEvent",
    "Job",
    "JobEvent",
    "LlmUsage",
    "Model",
    "ModelAlias",
    "Node",
    "NodeCredential",
    "NodeEnrollment",
    "NodeEvent",
    "OidcLogin",
    "ProvisionEvent",
    "ProvisionRequest",
    "Secret",
    "Service",
    "ServiceAccessToken",
    "ServiceEvent",
    "ServiceReplica",
    "ServiceRevision",
    "SigningKey",
    "TelemetrySample",
    "UTCDateTime",
    "User",
]


class NodeEnrollment(Base):
    __tablename__ = "node_enrollments"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    node_id: Mapped[str] = mapped_column(String(40), unique=True)
    display_name: Mapped[str] = mapped_column(String(120))
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    #: pending | claimed | revoked ("expired" is derived from expires_at, never stored).
    state: Mapped[str] = mapped_column(String(16), default="pending")
    production_eligible: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    claimed_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
    claim_nonce_hash: Mapped[str | None] = mapped_column(String(64))


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    enrollment_id: Mapped[str] = mapped_column(ForeignKey("node_enrollments.id"))
    display_name: Mapped[str] = mapped_column(String(120))
    hostname: Mapped[str] = mapped_column(String(255))
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime]
    #: The liveness state last written as an event; the API always recomputes it.
    recorded_state: Mapped[str] = mapped_column(String(16), default="offline")
    last_heartbeat_at: Mapped[datetime | None]
    agent_version: Mapped[str | None] = mapped_column(String(64))
    protocol_version: Mapped[int | None] = mapped_column(Integer)
    health: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    inventory: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    inventory_at: Mapped[datetime | None]
    telemetry: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    telemetry_at: Mapped[datetime | None]
    fingerprint_hash: Mapped[str | None] = mapped_column(String(64), index=True)
    #: The last compatibility refusal (TOO_OLD | TOO_NEW | UNKNOWN) and of which component.
    compat_code: Mapped[str | None] = mapped_column(String(16))
    compat_component: Mapped[str | None] = mapped_column(String(32))
    compat_detail: Mapped[str | None] = mapped_column(Text)
    compat_at: Mapped[datetime | None]


class NodeCredential(Base):
    __tablename__ = "node_credentials"
    __table_args__ = (
        # Exactly one active credential per node, enforced by the database itself.
        Index(
            "uq_node_credentials_active_node",
            "node_id",
            unique=True,
            sqlite_where=text("revoked_at IS NULL"),
            postgresql_where=text("revoked_at IS NULL"),
        ),
    )

    jti: Mapped[str] = mapped_column(String(64), primary_key=True)
    #: No foreign key: a credential outlives its node, revoked, so that every replica's
    #: revocation refresh sees a deleted node's credentials go (a cascade would erase them).
    node_id: Mapped[str] = mapped_column(String(40), index=True)
    kid: Mapped[str] = mapped_column(String(64))
    issued_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None] = mapped_column(index=True)
    revoked_reason: Mapped[str | None] = mapped_column(String(200))
    #: Its `exp` (CR-3); None only for credentials issued before credentials expired.
    expires_at: Mapped[datetime | None]
    #: The labels signed into it.
    labels: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    #: `enrollment` or `provisioner`: who had it issued.
    issuer: Mapped[str | None] = mapped_column(String(16))


class SigningKey(Base):
    __tablename__ = "signing_keys"

    kid: Mapped[str] = mapped_column(String(64), primary_key=True)
    public_key_pem: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]
    retired_at: Mapped[datetime | None]


class ControlPlanePresence(Base):
    """The latest moment a control plane replica was known to be alive (one row, `id` 1): at
    the next start, where its downtime began (`liveness.ContactGrace`)."""

    __tablename__ = "control_plane_presence"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    alive_at: Mapped[datetime]


class NodeEvent(Base):
    __tablename__ = "node_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(32))
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)


class GpuHealth(Base):
    """One GPU's health as the control plane judges it (issue 28), one row per GPU a node's
    agent reported. `state` is what the scheduler reads: `quarantined` while an operator's
    quarantine holds, else `rules_state`. The rules' `unhealthy` is sticky: the agent reporting
    clean counters again only updates `reported`; an admin's re-admission with a passing active
    check ends it."""

    __tablename__ = "gpu_health"
    __table_args__ = (Index("ix_gpu_health_state", "state"),)

    node_id: Mapped[str] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    uuid: Mapped[str] = mapped_column(String(96), primary_key=True)
    index: Mapped[int] = mapped_column(Integer)
    #: healthy | degraded | unhealthy | quarantined
    state: Mapped[str] = mapped_column(String(16), default="healthy")
    #: healthy | degraded | unhealthy: what the rules made of the agent's reports.
    rules_state: Mapped[str] = mapped_column(String(16), default="healthy")
    #: healthy | degraded | unhealthy: the agent's last report, as it was.
    reported: Mapped[str] = mapped_column(String(16), default="healthy")
    #: Why `state`, for people.
    reason: Mapped[str] = mapped_column(Text, default="")
    #: What showed it: `[{"kind", "at", "detail", ...}]`, newest last, bounded.
    evidence: Mapped[list[Any]] = mapped_column(JSON, default=list)
    #: Since when `state` holds.
    since: Mapped[datetime]
    reported_at: Mapped[datetime]
    #: An operator's quarantine: its reason, None when none holds.
    quarantine_reason: Mapped[str | None] = mapped_column(Text)
    quarantined_at: Mapped[datetime | None]
    #: The active check running on it (a job), None when none runs.
    check_job_id: Mapped[str | None] = mapped_column(String(40))


class GpuHealthEvent(Base):
    """A GPU's timeline: each change of its state, quarantine, re-admission and check."""

    __tablename__ = "gpu_health_events"
    __table_args__ = (Index("ix_gpu_health_events_node_uuid", "node_id", "uuid", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    uuid: Mapped[str] = mapped_column(String(96))
    at: Mapped[datetime]
    #: state | quarantine | readmit | check
    kind: Mapped[str] = mapped_column(String(16))
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    evidence: Mapped[list[Any] | None] = mapped_column(JSON)
    #: `agent`, `admin-token`, `console-session:…`, `check`
    actor: Mapped[str] = mapped_column(String(64))


class TelemetrySample(Base):
    __tablename__ = "telemetry_samples"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(index=True)
    sample: Mapped[dict[str, Any]] = mapped_column(JSON)

    __table_args__ = (Index("ix_telemetry_samples_node_at", "node_id", "at"),)


class Job(Base):
    """A unit of model execution. `state` moves queued -> running -> one of
    succeeded | failed | cancelled, always by conditional UPDATE."""

    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_state_created", "state", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default="queued")
    entrypoint: Mapped[dict[str, Any]] = mapped_column(JSON)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    inputs: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    resources: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    #: The GPUs of its node it was handed, `[{"index", "uuid"}]`, set by the claim; kept
    #: after it ends. Only running jobs' entries count as held.
    assigned_gpus: Mapped[list[Any] | None] = mapped_column(JSON)
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    worker_policy: Mapped[str] = mapped_column(String(16), default="require")
    timeout_seconds: Mapped[float] = mapped_column(Float)
    silence_timeout_seconds: Mapped[float] = mapped_column(Float)
    #: Seconds its node may go without reaching the control plane before its agent kills it
    #: (docs/jobs.md); None: it runs on through any outage.
    stop_after_disconnect_seconds: Mapped[float | None] = mapped_column(Float)
    node_id: Mapped[str | None] = mapped_column(String(40), index=True)
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    #: Last progress from the agent running it; heartbeats do not touch it.
    last_contact_at: Mapped[datetime | None]
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    result: Mapped[Any | None] = mapped_column(JSON)
    outputs: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error_code: Mapped[str | None] = mapped_column(String(40))
    error_message: Mapped[str | None] = mapped_column(Text)
    next_event_seq: Mapped[int] = mapped_column(Integer, default=1)
    #: The model it was submitted with (`name@version`), resolved into entrypoint and params.
    model: Mapped[str | None] = mapped_column(String(201))
    #: The names of the secrets its process receives (WL-6a).
    secrets: Mapped[list[Any] | None] = mapped_column(JSON)
    #: Labels a node must carry whatever `worker_policy` says: its secrets' labels.
    required_labels: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    #: `{"node_id", "uuid"}`: it runs on that node and that GPU only, even one out of the
    #: schedule (a GPU's active check, issue 28); None for every other job.
    pinned: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("uq_job_events_job_seq", "job_id", "seq", unique=True),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(16))
    data: Mapped[Any] = mapped_column(JSON)


class Artifact(Base):
    """A content-addressed blob in the data dir; the file is named by its digest."""

    __tablename__ = "artifacts"

    digest: Mapped[str] = mapped_column(String(71), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime]


class ArtifactUpload(Base):
    """Which node uploaded which artifact: a node may download what it uploaded itself."""

    __tablename__ = "artifact_uploads"

    digest: Mapped[str] = mapped_column(
        ForeignKey("artifacts.digest", ondelete="CASCADE"), primary_key=True
    )
    node_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    uploaded_at: Mapped[datetime]


class Model(Base):
    """A named, versioned model (WL-5c): immutable once created; jobs and services name it as
    `name@version` and get its runner, weights and default params."""

    __tablename__ = "models"
    __table_args__ = (Index("uq_models_name_version", "name", "version", unique=True),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    version: Mapped[str] = mapped_column(String(100))
    runner: Mapped[str] = mapped_column(String(16))
    weights: Mapped[str] = mapped_column(String(71), index=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime]


class Secret(Base):
    """A write-only value (WL-6a), stored only encrypted (AES-256-GCM, the key in the data dir);
    `key_id` names the key it was encrypted with, for rotation."""

    __tablename__ = "secrets"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    ciphertext: Mapped[bytes] = mapped_column(LargeBinary)
    key_id: Mapped[str] = mapped_column(String(32))
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]

    def __repr__(self) -> str:
        return f"Secret(name={self.name!r}, labels={self.labels!r})"


class AuditEntry(Base):
    """One admin action (AU-1): appended, never updated. Never holds a secret value."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(index=True)
    #: `admin-token` or `console-session:<8 hex of the session's hash>`.
    actor: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(40), index=True)
    target: Mapped[str] = mapped_column(String(300))
    #: `ok`, or the refusal's error code.
    outcome: Mapped[str] = mapped_column(String(40))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class ProvisionRequest(Base):
    """A node agent asked of a Slurm profile (PV-1): submitted over SSH, attached once its agent
    reports, released when idle; at most one outstanding (`submitting`/`pending`) per profile,
    enforced by the database across replicas."""

    __tablename__ = "provision_requests"
    __table_args__ = (
        Index(
            "uq_provision_requests_outstanding",
            "provisioner",
            "profile",
            unique=True,
            sqlite_where=text("state IN ('submitting', 'pending')"),
            postgresql_where=text("state IN ('submitting', 'pending')"),
        ),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    provisioner: Mapped[str] = mapped_column(String(63))
    profile: Mapped[str] = mapped_column(String(63))
    #: submitting | pending | attached | released | cancelled | failed
    state: Mapped[str] = mapped_column(String(16), index=True)
    slurm_job_id: Mapped[str | None] = mapped_column(String(32))
    #: The node created for the agent it starts (its credential is issued by the provisioner).
    node_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    attached_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    reason: Mapped[str | None] = mapped_column(Text)


class ProvisionEvent(Base):
    __tablename__ = "provision_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(
        ForeignKey("provision_requests.id", ondelete="CASCADE"), index=True
    )
    at: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(16))
    data: Mapped[Any] = mapped_column(JSON)


class ConsoleSession(Base):
    """A signed-in console. Only the SHA-256 of the cookie value is stored; the CSRF token
    is derived from the cookie value, so neither can be recovered from the database."""

    __tablename__ = "console_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime] = mapped_column(index=True)
    #: The user a password sign-in made it for; None for one made with the admin token.
    user_id: Mapped[str | None] = mapped_column(
        ForeignKey("users.id", ondelete="CASCADE"), index=True
    )


#: The Core tables of `Job` and `JobEvent`, for bulk statements (executemany with bind
#: parameters) that the ORM's per-object path would make one round trip each.
JOBS = cast(Table, Job.__table__)
JOB_EVENTS = cast(Table, JobEvent.__table__)
