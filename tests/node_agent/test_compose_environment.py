"""The released node-agent Compose file hands the agent's container each resource and idle
variable, with defaults that keep what an agent does with none set; the agent's own settings
read what that container would get. The Compose interpolation (`${NAME:-default}`,
`${NAME:?message}`) is applied here as Compose applies it; the runs with a real Compose and
engine are in tests/e2e_docker."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from node_agent.cli import node_offer, parse_args
from node_agent.config import AgentSettings
from node_agent.inventory import Overrides

COMPOSE = Path(__file__).resolve().parents[2] / "compose" / "docker-compose.node-agent.yml"
VARIABLES = (
    "MODELFORGE_AGENT_PARALLEL",
    "MODELFORGE_AGENT_CPUS",
    "MODELFORGE_AGENT_GPUS",
    "MODELFORGE_AGENT_RAM_MB",
    "MODELFORGE_AGENT_MAX_IDLE_SECONDS",
)
_REFERENCE = re.compile(r"\$\{(?P<name>[A-Z0-9_]+)(?:(?P<op>:-|:\?)(?P<word>[^}]*))?\}")


def _interpolate(value: str, host: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        found = host.get(match["name"], "")
        if match["op"] == ":?" and not found:
            raise AssertionError(f"Compose refuses: {match['word']}")
        return found or (match["word"] if match["op"] == ":-" else "")

    return _REFERENCE.sub(one, value)


def _service(host: dict[str, str]) -> dict[str, Any]:
    """The node-agent service as Compose resolves it with the host's variables `host`."""
    service: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]["node-agent"]
    resolved = {
        name: _interpolate(str(value), host) for name, value in service["environment"].items()
    }
    return {"restart": _interpolate(service["restart"], host), "environment": resolved}


HOST = {"MODELFORGE_AGENT_CONTROL_PLANE_URL": "https://cp.lab.internal:8000"}


@pytest.fixture
def container(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The test process's environment, emptied of every MODELFORGE_ variable."""
    for name in [name for name in os.environ if name.startswith("MODELFORGE_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def _offer_in_container(
    container: pytest.MonkeyPatch, environment: dict[str, str]
) -> tuple[Overrides, int, float]:
    for name, value in environment.items():
        container.setenv(name, value)
    offer = node_offer(parse_args([]), AgentSettings())  # type: ignore[call-arg]
    return offer.overrides, offer.parallel, offer.max_idle_seconds


def test_every_variable_reaches_the_agents_container() -> None:
    host = {**HOST, **{name: f"{index + 2}" for index, name in enumerate(VARIABLES)}}
    environment = _service(host)["environment"]
    assert {name: environment[name] for name in VARIABLES} == {
        name: host[name] for name in VARIABLES
    }


def test_unset_on_the_host_the_agent_does_what_it_does_with_none_set(
    container: pytest.MonkeyPatch,
) -> None:
    service = _service(HOST)
    assert service["restart"] == "unless-stopped"
    assert _offer_in_container(container, service["environment"]) == (Overrides(), 1, 0.0)


def test_set_on_the_host_the_agent_offers_what_they_say(container: pytest.MonkeyPatch) -> None:
    host = {
        **HOST,
        "MODELFORGE_AGENT_PARALLEL": "3",
        "MODELFORGE_AGENT_CPUS": "12",
        "MODELFORGE_AGENT_GPUS": "0",
        "MODELFORGE_AGENT_RAM_MB": "65536",
        "MODELFORGE_AGENT_MAX_IDLE_SECONDS": "900",
        "MODELFORGE_AGENT_RESTART": "on-failure",
    }
    service = _service(host)
    assert service["restart"] == "on-failure"  # an idle exit then stays stopped
    assert _offer_in_container(container, service["environment"]) == (
        Overrides(cpus=12, ram_mb=65536, gpus_variable=0),
        3,
        900.0,
    )
