"""The service placement loop (WL-5a): every second, pending services get a node and services
whose node went offline are put back to pending (control_plane.services.deployments)."""

from __future__ import annotations

import asyncio

from control_plane.background.loops import _every
from control_plane.context import AppContext
from control_plane.services import deployments

INTERVAL_SECONDS = 1.0


def place_services(ctx: AppContext) -> int:
    return deployments.place_pending(
        session_factory=ctx.session_factory, clock=ctx.clock, liveness=ctx.liveness
    )


def start_service_placement(ctx: AppContext) -> asyncio.Task[None]:
    return asyncio.create_task(
        _every("service placement", INTERVAL_SECONDS, lambda: place_services(ctx), ctx.database),
        name="service placement",
    )
