"""Agent configuration from `MODELFORGE_AGENT_*` environment variables, validated at start.

Refused with a specific message: placeholder (example-domain) URLs, plain `http://` to anything
but loopback unless explicitly allowed, a CA file that does not exist. The enrollment token is a
secret: it never appears in `repr()` or logs.
"""

from __future__ import annotations

import grp
import ipaddress
import re
import socket
import tempfile
from pathlib import Path
from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from modelforge_contracts.addresses import is_loopback_host

DEFAULT_WORKER_SOCKET = Path("/run/modelforge/runtime-worker.sock")
DEFAULT_AGENT_SOCKET = Path("/run/modelforge/agent.sock")
_PLACEHOLDER_SUFFIXES = (".example", ".invalid", ".localdomain.example")
#: Each work slot holds a long-poll connection and a thread.
_MAX_PARALLEL = 256
#: As many as an inventory may list.
_MAX_GPUS = 64


class PreflightSettings(BaseSettings):
    """All `--preflight` needs: it runs without network and without a control plane URL."""

    # Empty variables count as unset: Compose passes `${VAR:-}` through as "".
    model_config = SettingsConfigDict(
        env_prefix="MODELFORGE_AGENT_", extra="ignore", env_ignore_empty=True
    )

    accelerator_mode: Literal["nvidia", "cpu", "auto"] = "nvidia"
    preflight_timeout_seconds: float = Field(default=10.0, gt=0, le=120)
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class AgentSettings(PreflightSettings):
    """The agent's settings, each from `MODELFORGE_AGENT_<NAME>` (the artifact cache's from
    `MODELFORGE_ARTIFACT_CACHE*`).

    `service_host` (`MODELFORGE_AGENT_SERVICE_HOST`, optional): turns on direct access to the
    replicas this node runs, naming the host name or IP address at which others reach them: they
    listen on every interface and the control plane builds each replica's URL from it and the
    replica's port. Unset (the default), replicas listen on 127.0.0.1 only and are reached
    through the gateway (the agent's tunnel). Only a host: no scheme, no port, no path, no
    spaces (an IPv6 address may be given bare or in brackets).
    """

    control_plane_url: str
    enrollment_token: SecretStr | None = None
    enrollment_token_file: Path | None = None
    hostname: str = Field(default_factory=socket.gethostname, min_length=1, max_length=255)
    tls_verify: bool = True
    ca_cert_path: Path | None = None
    allow_insecure_http: bool = False
    state_volume: Path = Path("/var/lib/modelforge/agent")
    identity_mode: Literal["persisted"] = "persisted"
    worker_socket: Path = DEFAULT_WORKER_SOCKET
    #: Where job code on this node reaches the agent (artifact helpers).
    socket: Path = DEFAULT_AGENT_SOCKET
    #: With the runtime worker under a user of its own: the group that may use that socket.
    socket_group: str | None = None
    artifact_cache: Path = Field(
        default_factory=lambda: Path(tempfile.gettempdir()) / "modelforge-artifacts",
        validation_alias="MODELFORGE_ARTIFACT_CACHE",
    )
    artifact_cache_bytes: int = Field(
        default=1024**3, ge=0, validation_alias="MODELFORGE_ARTIFACT_CACHE_BYTES"
    )
    request_timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    service_host: str | None = None
    # What the node offers and how long it stays idle. A command-line flag (`--parallel`,
    # `--cpus`, `--gpus`, `--ram-mb`, `--max-idle-seconds`) overrides each (node_agent.cli).
    #: Jobs run at once: one work slot (a held claim) each.
    parallel: int = Field(default=1, ge=1, le=_MAX_PARALLEL)
    #: CPUs offered, over what is detected (the host, or the Slurm allocation).
    cpus: int | None = Field(default=None, ge=1, le=100_000)
    #: At most this many GPUs offered; 0: none. Below SLURM_GPUS_ON_NODE in the detection
    #: order (node_agent.inventory.offered_gpus).
    gpus: int | None = Field(default=None, ge=0, le=_MAX_GPUS)
    #: Memory offered (MB), over what is detected (the host, or the Slurm allocation).
    ram_mb: int | None = Field(default=None, ge=1)
    #: Exit (code 0) after this long with no job or service; 0: never.
    max_idle_seconds: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    #: The interpreter Python jobs run under (node_agent.job_python checks it at start; a
    #: `--python` flag overrides it); unset: the runtime worker's own.
    python: Path | None = None
    #: Where the agent uploads and downloads artifacts: an artifact host serving them near
    #: their storage (`modelforge-control-plane --artifacts-only`, docs/artifacts.md), with the
    #: same credential, TLS settings and rules for plain http:// as the control plane's URL (an
    #: `--artifact-url` flag overrides it); unset: the control plane itself.
    artifact_url: str | None = None
    #: How often the GPU health watch polls each GPU's ECC, remapping, lost and throttle state
    #: (XID events come at once, whatever this is).
    gpu_health_poll_seconds: float = Field(default=5.0, ge=0.1, le=300)

    @model_validator(mode="after")
    def _check(self) -> Self:
        problems = url_problems(self.control_plane_url, self.allow_insecure_http)
        if self.artifact_url is not None:
            problems += url_problems(
                self.artifact_url, self.allow_insecure_http, "MODELFORGE_AGENT_ARTIFACT_URL"
            )
        if self.service_host is not None:
            problems += _service_host_problems(self.service_host)
        if self.ca_cert_path is not None and not self.ca_cert_path.is_file():
            problems.append(
                f"MODELFORGE_AGENT_CA_CERT_PATH: {self.ca_cert_path} is not a readable file"
            )
        if self.ca_cert_path is not None and not self.tls_verify:
            problems.append(
                "MODELFORGE_AGENT_CA_CERT_PATH is set but MODELFORGE_AGENT_TLS_VERIFY=false would "
                "ignore it; keep verification on and trust the private CA instead"
            )
        if self.socket_group is not None and group_id(self.socket_group) is None:
            problems.append(
                f"MODELFORGE_AGENT_SOCKET_GROUP: no group {self.socket_group!r} on this host; "
                "create it (see docs/nodes.md, separate users) or unset the variable"
            )
        if problems:
            raise ValueError("; ".join(problems))
        self.control_plane_url = self.control_plane_url.rstrip("/")
        if self.artifact_url is not None:
            self.artifact_url = self.artifact_url.rstrip("/")
        return self

    def read_enrollment_token(self) -> str | None:
        if self.enrollment_token is not None:
            return self.enrollment_token.get_secret_value().strip() or None
        if self.enrollment_token_file is not None:
            try:
                return self.enrollment_token_file.read_text().strip() or None
            except OSError as exc:
                raise ConfigError(
                    f"MODELFORGE_AGENT_ENROLLMENT_TOKEN_FILE: cannot read "
                    f"{self.enrollment_token_file} ({exc.strerror})"
                ) from None
        return None


