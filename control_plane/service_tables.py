"""ORM tables of the model services and their gateway: services, their revisions, replicas and
events, the gateway's access tokens and tunnels. `models.py` re-exports them: import tables
from there."""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, String, Table, text
from sqlalchemy.orm import Mapped, mapped_column

from control_plane.table_base import Base


class Service(Base):
    """A long-running model server (WL-5a): what it runs (its current revision's fields) and how
    many copies; each copy is a `ServiceReplica`, placed on a node for as long as it is deployed.
    `state` and `restarts` summarise the replicas; `generation` grows with each restart asked
    for, which the nodes' agents act on."""

    __tablename__ = "services"
    __table_args__ = (
        Index("ix_services_state", "state"),
        # The gateway reaches a service by its name: one deployed service per name (0016).
        Index(
            "uq_services_deployed_name",
            "name",
            unique=True,
            sqlite_where=text("state != 'stopped'"),
            postgresql_where=text("state != 'stopped'"),
        ),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    #: pending | starting | healthy | degraded | unhealthy | restarting | idle | stopped | failed
    state: Mapped[str] = mapped_column(String(16), default="pending")
    command: Mapped[list[Any] | None] = mapped_column(JSON)
    runner: Mapped[str | None] = mapped_column(String(16))
    weights: Mapped[str | None] = mapped_column(String(71))
    model: Mapped[str | None] = mapped_column(String(201))
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    env: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    secrets: Mapped[list[Any]] = mapped_column(JSON, default=list)
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    worker_policy: Mapped[str] = mapped_column(String(16), default="require")
    resources: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    health: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    restart: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    generation: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    stopped_at: Mapped[datetime | None]
    next_event_seq: Mapped[int] = mapped_column(Integer, default=1)
    #: How many replicas it runs (issue 27); with `autoscale`, what the autoscaler last chose.
    replicas: Mapped[int] = mapped_column(Integer, default=1)
    #: The revision its new replicas run (`service_revisions`).
    revision: Mapped[int] = mapped_column(Integer, default=1)
    #: `{"min", "max", "target_in_flight", "idle_seconds"}` or None: a fixed `replicas`.
    autoscale: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    #: The rolling update under way: `{"from", "to", "started_at", ...}`, None when none.
    rollout: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    #: The last request the gateway sent it (scale to zero counts idleness from it).
    last_request_at: Mapped[datetime | None]


class ServiceRevision(Base):
    """What a service runs at one revision (issue 27): a change of its model, weights, command or
    settings makes a new revision, and a rolling update moves its replicas from one to the
    next. `spec` holds the fields a replica is started from, as the service's columns do."""

    __tablename__ = "service_revisions"

    service_id: Mapped[str] = mapped_column(
        ForeignKey("services.id", ondelete="CASCADE"), primary_key=True
    )
    revision: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime]


