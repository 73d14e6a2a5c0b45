"""The periodic work of a control plane process: heartbeat flush, liveness sweep, credential
refresh, telemetry and console-session retention, job sweep."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from datetime import timedelta

from anyio import to_thread

from control_plane.context import AppContext
from control_plane.services import jobs
from control_plane.services.console_sessions import prune_sessions
from control_plane.services.nodes import sweep_liveness
from control_plane.services.reports import prune_telemetry

log = logging.getLogger(__name__)


async def _every(name: str, interval: float, work: Callable[[], object]) -> None:
    failures = 0
    while True:
        await asyncio.sleep(interval * random.uniform(0.9, 1.0))  # noqa: S311 - jitter only
        try:
            await to_thread.run_sync(work)
            failures = 0
        except Exception as exc:
            failures += 1
            # One line per failure kind; the traceback only on the first so logs stay readable.
            log.warning(
                "%s failed (%s, %d in a row)",
                name,
                type(exc).__name__,
                failures,
                exc_info=failures == 1,
            )


def flush_heartbeats(ctx: AppContext) -> int:
    return ctx.heartbeats.flush(session_factory=ctx.session_factory)


def sweep(ctx: AppContext) -> int:
    with ctx.session_factory.begin() as session:
        return sweep_liveness(session=session, clock=ctx.clock, liveness=ctx.liveness)


def prune(ctx: AppContext) -> int:
    """Telemetry past its retention, and console sessions past their expiry."""
    with ctx.session_factory.begin() as session:
        retention = timedelta(seconds=ctx.settings.telemetry_retention_seconds)
        pruned = prune_telemetry(session=session, clock=ctx.clock, retention=retention)
        return pruned + prune_sessions(session=session, clock=ctx.clock)


def sweep_jobs(ctx: AppContext) -> int:
    with ctx.session_factory.begin() as session:
        return jobs.sweep_jobs(
            session=session,
            clock=ctx.clock,
            contact_timeout=timedelta(seconds=ctx.settings.job_contact_timeout_seconds),
        )


def start_loops(ctx: AppContext) -> list[asyncio.Task[None]]:
    s = ctx.settings
    specs: list[tuple[str, float, Callable[[], object]]] = [
        ("heartbeat flush", s.heartbeat_flush_interval_seconds, lambda: flush_heartbeats(ctx)),
        ("liveness sweep", s.liveness_sweep_interval_seconds, lambda: sweep(ctx)),
        (
            "credential refresh",
            s.credential_refresh_interval_seconds,
            ctx.authority.refresh,
        ),
        ("retention", 60.0, lambda: prune(ctx)),
        ("job sweep", s.liveness_sweep_interval_seconds, lambda: sweep_jobs(ctx)),
    ]
    return [asyncio.create_task(_every(name, i, fn), name=name) for name, i, fn in specs]


async def stop_loops(ctx: AppContext, tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # The last word: heartbeats answered 2xx reach the database before the process exits.
    await to_thread.run_sync(lambda: flush_heartbeats(ctx))
