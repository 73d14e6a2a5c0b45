"""Control plane settings: one pydantic-settings class, prefix `MODELFORGE_`.

Values are validated once at start; contradictory liveness thresholds are refused with a message
naming the settings. Secrets are `SecretStr` so that `repr()` and logs never show them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: As long as the admin token must be: it is compared unthrottled (see `api/metrics.py`).
METRICS_TOKEN_MIN_LENGTH = 16
MIN_ARTIFACT_SWEEP_INTERVAL_SECONDS = 60.0


class Settings(BaseSettings):
    # Empty variables count as unset: Compose passes `${VAR:-}` through as "".
    model_config = SettingsConfigDict(
        env_prefix="MODELFORGE_", extra="ignore", env_ignore_empty=True
    )

    data_dir: Path = Field(default=Path("modelforge-data"))
    database_url: SecretStr | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    public_url: str | None = None
    admin_token: SecretStr | None = None
    admin_token_file: Path | None = None
    #: A token that reads `GET /metrics` and nothing else, so a Prometheus server need not hold
    #: the admin token (sent as `Authorization: Bearer <token>`).
    metrics_token: SecretStr | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: Requests one process serves at once. Every node holds a claim per work slot and a
    #: cancellation watch open all the time (long polls cost no thread, no connection to the
    #: database), so this bounds the fleet one replica can serve.
    max_concurrent_requests: int = Field(default=16384, ge=64, le=1_000_000)
    #: How long a request may wait for a worker thread of its kind (admin, agent, probe) before
    #: it is answered 503 `BUSY` without being started: a saturated control plane says so
    #: instead of holding requests in silence.
    request_queue_seconds: float = Field(default=10.0, gt=0, le=300)

    node_stale_after_seconds: float = 30.0
    node_offline_after_seconds: float = 90.0
    heartbeat_interval_seconds: float = 10.0
    telemetry_interval_seconds: float = 15.0
    #: How often coalesced heartbeats are written (HB-4 promises at most 1 s).
    heartbeat_flush_interval_seconds: float = Field(default=0.5, gt=0, le=1.0)
    liveness_sweep_interval_seconds: float = Field(default=1.0, gt=0)
    #: How often this process re-reads credential revocations made by other processes.
    credential_refresh_interval_seconds: float = Field(default=1.0, gt=0)
    #: How long a credential issued at enrollment is valid (CR-3); the node enrolls again after.
    credential_lifetime_days: float = Field(default=365.0, gt=0, le=3650)
    telemetry_retention_seconds: float = Field(default=3600.0, gt=0)
    #: Readiness fails once the stored inventory is older than this. Agents are told to resend
    #: it, changed or not, every quarter of it, so only an agent that stopped reporting fails.
    inventory_max_age_seconds: float = Field(default=3600.0, ge=60)
    #: How often an agent reports progress on a running job, and how long without any
    #: report fails it (heartbeats do not count).
    job_progress_interval_seconds: float = Field(default=10.0, gt=0)
    job_contact_timeout_seconds: float = Field(default=90.0, gt=0)
    #: A console session lasts this long from sign-in, then the admin token is asked again.
    console_session_seconds: float = Field(default=3600.0, ge=60, le=86400)
    #: The largest request body accepted, in bytes, where no larger limit below applies.
    max_body_bytes: int = Field(default=1024 * 1024, ge=16 * 1024, le=256 * 1024 * 1024)
    #: Job submissions, and an agent's job progress reports and results.
    max_job_body_bytes: int = Field(default=4 * 1024 * 1024, ge=16 * 1024, le=256 * 1024 * 1024)
    #: Artifact uploads; they stream to disk, so this bounds disk use, not memory.
    max_artifact_bytes: int = Field(default=64 * 1024**3, ge=1)
    #: How often the artifact sweep runs (AR-3a); 0 turns the periodic sweep off (the admin
    #: endpoint still sweeps on demand).
    artifact_sweep_interval_seconds: float = Field(default=3600.0, ge=0)
    #: An artifact nothing names is kept this long after its upload (or its latest re-upload):
    #: the time between uploading weights and naming them in a job, model or service.
    artifact_grace_seconds: float = Field(default=86400.0, ge=1)
    #: `/api/v1/health` reports the storage `low` (and itself `degraded`) below this much free
    #: room in the data dir (or the artifacts' own volume).
    storage_low_free_bytes: int = Field(default=1024**3, ge=0)
    #: The Slurm provisioners (PV-1a); unset: `provisioners.json` in the data dir, if it exists.
    provisioners_file: Path | None = None
    #: The verified release manifest; when set, a node-agent entry pasted into the Enroll
    #: node wizard must match its node-agent image exactly.
    release_manifest: Path | None = None
    #: Run a node agent and a runtime worker beside the control plane, as its children
    #: (control_plane/local_node.py); `--local-node` / `--no-local-node` win over it.
    local_node: bool = False
    #: The onnxruntime execution provider a GPU's active check (fleet/gpu_check.py) runs its
    #: model on, beside the CPU's: CUDA on GPU nodes; the CPU's only where no GPU computes
    #: (tests, the substitute NVML), so the check then tests NVML's readings alone.
    gpu_check_provider: Literal["CUDAExecutionProvider", "CPUExecutionProvider"] = (
        "CUDAExecutionProvider"
    )
    #: The gateway (issue 27, docs/services.md "One address: the gateway"): the largest request
    #: body it carries to a replica, in bytes (413 past it).
    gateway_max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=16 * 1024, le=4 * 1024**3)
    #: A request body up to this size is kept so that a transport failure can be retried once on
    #: another replica; a larger one is not retried.
    gateway_retry_body_bytes: int = Field(default=8 * 1024 * 1024, ge=0, le=256 * 1024 * 1024)
    #: A client that sends no part of its body for this long is answered 408.
    gateway_body_timeout_seconds: float = Field(default=30.0, gt=0, le=600)
    #: Requests one service takes at once through this process; more wait in its queue.
    gateway_max_concurrent_per_service: int = Field(default=256, ge=1, le=100_000)
    #: Requests that may wait per service, each at most the wait below, before a 503.
    gateway_queue_per_service: int = Field(default=1024, ge=0, le=1_000_000)
    gateway_queue_seconds: float = Field(default=10.0, gt=0, le=300)
    #: How long a request for a service scaled to zero waits for a replica to get ready.
    gateway_cold_start_seconds: float = Field(default=120.0, gt=0, le=1800)
    #: A rolling update fails when its new replicas are not all healthy and warm by then.
    service_rollout_timeout_seconds: float = Field(default=900.0, ge=10, le=86400)
    #: How long a replica taken out of the rotation (rollout, scale down) keeps running for the
    #: requests already sent to it before it is stopped: above the longest request.
    service_drain_seconds: float = Field(default=30.0, ge=0, le=3600)
    #: Where the other control-plane replicas reach this process (`http(s)://host:port`), to
    #: forward a gateway request for a node whose tunnel this process holds. Unset: this
    #: process still serves the tunnels it holds, but no other replica can reach them.
    gateway_peer_address: str = Field(default="", max_length=300)
    #: What carries the gateway's requests and holds the agents' tunnels: `native`, the control
    #: plane's native front (`modelforge-gateway-front`: on this port, with Granian behind it on
    #: loopback, docs/services.md "The native front"), or `python` (Granian on this port serves
    #: everything). Unset: the native front (missing, a start-up error naming `make install`,
    #: never a fallback). It terminates TLS itself; it does not forward to other replicas yet,
    #: so a peer address keeps the Python gateway (logged), and `native` with one is refused.
    gateway_front: Literal["native", "python"] | None = None
    #: Single sign-on through an OpenID provider (docs/access.md): its issuer URL (discovery at
    #: `<issuer>/.well-known/openid-configuration`), this client's id and secret. Needs
    #: `public_url`: the redirect URL is `<public_url>/api/v1/console/oidc/callback`.
    oidc_issuer: str | None = None
    oidc_client_id: str | None = None
    oidc_client_secret: SecretStr | None = None
    #: What the sign-in page's button names the provider ("Sign in with <name>").
    oidc_display_name: str = Field(default="single sign-on", min_length=1, max_length=60)
    oidc_scopes: str = "openid profile groups"
    #: The ID token's claims a user's name and groups are read from.
    oidc_username_claim: str = "preferred_username"
    oidc_groups_claim: str = "groups"
    #: `group=role` pairs, comma separated (`ml-admins=admin,ml-team=member`): a user gets the
    #: highest role any of their groups maps to, at every sign-in.
    oidc_roles: str = ""
    #: The role of a user none of whose groups is mapped; unset: such a user is refused.
    oidc_default_role: Literal["admin", "operator", "member", "viewer"] | None = None

    @model_validator(mode="after")
    def _check_liveness(self) -> Self:
        stale = self.node_stale_after_seconds
        offline = self.node_offline_after_seconds
        interval = self.heartbeat_interval_seconds
        problems: list[str] = []
        for name, value in (
            ("MODELFORGE_NODE_STALE_AFTER_SECONDS", stale),
            ("MODELFORGE_NODE_OFFLINE_AFTER_SECONDS", offline),
            ("MODELFORGE_HEARTBEAT_INTERVAL_SECONDS", interval),
            ("MODELFORGE_TELEMETRY_INTERVAL_SECONDS", self.telemetry_interval_seconds),
        ):
            if value <= 0:
                problems.append(f"{name} must be positive (got {value:g})")
        if offline <= stale:
            problems.append(
                "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS "
                f"({offline:g}) must be greater than MODELFORGE_NODE_STALE_AFTER_SECONDS "
                f"({stale:g})"
            )
        if interval >= stale:
            problems.append(
                f"MODELFORGE_HEARTBEAT_INTERVAL_SECONDS ({interval:g}) must be below "
                f"MODELFORGE_NODE_STALE_AFTER_SECONDS ({stale:g}), or every node would go stale "
                "between two heartbeats"
            )
        if self.job_contact_timeout_seconds <= self.job_progress_interval_seconds:
            problems.append(
                "MODELFORGE_JOB_CONTACT_TIMEOUT_SECONDS "
                f"({self.job_contact_timeout_seconds:g}) must be greater than "
                f"MODELFORGE_JOB_PROGRESS_INTERVAL_SECONDS ({self.job_progress_interval_seconds:g})"
            )
        if self.database_url is not None and not self.database_url.get_secret_value().startswith(
            ("postgresql+psycopg://", "sqlite:///")
        ):
            problems.append(
                "MODELFORGE_DATABASE_URL must start with postgresql+psycopg:// (or sqlite:///)"
            )
        if self.metrics_token is not None and (
            len(self.metrics_token.get_secret_value().strip()) < METRICS_TOKEN_MIN_LENGTH
        ):
            problems.append(
                f"MODELFORGE_METRICS_TOKEN must be at least {METRICS_TOKEN_MIN_LENGTH} characters"
            )
        sweep_interval = self.artifact_sweep_interval_seconds
        if 0 < sweep_interval < MIN_ARTIFACT_SWEEP_INTERVAL_SECONDS:
            problems.append(
                f"MODELFORGE_ARTIFACT_SWEEP_INTERVAL_SECONDS ({sweep_interval:g}) must be 0 (off) "
                f"or at least {MIN_ARTIFACT_SWEEP_INTERVAL_SECONDS:g}: each sweep reads every "
                "artifact row and file"
            )
        peer = self.gateway_peer_address
        if peer and (
            not peer.startswith(("http://", "https://"))
            or peer.rstrip("/").count("/") != 2
            or any(c in peer for c in "?# ")
        ):
            problems.append(
                "MODELFORGE_GATEWAY_PEER_ADDRESS must be http(s)://host:port, the address "
                "other control-plane replicas reach this one at (no path)"
            )
        if peer and self.gateway_front == "native":
            problems.append(
                "MODELFORGE_GATEWAY_FRONT=native cannot be used with "
                "MODELFORGE_GATEWAY_PEER_ADDRESS: the native front does not forward requests to "
                "other control-plane replicas yet; unset MODELFORGE_GATEWAY_FRONT (the gateway "
                "then runs in Python) or the peer address"
            )
        problems.extend(self._oidc_problems())
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append("MODELFORGE_TLS_CERT and MODELFORGE_TLS_KEY must be set together")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _oidc_problems(self) -> list[str]:
        set_any = self.oidc_issuer or self.oidc_client_id or self.oidc_client_secret
        if not set_any:
            return []
        problems = [
            f"{name} must be set for single sign-on"
            for name, value in (
                ("MODELFORGE_OIDC_ISSUER", self.oidc_issuer),
                ("MODELFORGE_OIDC_CLIENT_ID", self.oidc_client_id),
                ("MODELFORGE_OIDC_CLIENT_SECRET", self.oidc_client_secret),
                ("MODELFORGE_PUBLIC_URL (the redirect URL is derived from it)", self.public_url),
            )
            if not value
        ]
        issuer = self.oidc_issuer or ""
        loopback = issuer.startswith(("http://127.0.0.1:", "http://localhost:", "http://[::1]:"))
        if issuer and not (issuer.startswith("https://") or loopback):
            problems.append("MODELFORGE_OIDC_ISSUER must be an https:// URL (http:// on loopback)")
        if "openid" not in self.oidc_scopes.split():
            problems.append("MODELFORGE_OIDC_SCOPES must include openid")
        try:
            self.oidc_role_map  # noqa: B018 - parsed to check it
        except ValueError as exc:
            problems.append(str(exc))
        return problems

    @property
    def oidc_role_map(self) -> dict[str, str]:
        """`oidc_roles` as {group: role}."""
        roles = {"admin", "operator", "member", "viewer"}
        mapped: dict[str, str] = {}
        for pair in filter(None, (p.strip() for p in self.oidc_roles.split(","))):
            group, _, role = pair.rpartition("=")
            if not group.strip() or role.strip() not in roles:
                raise ValueError(
                    "MODELFORGE_OIDC_ROLES must be group=role pairs, comma separated, each role "
                    "one of admin, operator, member, viewer"
                )
            mapped[group.strip()] = role.strip()
        return mapped

    @property
    def oidc_redirect_uri(self) -> str:
        return f"{(self.public_url or '').rstrip('/')}/api/v1/console/oidc/callback"

    @property
    def provisioners_path(self) -> Path:
        return self.provisioners_file or self.data_dir / "provisioners.json"

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url is not None:
            return self.database_url.get_secret_value()
        return f"sqlite:///{(self.data_dir / 'modelforge.db').resolve()}"

    @property
    def is_postgresql(self) -> bool:
        return self.sqlalchemy_url.startswith("postgresql")
