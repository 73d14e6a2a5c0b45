"""`provisioners.json` (PV-1a): the clusters the control plane may start node agents on.

Validated when the control plane starts: any error names the file, the JSON path of the value
and the fix, and the control plane refuses to start. Example:

    [{"type": "slurm", "name": "hpc", "login": "modelforge@login.hpc.example:22",
      "ssh_key": "/var/lib/modelforge/hpc_ed25519",
      "known_hosts": "/var/lib/modelforge/hpc_known_hosts",
      "engine_url": "https://cp.internal:8000", "max_idle_s": 600, "provision_timeout_s": 600,
      "profiles": [{"name": "a100", "cpus": 8, "gpus": 1, "ram_mb": 64000,
                    "labels": {"site": "hpc", "gpu": "a100"},
                    "sbatch": ["--partition=gpu"], "prerun": ["module load cuda"]}]}]
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from control_plane.schemas import Labels, Line
from modelforge_contracts.addresses import ip_address_of, is_loopback_host

FILE_NAME = "provisioners.json"
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")]
_LOGIN = re.compile(
    r"^(?P<user>[a-z_][a-z0-9_.-]{0,31})@(?P<host>[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]+\])(?::(?P<port>[0-9]{1,5}))?$"
)
#: sbatch options this control plane sets itself, or that would run something else.
_RESERVED_SBATCH = ("--wrap", "--job-name", "-J", "--output", "-o", "--error", "-e", "--parsable")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Profile(_Strict):
    name: Name
    cpus: Annotated[int, Field(ge=1, le=4096)]
    gpus: Annotated[int, Field(ge=0, le=64)] = 0
    ram_mb: Annotated[int, Field(ge=1, le=16_000_000)]
    labels: Labels = Field(default_factory=dict)
    sbatch: Annotated[
        list[Annotated[Line, StringConstraints(min_length=2, max_length=200)]], Field(max_length=50)
    ] = Field(default_factory=list)
    prerun: Annotated[
        list[Annotated[Line, StringConstraints(max_length=1000)]], Field(max_length=100)
    ] = Field(default_factory=list)

    @field_validator("sbatch")
    @classmethod
    def _options(cls, options: list[str]) -> list[str]:
        for option in options:
            if not option.startswith("-"):
                raise ValueError(f"{option!r} is not an sbatch option (options start with -)")
            if option.split("=", 1)[0] in _RESERVED_SBATCH:
                raise ValueError(
                    f"{option.split('=', 1)[0]} is set by ModelForge itself; remove it"
                )
        return options


class SlurmProvisioner(_Strict):
    type: Literal["slurm"]
    name: Name
    login: Annotated[str, StringConstraints(max_length=300)]
    ssh_key: Path
    known_hosts: Path
    engine_url: Annotated[str, StringConstraints(pattern=r"^https?://[^\s/]+(:[0-9]+)?/?$")]
    max_idle_s: Annotated[float, Field(ge=0, le=7 * 86400)] = 600
    provision_timeout_s: Annotated[float, Field(ge=0, le=7 * 86400)] = 600
    #: A trusted LAN: the agents it starts may reach `engine_url` over plain `http://` at a
    #: private address (the agent's MODELFORGE_AGENT_ALLOW_INSECURE_HTTP). Their credential then
    #: crosses that network unencrypted; loopback needs no opt-in.
    allow_insecure_http: bool = False
    profiles: Annotated[list[Profile], Field(min_length=1, max_length=100)]

    @model_validator(mode="after")
    def _plain_http(self) -> SlurmProvisioner:
        parts = urlsplit(self.engine_url)
        if parts.scheme != "http":
            if self.allow_insecure_http:
                raise ValueError(
                    "allow_insecure_http is for an http:// engine_url; this one is https://: "
                    "remove allow_insecure_http"
                )
            return self
        if is_loopback_host(parts.hostname or ""):
            return self
        address = ip_address_of(parts.hostname or "")
        if not self.allow_insecure_http:
            raise ValueError(
                f"engine_url {self.engine_url} is plain http:// beyond this host: the agents "
                "would refuse it (their credential would cross the network unencrypted). Use "
                "https://, or on a trusted LAN set allow_insecure_http: true with the control "
                "plane's private IP address"
            )
        if address is None or not address.is_private or address.is_unspecified:
            raise ValueError(
                f"allow_insecure_http needs engine_url at a private IP address (10/8, "
                f"172.16/12, 192.168/16, fc00::/7, link-local), not {parts.hostname!r}: a name "
                "or a public address may lead anywhere. Use the address itself, or https://"
            )
        return self

    @field_validator("login")
    @classmethod
    def _login(cls, login: str) -> str:
        match = _LOGIN.fullmatch(login)
        if match is None or (match["port"] and not 0 < int(match["port"]) < 65536):
            raise ValueError("must be user@host or user@host:port")
        return login

    @field_validator("ssh_key", "known_hosts")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        if not path.is_absolute():
            raise ValueError("must be an absolute path")
        return path

    @property
    def user(self) -> str:
        return login_parts(self.login)[0]

    @property
    def host(self) -> str:
        return login_parts(self.login)[1]

    @property
    def port(self) -> int:
        return login_parts(self.login)[2]


def login_parts(login: str) -> tuple[str, str, int]:
    match = _LOGIN.fullmatch(login)
    if match is None:
        raise ValueError(login)
    return match["user"], match["host"].strip("[]"), int(match["port"] or 22)


class ProvisionersError(Exception):
    """`provisioners.json` is invalid; the message names the file, the JSON path and the fix."""


def load_provisioners(path: Path) -> list[SlurmProvisioner]:
    """The provisioners of `path`; none when the file does not exist."""
    if not path.exists():
        return []
    try:
        data: Any = json.loads(path.read_text())
    except OSError as exc:
        raise ProvisionersError(f"{path}: cannot be read ({exc.strerror})") from None
    except ValueError as exc:
        raise ProvisionersError(f"{path}: not valid JSON ({exc}); fix the syntax") from None
    if not isinstance(data, list):
        raise ProvisionersError(
            f'{path}: $ must be a list of provisioners ([{{"type": "slurm", …}}])'
        )
    provisioners = []
    for index, item in enumerate(data):
        try:
            provisioners.append(SlurmProvisioner.model_validate(item))
        except ValidationError as exc:
            raise ProvisionersError(_describe(path, index, exc)) from None
    problems = []
    names = [p.name for p in provisioners]
    for index, provisioner in enumerate(provisioners):
        if names.count(provisioner.name) > 1:
            problems.append(
                f"$[{index}].name: {provisioner.name!r} is used twice; names must be unique"
            )
        profiles = [profile.name for profile in provisioner.profiles]
        for number, profile in enumerate(provisioner.profiles):
            if profiles.count(profile.name) > 1:
                problems.append(
                    f"$[{index}].profiles[{number}].name: {profile.name!r} is used twice in "
                    f"provisioner {provisioner.name!r}; names must be unique"
                )
        for field in ("ssh_key", "known_hosts"):
            if not getattr(provisioner, field).is_file():
                problems.append(
                    f"$[{index}].{field}: {getattr(provisioner, field)} does not exist or is not "
                    "a file; put it there (readable by the control plane only)"
                )
    if problems:
        raise ProvisionersError(f"{path}: " + "; ".join(dict.fromkeys(problems)))
    return provisioners


def _describe(path: Path, index: int, exc: ValidationError) -> str:
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        where = "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]
        )
        kind = error["type"]
        if kind == "missing":
            fix = "add it"
        elif kind == "extra_forbidden":
            fix = "remove it: not a known key (check its spelling)"
        else:
            fix = error["msg"][0].lower() + error["msg"][1:]
        problems.append(f"$[{index}]{where}: {fix}")
    return f"{path}: " + "; ".join(problems)
