"""Rules of the released Compose files that their text shows, read as YAML (no Docker engine):
no image is referenced as `latest` or without a tag (docs/release.md: exact tag or digest, the
fallback tag `local`), and every setting of the node agent either reaches its container through
the agent's Compose files or is left out for a reason named here. tests/e2e_docker resolves the
files with Compose itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]

from node_agent.config import AgentSettings

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
FILES = sorted(COMPOSE.glob("*.yml"))
#: `${VARIABLE:-fallback}` (or `-fallback`); the reference Compose uses when it is unset.
_SUBSTITUTED = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-(?P<fallback>[^}]*)\}")


def image_problem(reference: str) -> str | None:
    """What breaks the rule in an `image:` value, or None: its fallback (or the value itself)
    must name an exact tag other than `latest`, or a digest."""
    substituted = _SUBSTITUTED.fullmatch(reference)
    if "${" in reference and substituted is None:
        return f"{reference!r} has no fallback: Compose would use an empty image name"
    image = substituted.group("fallback") if substituted else reference
    if "@sha256:" in image:
        return None
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return f"{reference!r} names no tag: Compose would pull `latest`"
    if tag == "latest":
        return f"{reference!r} uses the tag `latest`"
    return None


def _images() -> list[tuple[str, str]]:
    found = []
    for path in FILES:
        for name, service in (yaml.safe_load(path.read_text()).get("services") or {}).items():
            if "image" in service:
                found.append((f"{path.name}: {name}", str(service["image"])))
    return found


def test_the_compose_files_are_read() -> None:
    assert {path.name for path in FILES} >= {
        "docker-compose.yml",
        "docker-compose.node-agent.yml",
        "docker-compose.runtime-worker.yml",
    }
    assert len(_images()) >= 4  # control plane, PostgreSQL, node agent, runtime worker


@pytest.mark.parametrize(("where", "reference"), _images())
def test_no_compose_file_uses_latest_or_an_untagged_image(where: str, reference: str) -> None:
    assert image_problem(reference) is None, where


@pytest.mark.parametrize(
    "reference",
    [
        "postgres",
        "postgres:latest",
        "registry.lan:5000/modelforge-node-agent",
        "${MODELFORGE_NODE_AGENT_IMAGE:-modelforge-node-agent:latest}",
        "${MODELFORGE_NODE_AGENT_IMAGE:-modelforge-node-agent}",
        "${MODELFORGE_NODE_AGENT_IMAGE}",
    ],
)
def test_the_rule_catches_latest_and_untagged_references(reference: str) -> None:
    assert image_problem(reference) is not None


@pytest.mark.parametrize(
    "reference",
    [
        "${MODELFORGE_NODE_AGENT_IMAGE:-modelforge-node-agent:local}",
        "registry.lan:5000/modelforge-node-agent:0.1.0",
        "postgres@sha256:" + "0" * 64,
    ],
)
def test_the_rule_lets_an_exact_tag_or_a_digest_pass(reference: str) -> None:
    assert image_problem(reference) is None


#: The node agent's files: the agent's own and the overlays that add to its service.
AGENT_FILES = [
    "docker-compose.node-agent.yml",
    "docker-compose.node-agent.private-ca.yml",
    "docker-compose.services.yml",
    "docker-compose.gpu.yml",
]
#: Agent settings its Compose files do not pass, and why.
LEFT_OUT = {
    # The token arrives as MODELFORGE_AGENT_ENROLLMENT_TOKEN from a temporary --env-file.
    "MODELFORGE_AGENT_ENROLLMENT_TOKEN_FILE": "the token variable is passed instead",
    # Agent and worker share a socket volume but no user: the worker's socket group is its own.
    "MODELFORGE_AGENT_SOCKET_GROUP": "the containers run under one uid (10001)",
    # The agent checks the path in its own container, which is not the worker's.
    "MODELFORGE_AGENT_PYTHON": "jobs get their packages through the worker's image",
    "MODELFORGE_AGENT_PREFLIGHT_TIMEOUT_SECONDS": "tuning with a working default",
    "MODELFORGE_AGENT_REQUEST_TIMEOUT_SECONDS": "tuning with a working default",
    "MODELFORGE_AGENT_GPU_HEALTH_POLL_SECONDS": "tuning with a working default",
}


def _setting_names() -> set[str]:
    names = set()
    for name, field in AgentSettings.model_fields.items():
        alias = field.validation_alias
        names.add(alias if isinstance(alias, str) else f"MODELFORGE_AGENT_{name.upper()}")
    return names


def _passed_to_the_agent() -> set[str]:
    passed: set[str] = set()
    for file in AGENT_FILES:
        services = yaml.safe_load((COMPOSE / file).read_text())["services"]
        environment = (services.get("node-agent") or {}).get("environment") or {}
        passed.update(environment)
    return passed


def test_every_agent_setting_reaches_its_container_or_is_left_out_for_a_reason() -> None:
    settings = _setting_names()
    assert "MODELFORGE_AGENT_ALLOW_INSECURE_HTTP" in settings  # the names are read right
    assert settings - _passed_to_the_agent() == set(LEFT_OUT)