def group_id(group: str) -> int | None:
    """The id of `group` (a name or a number), None when this host has no such group."""
    try:
        return (
            grp.getgrnam(group).gr_gid if not group.isdigit() else grp.getgrgid(int(group)).gr_gid
        )
    except KeyError:
        return None


class ConfigError(Exception):
    """A configuration the agent cannot start with; the message names the variable."""


def url_problems(
    url: str, allow_insecure_http: bool, name: str = "MODELFORGE_AGENT_CONTROL_PLANE_URL"
) -> list[str]:
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        return [f"{name} must be an https:// URL (got {url!r})"]
    host = parts.hostname.lower()
    labels = host.split(".")
    if (
        "example" in labels
        or host.endswith(_PLACEHOLDER_SUFFIXES)
        or host in {"example.com", "example.org", "example.net"}
    ):
        return [f"{name} points at a placeholder host ({host}); set it to a real address"]
    if parts.scheme == "http" and not allow_insecure_http and not is_loopback_host(host):
        return [
            f"{name} uses plain http:// to {host}, which is not loopback; use https:// (see "
            "MODELFORGE_AGENT_CA_CERT_PATH for a private CA) or set "
            "MODELFORGE_AGENT_ALLOW_INSECURE_HTTP=true on a trusted network"
        ]
    return []


_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _service_host_problems(host: str) -> list[str]:
    name = "MODELFORGE_AGENT_SERVICE_HOST"
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        address = None
    if address is not None and "%" not in bare and (bare == host or address.version == 6):
        return []
    labels = host.split(".")
    if len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels):
        return []
    if "://" in host:
        why = "a URL; give only the host, without the scheme"
    elif any(character.isspace() for character in host):
        why = "not a host name: it holds spaces"
    elif ":" in host:
        why = "not a host name: give it without a port (the port is the service's own)"
    elif "/" in host:
        why = "not a host name: give it without a path"
    else:
        why = "not a host name or an IP address"
    return [f"{name}: {host[:80]!r} is {why}, e.g. gpu-box.lan or 192.0.2.10"]
