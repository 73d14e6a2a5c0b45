"""The released Compose files of a node that runs services (`docker-compose.services.yml` after
the agent's and the runtime worker's), merged as Compose merges them (a later file's keys
replace an earlier one's; mappings merge): the runtime worker and the node agent share the
host's network, since the agent forwards the gateway's requests to 127.0.0.1:<the port the worker
reported> and a service is there only in the worker's network; neither publishes a port; a node
that only runs jobs keeps its worker off every network. Read as YAML: no Docker engine needed
(tests/e2e_docker resolves the files with Compose itself)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from node_agent.tunnel import NativeTunnel

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
NODE = [COMPOSE / "docker-compose.node-agent.yml", COMPOSE / "docker-compose.runtime-worker.yml"]
SERVICES = COMPOSE / "docker-compose.services.yml"


def _merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _services(files: list[Path]) -> dict[str, Any]:
    resolved: dict[str, Any] = {}
    for path in files:
        resolved = _merge(resolved, yaml.safe_load(path.read_text()))
    services: dict[str, Any] = resolved["services"]
    return services


def test_a_service_node_puts_the_agent_in_the_workers_network() -> None:
    services = _services([*NODE, SERVICES])
    worker, agent = services["runtime-worker"], services["node-agent"]
    assert worker["network_mode"] == "host"
    # The tunnel's requests go to the loopback of the agent's own network: the worker's only
    # when both are in the host's.
    local = inspect.signature(NativeTunnel).parameters["local_host"].default
    assert local == "127.0.0.1"
    assert agent.get("network_mode") == worker["network_mode"]
    assert "networks" not in agent and "networks" not in worker
    # Nothing published: the agent stays outbound only; services listen on their own.
    assert "ports" not in agent and "ports" not in worker
    assert "MODELFORGE_AGENT_SERVICE_HOST" in agent["environment"]
    # The overlay changes the network only: the shared socket and cache volumes are kept.
    assert agent["volumes"] == _services(NODE)["node-agent"]["volumes"]


def test_a_node_that_only_runs_jobs_keeps_its_worker_off_every_network() -> None:
    services = _services(NODE)
    assert services["runtime-worker"]["network_mode"] == "none"
    assert "network_mode" not in services["node-agent"]  # its bridge: outbound to the CP
