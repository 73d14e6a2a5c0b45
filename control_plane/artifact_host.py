"""The artifact host: a control-plane process that serves only the agents' artifact routes
(`modelforge-control-plane --artifacts-only`, issue 42), for an operator who serves artifacts
from a host near their storage while the control plane runs elsewhere. Agents send their
artifact transfers there (`MODELFORGE_AGENT_ARTIFACT_URL`) and everything else to the control
plane.

It shares the control plane's database (the artifacts' rows, the nodes' credentials) and its
artifact store (`MODELFORGE_DATA_DIR`'s `artifacts/`, a volume both mount). It serves
`PUT`/`GET /api/v1/agent/artifacts/{digest}` exactly as the control plane does (the same routes,
bounds and checks: `api/agent_artifacts.py`, behind the same edge) and `GET /api/v1/health` and
`/api/v1/version`; any other path is 404. It checks node credentials against the signing keys in
the database and reads their revocations every `MODELFORGE_CREDENTIAL_REFRESH_INTERVAL_SECONDS`,
but holds no signing key (it issues nothing), runs no migration (a database the control plane
has not brought to this release's schema stops its start), and runs none of the control plane's
loops, schedulers, gateway or console.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from anyio import to_thread
from fastapi import FastAPI
from sqlalchemy import Engine

from control_plane import RELEASE_VERSION
from control_plane.api import agent_artifacts, public
from control_plane.api.asgi import ASGIApp
from control_plane.api.edge import Edge, JsonGuard
from control_plane.app import install_error_handlers, make_context
from control_plane.background.loops import every
from control_plane.db import alembic_config, make_engine
from control_plane.settings import Settings


class SchemaNotCurrent(Exception):
    """The database is not at this release's schema (the message says what to do)."""


def check_schema(engine: Engine) -> None:
    """Refuse a database the control plane has not migrated to this release's schema."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    with engine.connect() as connection:
        current = MigrationContext.configure(connection).get_current_revision()
    if current != head:
        raise SchemaNotCurrent(
            f"the database's schema is at revision {current or 'none'}, this release's at "
            f"{head}: start (or upgrade) the control plane on this database first; the artifact "
            "host migrates nothing"
        )


def check_database(settings: Settings) -> None:
    """Before serving: the database reachable and at this release's schema, else
    `SchemaNotCurrent` (or SQLAlchemy's error for a database that does not answer)."""
    engine = make_engine(settings.sqlalchemy_url)
    try:
        check_schema(engine)
    finally:
        engine.dispose()


def serve(settings: Settings, *, worker_kill_seconds: int) -> None:
    """Serve the artifact host with Granian (ASGI, one worker) on the control plane's address
    settings (`MODELFORGE_HOST`, `MODELFORGE_PORT`, TLS with `MODELFORGE_TLS_CERT`/`_KEY`)."""
    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops

    Granian(
        target="control_plane.artifact_host:create_artifact_app",
        factory=True,
        interface=Interfaces.ASGI,
        http=HTTPModes.http1,
        loop=Loops.uvloop,
        address=settings.host,
        port=settings.port,
        workers=1,
        backpressure=settings.max_concurrent_requests,
        workers_kill_timeout=worker_kill_seconds,
        ssl_cert=settings.tls_cert,
        ssl_key=settings.tls_key,
        log_level=settings.log_level,  # type: ignore[arg-type]
    ).serve()


def create_artifact_app(settings: Settings | None = None) -> ASGIApp:
    """The artifact host's ASGI app (Granian's factory; see the module's docstring)."""
    ctx = make_context(settings, admin=False)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        def start() -> None:
            check_schema(ctx.engine)
            with ctx.session_factory.begin() as session:
                ctx.authority.start(session, signing=False)

        await to_thread.run_sync(start)
        refresh = asyncio.create_task(
            every(
                "credential refresh",
                ctx.settings.credential_refresh_interval_seconds,
                ctx.authority.refresh,
                ctx.database,
            )
        )
        try:
            yield
        finally:
            refresh.cancel()
            await asyncio.gather(refresh, return_exceptions=True)
            ctx.engine.dispose()
            ctx.read_engine.dispose()

    app = FastAPI(
        title="ModelForge artifact host",
        version=RELEASE_VERSION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(public.router)
    app.include_router(agent_artifacts.router)
    ctx.database.watch(ctx.engine)
    return Edge(JsonGuard(app), ctx)
