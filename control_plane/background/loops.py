"""The periodic work of a control plane process: heartbeat flush, liveness sweep, credential
refresh, telemetry and console-session retention, job sweep, artifact sweep, presence mark,
the services' rolling updates and autoscaling.

A loop never dies of a failure and never floods the log with one. Each failure is judged as a
request's would be (`errors.refusal_for`): a database outage is reported once for the whole
process by `ctx.database`; a wait for a saturated database that ran out (`BUSY`) is retried
quietly, since the database works; a write refused for want of room (`STORAGE_FULL`) is not an
outage either, since reads still work (counting it as one would begin and end an "outage"
every few seconds), and is logged in one line, without a traceback; any other failure is logged
with its traceback the first time. Failures other than an outage are logged again only as they
keep recurring (the 10th, 100th, ... time) and when they stop.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from datetime import timedelta

from anyio import to_thread

from control_plane.access.console_sessions import prune_sessions
from control_plane.artifacts import sweep as artifact_sweep
from control_plane.context import AppContext
from control_plane.db import DatabaseAvailability, is_database_unavailable
from control_plane.errors import Busy, DatabaseUnavailable, StorageFull, refusal_for
from control_plane.fleet.liveness import mark_alive
from control_plane.fleet.nodes import sweep_liveness
from control_plane.fleet.reports import prune_telemetry
from control_plane.jobs import reports as job_reports
from control_plane.services import autoscale, rollout

log = logging.getLogger(__name__)

#: How often the control plane marks itself alive in the database: at the next start, its
#: downtime is taken to have begun at most this long before it really did.
PRESENCE_INTERVAL_SECONDS = 5.0
#: How often rollouts take their next step and autoscaled services are sized.
SERVICE_SCALING_INTERVAL_SECONDS = 1.0


async def every(
    name: str, interval: float, work: Callable[[], object], database: DatabaseAvailability
) -> None:
    failures = 0
    while True:
        await asyncio.sleep(interval * random.uniform(0.9, 1.0))  # noqa: S311 - jitter only
        try:
            await to_thread.run_sync(work)
        except Exception as exc:
            refusal = refusal_for(exc)
            if isinstance(refusal, DatabaseUnavailable):
                # The next round retries; pending heartbeats stay in memory until then.
                database.failed(exc)
                continue
            if isinstance(refusal, Busy):
                # Saturation, not an outage: the next round retries (requests log BUSY).
                log.debug("%s waited too long for the database; retrying", name)
                continue
            failures += 1
            if _worth_logging(failures):
                full = isinstance(refusal, StorageFull)
                log.warning(
                    "%s failed (%s, %d in a row); retrying every %g s",
                    name,
                    "the storage is full" if full else type(exc).__name__,
                    failures,
                    interval,
                    exc_info=failures == 1 and not full,
                )
            continue
        if failures:
            log.warning("%s works again after %d failures in a row", name, failures)
            failures = 0


def _worth_logging(failures: int) -> bool:
    """The 1st, 10th, 100th, ... failure in a row."""
    while failures % 10 == 0:
        failures //= 10
    return failures == 1


def flush_heartbeats(ctx: AppContext) -> int:
    return ctx.heartbeats.flush(session_factory=ctx.session_factory)


def mark_presence(ctx: AppContext) -> None:
    """The control plane is alive now (`liveness.ContactGrace` reads it at the next start)."""
    with ctx.session_factory.begin() as session:
        mark_alive(session=session, at=ctx.clock.now())


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
        return job_reports.sweep_jobs(
            session=session,
            clock=ctx.clock,
            contact_timeout=timedelta(seconds=ctx.settings.job_contact_timeout_seconds),
            grace=ctx.contact_grace,
        )


def sweep_artifacts(ctx: AppContext) -> artifact_sweep.SweepReport:
    """Artifacts nothing names, past the grace period (AR-3); files go once this commits."""
    with ctx.session_factory.begin() as session:
        report = artifact_sweep.sweep(
            session=session,
            store=ctx.artifacts,
            clock=ctx.clock,
            grace=timedelta(seconds=ctx.settings.artifact_grace_seconds),
            dry_run=False,
        )
    log.info(
        "artifact sweep: %d deleted, %d kept, %d stray files removed, %d bytes freed",
        len(report.deleted),
        len(report.kept),
        len(report.removed_files),
        report.bytes_freed,
    )
    return report


def advance_rollouts(ctx: AppContext) -> int:
    """Each rolling update's next step; draining replicas past the drain period stopped."""
    return rollout.advance(
        session_factory=ctx.session_factory,
        clock=ctx.clock,
        drain_seconds=ctx.settings.service_drain_seconds,
    )


def autoscale_services(ctx: AppContext) -> int:
    """Autoscaled services sized from this process's gateway traffic (`services/autoscale`)."""
    return autoscale.apply(
        session_factory=ctx.session_factory,
        clock=ctx.clock,
        autoscaler=ctx.autoscaler,
        loads=ctx.traffic.loads(),
    )


def start_loops(ctx: AppContext) -> list[asyncio.Task[None]]:
    # From now on the nodes can reach this process: their silence until now was its downtime.
    ctx.contact_grace.serving()
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
        ("presence mark", PRESENCE_INTERVAL_SECONDS, lambda: mark_presence(ctx)),
        ("service rollouts", SERVICE_SCALING_INTERVAL_SECONDS, lambda: advance_rollouts(ctx)),
        ("service autoscale", SERVICE_SCALING_INTERVAL_SECONDS, lambda: autoscale_services(ctx)),
    ]
    if s.artifact_sweep_interval_seconds > 0:
        specs.append(
            ("artifact sweep", s.artifact_sweep_interval_seconds, lambda: sweep_artifacts(ctx))
        )
    return [
        asyncio.create_task(every(name, i, fn, ctx.database), name=name) for name, i, fn in specs
    ]


async def stop_loops(ctx: AppContext, tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # The last word: heartbeats answered 2xx reach the database before the process exits, and
    # the moment it stops is marked, where the next start counts its downtime from.
    try:
        await to_thread.run_sync(lambda: flush_heartbeats(ctx))
        await to_thread.run_sync(lambda: mark_presence(ctx))
    except Exception as exc:
        if not is_database_unavailable(exc):
            raise
        # Only liveness is lost: the agents' next heartbeats, to the next start, bring it back;
        # the presence mark of a few seconds ago stands.
        log.warning(
            "%d heartbeats were not written at shutdown: the database is unavailable",
            len(ctx.heartbeats),
        )
