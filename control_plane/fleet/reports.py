"""What agents report besides heartbeats: inventory, telemetry, and compatibility
refusals recorded against the node so that it shows as Needs upgrade."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.db import rowcount
from control_plane.errors import ProtocolIncompatible
from control_plane.fleet.nodes import get_node, record_event
from control_plane.fleet.schemas import GpuPoint, TelemetryPoint
from control_plane.models import Node, TelemetrySample


def record_incompatibility(
    *, session: Session, clock: Clock, node_id: str, refusal: ProtocolIncompatible
) -> None:
    node = session.get(Node, node_id)
    if node is None:
        return
    if node.compat_code != refusal.code or node.compat_component != refusal.component:
        record_event(
            session,
            node_id=node_id,
            at=clock.now(),
            kind="needs_upgrade",
            reason=f"{refusal.code}: {refusal.message}",
        )
    node.compat_code = refusal.code
    node.compat_component = refusal.component
    node.compat_detail = f"{refusal.message} {refusal.next_step}"
    node.compat_at = clock.now()


def store_inventory(
    *, session: Session, clock: Clock, node_id: str, inventory: dict[str, Any]
) -> datetime:
    node = get_node(session=session, node_id=node_id)
    now = clock.now()
    if node.inventory != inventory:
        record_event(
            session,
            node_id=node_id,
            at=now,
            kind="inventory_changed",
            reason=_describe_inventory(inventory),
        )
    node.inventory = inventory
    node.inventory_at = now
    node.hostname = inventory["hostname"]
    if node.compat_component == "runtime-worker":
        node.compat_code = node.compat_component = node.compat_detail = None
    return now


def store_telemetry(
    *, session: Session, clock: Clock, node_id: str, telemetry: dict[str, Any]
) -> datetime:
    now = clock.now()
    session.execute(
        update(Node).where(Node.id == node_id).values(telemetry=telemetry, telemetry_at=now)
    )
    session.add(TelemetrySample(node_id=node_id, at=now, sample=telemetry))
    return now


def telemetry_history(
    *, session: Session, node_id: str, since: datetime, limit: int = 2000
) -> list[TelemetrySample]:
    """A node's samples since `since`, oldest first (the console's GPU charts)."""
    rows = session.scalars(
        select(TelemetrySample)
        .where(TelemetrySample.node_id == node_id, TelemetrySample.at >= since)
        .order_by(TelemetrySample.at.desc())
        .limit(limit)
    )
    return list(reversed(list(rows)))


def telemetry_points(*, session: Session, node_id: str, since: datetime) -> list[TelemetryPoint]:
    """Utilisation, memory, temperature and power per GPU, and the host's CPU, of a node's
    samples since `since`, oldest first (the console's charts); NODE_NOT_FOUND for no node."""
    get_node(session=session, node_id=node_id)
    points = []
    for row in telemetry_history(session=session, node_id=node_id, since=since):
        sample = row.sample or {}
        gpus = [
            GpuPoint(
                index=gpu.get("index", 0),
                uuid=gpu.get("uuid", ""),
                utilization_percent=gpu.get("utilization_percent"),
                memory_used_mb=gpu.get("memory_used_mb"),
                memory_total_mb=gpu.get("memory_total_mb"),
                temperature_c=gpu.get("temperature_c"),
                power_draw_w=gpu.get("power_draw_w"),
                power_limit_w=gpu.get("power_limit_w"),
            )
            for gpu in sample.get("gpus") or []
        ]
        cpu = (sample.get("host") or {}).get("cpu_percent")
        points.append(TelemetryPoint(at=row.at, cpu_percent=cpu, gpus=gpus))
    return points


def prune_telemetry(*, session: Session, clock: Clock, retention: timedelta) -> int:
    result = session.execute(
        delete(TelemetrySample).where(TelemetrySample.at < clock.now() - retention)
    )
    return rowcount(result)


def _describe_inventory(inventory: dict[str, Any]) -> str:
    gpus = inventory.get("gpus") or []
    worker = inventory.get("runtime_worker") or {}
    return (
        f"{inventory.get('cpu_count')} CPUs, {inventory.get('memory_mb')} MB RAM, "
        f"{len(gpus)} GPU(s), mode {inventory.get('accelerator_mode')}, "
        f"runtime worker {worker.get('version', 'absent')}"
    )