class ServiceReplica(Base):
    """One running copy of a service (issue 27), placed on a node like a service is: `node_id`
    set means it holds the service's `resources` and `assigned_gpus` there."""

    __tablename__ = "service_replicas"
    __table_args__ = (
        Index("ix_service_replicas_service", "service_id", "ordinal"),
        Index("ix_service_replicas_state", "state"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    service_id: Mapped[str] = mapped_column(ForeignKey("services.id", ondelete="CASCADE"))
    ordinal: Mapped[int] = mapped_column(Integer)
    #: The service revision it runs.
    revision: Mapped[int] = mapped_column(Integer, default=1)
    #: pending | starting | healthy | unhealthy | restarting | failed | draining | stopped
    state: Mapped[str] = mapped_column(String(16), default="pending")
    node_id: Mapped[str | None] = mapped_column(String(40), index=True)
    assigned_gpus: Mapped[list[Any] | None] = mapped_column(JSON)
    url: Mapped[str | None] = mapped_column(String(300))
    grpc_url: Mapped[str | None] = mapped_column(String(300))
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    last_exit: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    log_tail: Mapped[list[Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    placed_at: Mapped[datetime | None]
    #: When it last turned healthy (warm): the gateway sends it requests from then on.
    ready_at: Mapped[datetime | None]
    stopped_at: Mapped[datetime | None]
    #: While draining: the requests in flight to it through its node's tunnel, as its agent
    #: last reported them, when, and since when every report said that many (`rollout.idle`:
    #: none left in two reports, the drain ends early).
    in_flight: Mapped[int | None] = mapped_column(Integer)
    in_flight_at: Mapped[datetime | None]
    in_flight_since: Mapped[datetime | None]
    #: An LLM replica's engine's own load as its agent last reported it: `processing` and
    #: `waiting` requests (None: not an LLM's, or not read).
    engine: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class ServiceAccessToken(Base):
    """A bearer token that opens services at the gateway (issue 27): shown once, kept only as
    its SHA-256 hash; revocable; optionally rate limited. `scope` says what it opens: `service`,
    its `service_id` (minted under that service); `services`, those linked to it
    (`AccessTokenService`); `llm`, every LLM service (issue 43). Only a `service` token has a
    `service_id`."""

    __tablename__ = "service_access_tokens"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    service_id: Mapped[str | None] = mapped_column(
        ForeignKey("services.id", ondelete="CASCADE"), index=True
    )
    scope: Mapped[str] = mapped_column(String(16), default="service", server_default="service")
    name: Mapped[str] = mapped_column(String(100))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    #: The token's first characters, to tell tokens apart in lists (never enough to use it).
    hint: Mapped[str] = mapped_column(String(16))
    #: Requests per second allowed (a token bucket of `burst`); None: unlimited.
    rate_per_second: Mapped[float | None] = mapped_column(Float)
    burst: Mapped[int | None] = mapped_column(Integer)
    #: LLM tokens (prompt and completion) its OpenAI calls may use per minute; None: unlimited.
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime]
    created_by: Mapped[str] = mapped_column(String(64))
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class AccessTokenService(Base):
    """A service an access token of scope `services` opens (issue 43)."""

    __tablename__ = "access_token_services"

    token_id: Mapped[str] = mapped_column(
        ForeignKey("service_access_tokens.id", ondelete="CASCADE"), primary_key=True
    )
    service_id: Mapped[str] = mapped_column(
        ForeignKey("services.id", ondelete="CASCADE"), primary_key=True
    )


class ModelAlias(Base):
    """Another name an LLM service answers to at the OpenAI API (issue 43): held by one service
    until it is undeployed or gives the alias up (`services/aliases.py`)."""

    __tablename__ = "model_aliases"

    alias: Mapped[str] = mapped_column(String(100), primary_key=True)
    service_id: Mapped[str] = mapped_column(
        ForeignKey("services.id", ondelete="CASCADE"), index=True
    )


class GatewayTunnel(Base):
    """Which control-plane replica holds a node's tunnel (issue 27): the gateway of another
    replica hands a request for that node's replicas to this one."""

    __tablename__ = "gateway_tunnels"

    node_id: Mapped[str] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    #: The control-plane process holding it, and the address its peers reach it at.
    holder: Mapped[str] = mapped_column(String(64))
    holder_address: Mapped[str] = mapped_column(String(300))
    connected_at: Mapped[datetime]


class GatewayTraffic(Base):
    """One control-plane process's gateway requests in flight to an autoscaled service, as its
    autoscaler last wrote them (issue 27): every process sizes a service from the sum of the
    fresh rows, not its own share of the requests (`services/autoscale.py`)."""

    __tablename__ = "gateway_traffic"

    process: Mapped[str] = mapped_column(String(64), primary_key=True)
    service_id: Mapped[str] = mapped_column(
        ForeignKey("services.id", ondelete="CASCADE"), primary_key=True
    )
    in_flight: Mapped[int] = mapped_column(Integer)
    reported_at: Mapped[datetime]


class LlmUsage(Base):
    """The tokens an access token's OpenAI calls to a service used in one minute, as the engine
    counted them (issue 43): each control-plane process adds its calls' counts to the minute's
    row (`gateway/usage.py`), so the rows are the sum over the processes."""

    __tablename__ = "llm_usage"

    token_id: Mapped[str] = mapped_column(
        ForeignKey("service_access_tokens.id", ondelete="CASCADE"), primary_key=True
    )
    service_id: Mapped[str] = mapped_column(
        ForeignKey("services.id", ondelete="CASCADE"), primary_key=True
    )
    minute: Mapped[datetime] = mapped_column(primary_key=True)
    requests: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)


class GatewayPeerKey(Base):
    """The key control-plane replicas sign their requests to one another with (the gateway's
    forwarding to the process holding a node's tunnel, `gateway/peers.py`): one row, made once
    by whichever replica starts first."""

    __tablename__ = "gateway_peer_keys"

    name: Mapped[str] = mapped_column(String(40), primary_key=True)
    key: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime]


class ServiceEvent(Base):
    __tablename__ = "service_events"
    __table_args__ = (Index("uq_service_events_service_seq", "service_id", "seq", unique=True),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    service_id: Mapped[str] = mapped_column(ForeignKey("services.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(16))
    data: Mapped[Any] = mapped_column(JSON)
    #: The replica it happened to (issue 27); None for the service as a whole.
    replica_id: Mapped[str | None] = mapped_column(String(40))


SERVICES = cast(Table, Service.__table__)
