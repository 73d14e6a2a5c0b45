"""The app factory: builds the context, maps errors to HTTP once, runs migrations and background
loops in the lifespan. Nothing happens at import time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import update
from starlette.exceptions import HTTPException as StarletteHTTPException

from control_plane import RELEASE_VERSION
from control_plane.admin_token import resolve_admin_token
from control_plane.api import admin, agent, agent_work, console, jobs, public
from control_plane.api.heartbeat_fast import HeartbeatFastPath
from control_plane.background.loops import start_loops, stop_loops
from control_plane.clock import Clock, SystemClock
from control_plane.context import AppContext
from control_plane.db import make_engine, make_session_factory, migrate
from control_plane.errors import ModelForgeError
from control_plane.models import Node
from control_plane.services.credentials import CredentialAuthority
from control_plane.settings import Settings
from modelforge_contracts.errors import error_body

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None, *, clock: Clock | None = None, run_loops: bool = True
) -> HeartbeatFastPath:
    """The served ASGI app: the heartbeat fast path in front of the FastAPI app (`.app`)."""
    settings = settings or Settings()
    clock = clock or SystemClock()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.sqlalchemy_url)
    session_factory = make_session_factory(engine)
    ctx = AppContext(
        settings=settings,
        clock=clock,
        engine=engine,
        session_factory=session_factory,
        admin_token=resolve_admin_token(settings),
        authority=CredentialAuthority(
            data_dir=settings.data_dir, clock=clock, session_factory=session_factory
        ),
    )
    ctx.dispatcher.attach(session_factory)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await to_thread.run_sync(_start, ctx)
        ctx.dispatcher.bind(asyncio.get_running_loop())
        if ctx.settings.is_postgresql:
            ctx.dispatcher.listen(ctx.settings.sqlalchemy_url)
        tasks = start_loops(ctx) if run_loops else []
        try:
            yield
        finally:
            await stop_loops(ctx, tasks)
            ctx.dispatcher.close()
            engine.dispose()

    app = FastAPI(
        title="ModelForge control plane",
        version=RELEASE_VERSION,
        lifespan=lifespan,
        docs_url="/docs",
        openapi_url="/openapi.json",
    )
    app.state.ctx = ctx
    _install_error_handlers(app)
    app.include_router(public.router)
    app.include_router(admin.router)
    app.include_router(agent.router)
    app.include_router(agent_work.router)
    app.include_router(jobs.router)
    app.include_router(console.router)
    console.mount_console(app)
    return HeartbeatFastPath(app, ctx)


def _start(ctx: AppContext) -> None:
    migrate(ctx.engine, lock_dir=ctx.settings.data_dir)
    with ctx.session_factory.begin() as session:
        ctx.authority.start(session)
        # "Needs upgrade" lasts until the agent attaches compatibly or we restart.
        session.execute(
            update(Node)
            .where(Node.compat_code.is_not(None))
            .values(compat_code=None, compat_component=None, compat_detail=None)
        )


def _error(status: int, code: str, message: str, next_step: str) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(code, message, next_step))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ModelForgeError)
    async def _modelforge(_request: Request, exc: ModelForgeError) -> JSONResponse:
        return JSONResponse(status_code=exc.http_status, content=exc.to_body())

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # Only locations and messages: the offending input may be a token and is never echoed.
        problems = []
        for item in exc.errors():
            where = ".".join(str(p) for p in item.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {item.get('msg', 'invalid')}")
        return _error(
            422,
            "INVALID_REQUEST",
            "The request is not valid: " + "; ".join(problems[:10]),
            "Fix the named fields and retry; see /docs for the request schema.",
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not parse the body as JSON
            return _error(
                400,
                "INVALID_JSON",
                "The body is not JSON this control plane can read (malformed, or nested too "
                "deeply).",
                "Send a JSON body matching the schema in /docs.",
            )
        codes = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}
        return _error(
            exc.status_code,
            codes.get(exc.status_code, "HTTP_ERROR"),
            str(exc.detail),
            "Check the method and path against /docs.",
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected %s while serving a request", type(exc).__name__, exc_info=exc)
        return _error(
            500,
            "INTERNAL_ERROR",
            "The control plane failed to handle this request.",
            "Retry; if it persists, read the control plane log for the cause.",
        )
