"""The service placement loop (WL-5a): every second, pending services get a node and services
whose node went offline are put back to pending (control_plane.services.placement), their free
capacity counted by the scheduler's `free_capacity`."""

from __future__ import annotations

import asyncio

from control_plane.background.loops import every
from control_plane.context import AppContext
from control_plane.scheduling.placement import free_capacity
from control_plane.services import placement

INTERVAL_SECONDS = 1.0


def place_services(ctx: AppContext) -> int:
    return placement.place_pending(
        session_factory=ctx.session_factory,
        clock=ctx.clock,
        liveness=ctx.liveness,
        free_capacity=free_capacity,
    )


def start_service_placement(ctx: AppContext) -> asyncio.Task[None]:
    return asyncio.create_task(
        every("service placement", INTERVAL_SECONDS, lambda: place_services(ctx), ctx.database),
        name="service placement",
    )
