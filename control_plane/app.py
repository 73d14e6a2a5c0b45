"""The app factory: builds the context, maps errors to HTTP once, runs migrations and background
loops in the lifespan. Nothing happens at import time."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import timedelta
from http import HTTPStatus
from typing import Any

import psycopg
from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import update
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from control_plane import RELEASE_VERSION
from control_plane.access.admin_token import resolve_admin_token
from control_plane.api import (
    admin,
    agent,
    agent_artifacts,
    agent_work,
    artifacts,
    audit,
    console,
    docs,
    gateway_native,
    jobs,
    metrics,
    models,
    openai_models,
    people,
    provisioning,
    public,
    resources,
    secrets,
    services,
    tunnel,
)
from control_plane.api.agent_fast import AgentFastPath
from control_plane.api.edge import invalid_json
from control_plane.api.front import Front, compose_front
from control_plane.api.rsgi import ServedApp
from control_plane.background.loops import start_loops, stop_loops
from control_plane.background.service_placement import start_service_placement
from control_plane.clock import Clock, SystemClock
from control_plane.context import AppContext
from control_plane.db import (
    make_engine,
    make_read_engine,
    make_session_factory,
    migrate,
    prepare_data_dir,
)
from control_plane.errors import (
    Busy,
    DatabaseUnavailable,
    ModelForgeError,
    StorageFull,
    refusal_for,
)
from control_plane.fleet.credentials import CredentialAuthority
from control_plane.gateway import peers
from control_plane.models import Node
from control_plane.provisioning.metrics import ProvisioningCollector
from control_plane.schemas import schema_words
from control_plane.settings import Settings
from modelforge_contracts.errors import error_body

log = logging.getLogger(__name__)
_WORKER_THREADS = 8


def create_served_app() -> ServedApp:
    """What `modelforge-control-plane` serves (Granian's factory, RSGI): the front's RSGI app
    (`Front.served`, `api/rsgi.py`), setting the objects alive once it has started aside from
    the garbage collector (`gc.freeze`).

    Those — modules, the ORM's and the schemas' classes, the app, the settings — live as long as
    the process, yet a full collection walked all of them each time: measured with 1,000 claims
    waiting, 100–170 ms with the event loop stopped, every second or two, in the dispatch
    latency's tail. Only this process does it: a process that builds apps and throws them away
    (the tests) would keep what it froze for ever."""
    return create_front(set_aside_startup_objects=True).served()


def create_app(
    settings: Settings | None = None, *, clock: Clock | None = None, run_loops: bool = True
) -> AgentFastPath:
    """The served ASGI app, in-process (the tests'): the front's outermost seam, the agents'
    fast path, in front of the edge, the JSON guard and the FastAPI app (`api/front.py`)."""
    return create_front(settings, clock=clock, run_loops=run_loops).asgi


def create_front(
    settings: Settings | None = None,
    *,
    clock: Clock | None = None,
    run_loops: bool = True,
    set_aside_startup_objects: bool = False,
) -> Front:
    """The context, the FastAPI app with its routes, error mapping and lifespan, and the seams
    in front of it (`api/front.compose_front`), each a named layer of the `Front`."""
    ctx = make_context(settings, clock)
    settings, clock, session_factory = ctx.settings, ctx.clock, ctx.session_factory
    engine, read_engine = ctx.engine, ctx.read_engine
    ctx.dispatcher.attach(session_factory)
    ctx.metrics.attach(session_factory)
    # A scrape only reads: read-only sessions, which on SQLite wait for no writer.
    ctx.metrics.read_store(
        session_factory=ctx.read_session_factory, liveness=ctx.liveness, clock=clock
    )
    ctx.database.watch(engine)
    if read_engine.pool is not engine.pool:  # SQLite's own read pool (PostgreSQL shares one)
        ctx.database.watch(read_engine)
    ctx.metrics.registry.register(ProvisioningCollector(ctx.provisioner, ctx.read_session_factory))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Fewer threads than anyio's 40 for the blocking routes: on a GIL they only contend
        # (measured: CPU per placement), and each holds a pooled database connection.
        to_thread.current_default_thread_limiter().total_tokens = _WORKER_THREADS
        await to_thread.run_sync(_start, ctx)
        ctx.dispatcher.bind(asyncio.get_running_loop())
        ctx.scheduler.start()
        ctx.completions.start()
        if ctx.settings.is_postgresql:
            ctx.dispatcher.listen(ctx.settings.sqlalchemy_url)
        tasks = [*start_loops(ctx), start_service_placement(ctx)] if run_loops else []
        if run_loops:
            ctx.provisioner.start()
        # The native front's control channel (`api/gateway_native.py`), where it runs.
        channel = await gateway_native.listen(ctx, front.gateway)
        if set_aside_startup_objects:
            gc.collect()  # garbage from the start is not kept for ever
            gc.freeze()
        try:
            yield
        finally:
            if channel is not None:
                channel.close()
            await ctx.hub.close_all()
            await ctx.provisioner.stop()
            await ctx.scheduler.stop()
            await ctx.completions.stop()
            await stop_loops(ctx, tasks)
            ctx.dispatcher.close()
            engine.dispose()
            read_engine.dispose()

    app = FastAPI(
        title="ModelForge control plane",
        version=RELEASE_VERSION,
        lifespan=lifespan,
        docs_url=None,  # served by `docs.router`, from this origin only
        openapi_url="/openapi.json",
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(public.router)
    app.include_router(admin.router)
    app.include_router(agent.router)
    app.include_router(agent_work.router)
    app.include_router(agent_artifacts.router)
    app.include_router(jobs.router)
    app.include_router(console.router)
    app.include_router(docs.router)
    app.include_router(metrics.router)
    app.include_router(artifacts.router)
    app.include_router(models.router)
    app.include_router(secrets.router)
    app.include_router(services.router)
    app.include_router(audit.router)
    app.include_router(services.agent_router)
    app.include_router(provisioning.router)
    app.include_router(resources.router)
    app.include_router(tunnel.router)
    app.include_router(openai_models.router)
    app.include_router(people.users)
    app.include_router(people.me)
    console.mount_console(app)
    front = compose_front(app, ctx)
    app.state.gateway = front.gateway  # the OpenAI API's `GET /v1/models` checks keys with it
    return front


def make_context(
    settings: Settings | None = None, clock: Clock | None = None, *, admin: bool = True
) -> AppContext:
    """A control-plane process's context: its settings, clock, data dir, database engines and
    credential authority (every process, the artifact host's included); the admin token too
    unless `admin` is false (the artifact host takes none, and makes none)."""
    settings = settings or Settings()
    clock = clock or SystemClock()
    prepare_data_dir(settings.data_dir)
    engine = make_engine(settings.sqlalchemy_url)
    session_factory = make_session_factory(engine)
    read_engine = make_read_engine(engine)
    return AppContext(
        settings=settings,
        clock=clock,
        engine=engine,
        read_engine=read_engine,
        session_factory=session_factory,
        read_session_factory=make_session_factory(read_engine),
        admin_token=resolve_admin_token(settings) if admin else None,
        authority=CredentialAuthority(
            data_dir=settings.data_dir,
            clock=clock,
            session_factory=session_factory,
            lifetime=timedelta(days=settings.credential_lifetime_days),
        ),
    )


def _start(ctx: AppContext) -> None:
    migrate(ctx.engine, lock_dir=ctx.settings.data_dir)
    with ctx.session_factory.begin() as session:
        ctx.authority.start(session)
        # Where the downtime before this start began (the last moment the control plane was
        # known alive), before this start marks it alive.
        ctx.contact_grace.started(session=session)
        # "Needs upgrade" lasts until the agent attaches compatibly or we restart.
        session.execute(
            update(Node)
            .where(Node.compat_code.is_not(None))
            .values(compat_code=None, compat_component=None, compat_detail=None)
        )
    # Replicas reach the tunnels this one holds, and it theirs (gateway/peers.py).
    peers.attach(
        ctx.hub,
        session_factory=ctx.session_factory,
        read_session_factory=ctx.read_session_factory,
        clock=ctx.clock,
        address=ctx.settings.gateway_peer_address,
        body_timeout=ctx.settings.gateway_body_timeout_seconds,
    )


_HTTP_CODES = {
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    413: "REQUEST_TOO_LARGE",
    416: "RANGE_NOT_SATISFIABLE",
}
# Messages of pydantic error types that quote the input (a discriminator's value).
_QUOTING_TYPES = {"union_tag_invalid": "the value of {discriminator} is not one of {expected_tags}"}


def describe_problem(item: Mapping[str, Any]) -> str:
    """`where: rule` for one validation error, quoting nothing the caller sent: dict keys in the
    location become `<key>`, and a message that quotes the input is replaced by its rule."""
    loc = tuple(item.get("loc", ()))
    parts: list[str] = []
    for index, part in enumerate(loc):
        if index == 0 and part in ("body", "query", "path", "header", "cookie"):
            continue
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif (index == 1 and loc[0] != "body") or part in schema_words() or part == "[key]":
            parts.append(str(part))  # a parameter or field name of the schema, not input
        else:
            parts.append("<key>")
    where = ".".join(parts).replace(".[", "[") or "body"
    kind = str(item.get("type", ""))
    message = str(item.get("msg", "invalid"))
    if kind in _QUOTING_TYPES:
        ctx = {key: str(value) for key, value in (item.get("ctx") or {}).items()}
        try:
            message = _QUOTING_TYPES[kind].format(**ctx)
        except KeyError:
            message = f"invalid ({kind})"
    received = item.get("input")
    if isinstance(received, str | int | float) and not isinstance(received, bool):
        text = str(received)
        if len(text) >= 3 and text in message:
            message = f"invalid ({kind})"
    return f"{where}: {message}"


def _error(status: int, code: str, message: str, next_step: str) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(code, message, next_step))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ModelForgeError)
    async def _modelforge(_request: Request, exc: ModelForgeError) -> JSONResponse:
        return JSONResponse(
            status_code=exc.http_status, content=exc.to_body(), headers=exc.response_headers()
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # Only locations and rules: the offending input may be a token and is never echoed.
        problems = [describe_problem(item) for item in exc.errors()]
        return _error(
            422,
            "INVALID_REQUEST",
            "The request is not valid: " + "; ".join(problems[:10]),
            "Fix the named fields and retry; see /docs for the request schema.",
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not parse the body as JSON
            refusal = invalid_json()
            return JSONResponse(status_code=400, content=refusal.to_body())
        status = exc.status_code
        # Every status gets a documented code; the phrase, not the detail, is the message.
        code = _HTTP_CODES.get(status, "INTERNAL_ERROR" if status >= 500 else "BAD_REQUEST")
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Refused"
        return _error(status, code, f"{phrase}.", "Check the method and path against /docs.")

    @app.exception_handler(ClientDisconnect)
    async def _disconnected(request: Request, _exc: ClientDisconnect) -> JSONResponse:
        # The client's doing, not a fault here: one line, no traceback (nothing was stored; an
        # upload's partial file is removed). Nobody reads the answer.
        log.info(
            "client disconnected before sending all of %s %s", request.method, request.url.path
        )
        return _error(
            400,
            "REQUEST_INCOMPLETE",
            "The client disconnected before the request body was complete.",
            "Send the request again.",
        )

    @app.exception_handler(SQLAlchemyError)
    @app.exception_handler(psycopg.Error)
    async def _database(request: Request, exc: Exception) -> JSONResponse:
        refusal = refusal_for(exc)
        if not isinstance(refusal, DatabaseUnavailable):  # a bug, or no room for a write
            return await _unexpected(request, exc)
        # An outage is logged once by `ctx.database`, not once per request with a traceback.
        request.app.state.ctx.database.failed(exc)
        return JSONResponse(
            status_code=refusal.http_status, content=refusal.to_body(), headers={"Retry-After": "5"}
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        refusal = refusal_for(exc)
        if isinstance(refusal, StorageFull):  # reads still work: one line, no traceback
            log.warning("a write was refused: the storage is full (%s)", type(exc).__name__)
        elif isinstance(refusal, Busy):  # a wait for the database ran out: one line
            log.warning("a request was answered BUSY: its wait for the database ran out")
        else:
            log.error("unexpected %s while serving a request", type(exc).__name__, exc_info=exc)
        return JSONResponse(
            status_code=refusal.http_status,
            content=refusal.to_body(),
            headers=refusal.response_headers(),
        )
