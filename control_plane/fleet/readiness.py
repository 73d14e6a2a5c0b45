"""Node readiness: a node is ready only when every check passes, never merely because it
connected. Each check says pass/fail/unknown and what the operator should do next."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from control_plane.errors import ProtocolIncompatible
from control_plane.fleet.compatibility import judge_protocol
from control_plane.fleet.liveness import Liveness
from control_plane.fleet.nodes import get_node, node_views
from control_plane.fleet.schemas import NodePublic, Readiness, ReadinessCheck


def _check(name: str, status: str, detail: str, next_step: str = "") -> ReadinessCheck:
    return ReadinessCheck.model_validate(
        {"name": name, "status": status, "detail": detail, "next_step": next_step or "None."}
    )


def _age(since: datetime | None, now: datetime) -> str:
    return "never" if since is None else f"{max(0.0, (now - since).total_seconds()):.0f} s ago"


def node_readiness(
    *,
    session: Session,
    node_id: str,
    now: datetime,
    liveness: Liveness,
    telemetry_max_age: timedelta,
    inventory_max_age: timedelta,
) -> Readiness:
    """The readiness of a stored node, judged from the view the API shows of it."""
    node = get_node(session=session, node_id=node_id)
    view = node_views(session=session, nodes=[node], now=now, liveness=liveness)[0]
    return assess_readiness(
        view,
        now=now,
        stale_after=liveness.thresholds.stale_after,
        telemetry_max_age=telemetry_max_age,
        inventory_max_age=inventory_max_age,
    )


def assess_readiness(
    node: NodePublic,
    *,
    now: datetime,
    stale_after: timedelta,
    telemetry_max_age: timedelta,
    inventory_max_age: timedelta,
) -> Readiness:
    checks = [
        _connected(node, now, stale_after),
        _inventory(node, now, inventory_max_age),
        _protocol(node),
        _agent_health(node),
        _telemetry(node, now, telemetry_max_age),
    ]
    return Readiness(
        node_id=node.node_id, ready=all(c.status == "pass" for c in checks), checks=checks
    )


def _connected(node: NodePublic, now: datetime, stale_after: timedelta) -> ReadinessCheck:
    if node.last_heartbeat_at is None:
        return _check(
            "connected",
            "fail",
            "No heartbeat has been received from this node.",
            "Start the node agent with this node's enrollment token and check its log for "
            "connection errors.",
        )
    if node.state != "online":
        return _check(
            "connected",
            "fail",
            f"Last heartbeat {_age(node.last_heartbeat_at, now)} (stale after "
            f"{stale_after.total_seconds():g} s); the node is {node.state}.",
            "Check that the agent is running and can reach the control plane URL.",
        )
    return _check("connected", "pass", f"Last heartbeat {_age(node.last_heartbeat_at, now)}.")


def _inventory(node: NodePublic, now: datetime, max_age: timedelta) -> ReadinessCheck:
    if node.inventory is None or node.inventory_at is None:
        return _check(
            "inventory",
            "fail",
            "The agent has not reported its inventory yet.",
            "Wait for the agent to finish starting; if this persists, check the agent log for "
            "errors on PUT /api/v1/agent/inventory.",
        )
    if now - node.inventory_at > max_age:
        # Agents resend it well within this bound, changed or not: it is old only when the
        # agent stopped reporting it (its inventory loop fails, or an old agent runs).
        return _check(
            "inventory",
            "fail",
            f"Inventory reported {_age(node.inventory_at, now)}; it must be newer than "
            f"{max_age.total_seconds():g} s (MODELFORGE_INVENTORY_MAX_AGE_SECONDS).",
            "Check the agent log for errors on PUT /api/v1/agent/inventory, and that the agent "
            "runs this control plane's release; restarting the agent sends it again.",
        )
    return _check("inventory", "pass", f"Inventory reported {_age(node.inventory_at, now)}.")


def _protocol(node: NodePublic) -> ReadinessCheck:
    if node.needs_upgrade is not None:
        return _check(
            "protocol",
            "fail",
            f"The {node.needs_upgrade.component} was refused: {node.needs_upgrade.code}.",
            node.needs_upgrade.detail,
        )
    if node.protocol_version is None:
        return _check(
            "protocol",
            "unknown",
            "The agent has not reported a protocol version.",
            "Wait for the first heartbeat.",
        )
    worker = (node.inventory or {}).get("runtime_worker")
    if worker is None:
        return _check(
            "protocol",
            "fail" if node.inventory is not None else "unknown",
            "No runtime worker is reported by the agent.",
            "Start the runtime worker next to the agent "
            "(compose/docker-compose.runtime-worker.yml) "
            "and check that the agent can reach it.",
        )
    try:
        worker_protocol = judge_protocol(worker.get("protocol_version"), component="runtime-worker")
    except ProtocolIncompatible as refusal:
        return _check("protocol", "fail", refusal.message, refusal.next_step)
    return _check(
        "protocol",
        "pass",
        f"Agent protocol {node.protocol_version}, runtime worker protocol {worker_protocol}.",
    )


def _agent_health(node: NodePublic) -> ReadinessCheck:
    health = node.health
    if health is None:
        return _check(
            "agent_health",
            "unknown",
            "The agent has not reported its health yet.",
            "Wait for the first heartbeat.",
        )
    if health.get("preflight") != "passed":
        return _check(
            "agent_health",
            "fail",
            f"Preflight {health.get('preflight')}.",
            "Run `python3 -m node_agent --preflight` on the node and fix what it reports.",
        )
    if health.get("status") != "healthy":
        message = health.get("message") or "no detail"
        return _check(
            "agent_health",
            "fail",
            f"The agent reports {health.get('status')}: {message}.",
            "Read the agent log on the node for the cause.",
        )
    return _check("agent_health", "pass", "Preflight passed and the agent reports healthy.")


def _telemetry(node: NodePublic, now: datetime, max_age: timedelta) -> ReadinessCheck:
    mode = (node.inventory or {}).get("accelerator_mode")
    fresh = node.telemetry_at is not None and now - node.telemetry_at <= max_age
    if mode is None:
        return _check(
            "telemetry",
            "unknown",
            "The accelerator mode is not known yet.",
            "Wait for the agent's inventory.",
        )
    if mode == "cpu":
        return _check(
            "telemetry",
            "pass",
            f"Not required in cpu mode (last telemetry {_age(node.telemetry_at, now)}).",
        )
    if not fresh:
        return _check(
            "telemetry",
            "fail",
            f"GPU telemetry last received {_age(node.telemetry_at, now)}; nvidia mode requires "
            f"it within {max_age.total_seconds():g} s.",
            "Run `python3 -m node_agent --preflight` on the node; check that NVML works inside "
            "the container (NVIDIA Container Toolkit).",
        )
    return _check("telemetry", "pass", f"GPU telemetry received {_age(node.telemetry_at, now)}.")
