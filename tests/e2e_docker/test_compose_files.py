"""The released node-agent Compose files as Compose itself resolves them (`config`, no engine
needed): the resource and idle variables, the insecure-HTTP opt-in and the log level reach the
agent's container with the defaults of an agent that has none set, and the private-CA overlay
mounts the CA, points the agent at it and maps the control plane's name to the address given
(`MODELFORGE_AGENT_CONTROL_PLANE_HOST[_ADDRESS]`), refusing to resolve without the CA. Rules a
file's text shows without Compose (no `latest` image, every agent setting accounted for) are
tests/release/test_compose_rules.py's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from release.docker import compose_command

pytestmark = pytest.mark.e2e

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
AGENT = COMPOSE / "docker-compose.node-agent.yml"
PRIVATE_CA = COMPOSE / "docker-compose.node-agent.private-ca.yml"
URL = "https://cp.lab.internal:8000"


def _config(files: list[Path], **host: str) -> subprocess.CompletedProcess[str]:
    """`compose config` of `files` with exactly `host`'s MODELFORGE_ variables set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODELFORGE_", "COMPOSE_"))}
    env.update(host)
    command = [*compose_command(), "-p", "mfcompose"]
    for path in files:
        command += ["-f", str(path)]
    return subprocess.run(
        [*command, "config"], env=env, capture_output=True, text=True, check=False
    )


def _agent(files: list[Path], **host: str) -> dict[str, Any]:
    result = _config(files, MODELFORGE_AGENT_CONTROL_PLANE_URL=URL, **host)
    assert result.returncode == 0, result.stderr
    service: dict[str, Any] = yaml.safe_load(result.stdout)["services"]["node-agent"]
    return service


def _environment(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):  # Compose v1 may print NAME=value items
        raw = dict(item.split("=", 1) for item in raw)
    return {str(k): "" if v is None else str(v) for k, v in raw.items()}


VARIABLES = {
    "MODELFORGE_AGENT_PARALLEL": "3",
    "MODELFORGE_AGENT_CPUS": "12",
    "MODELFORGE_AGENT_GPUS": "0",
    "MODELFORGE_AGENT_RAM_MB": "65536",
    "MODELFORGE_AGENT_MAX_IDLE_SECONDS": "900",
}


def test_unset_the_variables_resolve_to_an_agent_with_none_set() -> None:
    service = _agent([AGENT])
    environment = _environment(service)
    assert {name: environment[name] for name in VARIABLES} == {
        "MODELFORGE_AGENT_PARALLEL": "1",
        "MODELFORGE_AGENT_CPUS": "",  # empty counts as unset: detected
        "MODELFORGE_AGENT_GPUS": "",
        "MODELFORGE_AGENT_RAM_MB": "",
        "MODELFORGE_AGENT_MAX_IDLE_SECONDS": "0",
    }
    assert service["restart"] == "unless-stopped"


def test_set_on_the_host_the_variables_reach_the_agents_container() -> None:
    service = _agent([AGENT], **VARIABLES, MODELFORGE_AGENT_RESTART="on-failure")
    environment = _environment(service)
    assert {name: environment[name] for name in VARIABLES} == VARIABLES
    assert service["restart"] == "on-failure"


#: Each with the value of an agent that has none set.
LOGGING_AND_TRANSPORT = {
    "MODELFORGE_AGENT_ALLOW_INSECURE_HTTP": "false",
    "MODELFORGE_AGENT_LOG_LEVEL": "info",
}


def test_the_insecure_opt_in_and_the_log_level_default_as_the_agents_own() -> None:
    environment = _environment(_agent([AGENT]))
    assert {name: environment[name] for name in LOGGING_AND_TRANSPORT} == LOGGING_AND_TRANSPORT


def test_the_insecure_opt_in_and_the_log_level_set_on_the_host_reach_the_agent() -> None:
    host = {
        "MODELFORGE_AGENT_ALLOW_INSECURE_HTTP": "true",
        "MODELFORGE_AGENT_LOG_LEVEL": "debug",
    }
    environment = _environment(_agent([AGENT], **host))
    assert {name: environment[name] for name in host} == host


def _extra_hosts(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("extra_hosts") or []
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    pairs = {}
    for item in raw:  # "name:address" (v1, older v2) or "name=address" (newer v2)
        name, _, address = str(item).replace("=", ":", 1).partition(":")
        pairs[name] = address
    return pairs


def test_the_private_ca_overlay_mounts_the_ca_and_maps_the_control_planes_name(
    tmp_path: Path,
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    service = _agent(
        [AGENT, PRIVATE_CA],
        MODELFORGE_AGENT_CA_CERT_PATH=str(ca),
        MODELFORGE_AGENT_CONTROL_PLANE_HOST="cp.lab.internal",
        MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS="192.0.2.10",
    )
    assert _environment(service)["MODELFORGE_AGENT_CA_CERT_PATH"] == "/etc/modelforge/ca.pem"
    assert _extra_hosts(service) == {"cp.lab.internal": "192.0.2.10"}
    mounts = [
        volume
        for volume in service["volumes"]
        if (volume.get("target") if isinstance(volume, dict) else volume.split(":")[1])
        == "/etc/modelforge/ca.pem"
    ]
    (mount,) = mounts
    if isinstance(mount, dict):
        assert (mount["source"], mount.get("read_only")) == (str(ca), True)
    else:
        assert mount == f"{ca}:/etc/modelforge/ca.pem:ro"


def test_the_overlay_without_the_name_maps_nothing_real(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    service = _agent([AGENT, PRIVATE_CA], MODELFORGE_AGENT_CA_CERT_PATH=str(ca))
    assert _extra_hosts(service) == {"control-plane.invalid": "127.0.0.1"}


def test_the_overlay_refuses_to_resolve_without_the_ca() -> None:
    result = _config([AGENT, PRIVATE_CA], MODELFORGE_AGENT_CONTROL_PLANE_URL=URL)
    assert result.returncode != 0
    assert "set MODELFORGE_AGENT_CA_CERT_PATH to the CA file on the host" in result.stderr
