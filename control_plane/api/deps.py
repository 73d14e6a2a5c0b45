"""Named dependencies: the app context, a database session, the admin and node principals."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from control_plane.access import admin_token, console_sessions
from control_plane.access.console_sessions import SignedIn
from control_plane.audit import ADMIN_TOKEN_ACTOR, Audit, console_actor
from control_plane.context import AppContext
from control_plane.errors import AdminAuthError, CredentialError, refusal_for
from control_plane.fleet.credentials import NodePrincipal
from control_plane.security import sha256_hex


async def get_context(request: Request) -> AppContext:
    ctx: AppContext = request.app.state.ctx
    return ctx


ContextDep = Annotated[AppContext, Depends(get_context)]


def get_session(request: Request, ctx: ContextDep) -> Iterator[Session]:
    """One transaction per request, committed before the response is sent: read-only for GET and
    HEAD (on SQLite it takes no lock, so a read never waits for a writer), else one that may
    write (on SQLite it takes the write lock at its first statement)."""
    reads_only = request.method in _READ_METHODS
    factory = ctx.read_session_factory if reads_only else ctx.session_factory
    with factory.begin() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
_READ_METHODS = frozenset({"GET", "HEAD"})


SESSION_COOKIE = "modelforge_session"
CSRF_HEADER = "X-ModelForge-CSRF"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def require_admin(
    request: Request,
    ctx: ContextDep,
    token: Annotated[
        str | None, Header(alias="X-ModelForge-Admin-Token", include_in_schema=True)
    ] = None,
) -> None:
    """The admin token header (scripts), or a console session cookie plus, for any change, the
    session's CSRF token. A cookie alone never authorises a change."""
    if token:
        check_admin_token(request, ctx, token, then="send the X-ModelForge-Admin-Token header")
        request.state.actor = ADMIN_TOKEN_ACTOR
        return
    session_id = request.cookies.get(SESSION_COOKIE)
    if not session_id:
        raise AdminAuthError(
            "This endpoint needs the admin token or a console session.",
            "Send the X-ModelForge-Admin-Token header, or sign in to the console.",
            code="ADMIN_TOKEN_MISSING",
        )
    console_session(request, ctx, session_id)
    request.state.actor = console_actor(sha256_hex(session_id))


def console_session(request: Request, ctx: AppContext, session_id: str) -> SignedIn:
    """The console session a cookie names; for any change also its CSRF token. The one
    place that rule lives: admin endpoints and the console's own session endpoints use it."""
    # Read-only: on SQLite it waits for no writer (this runs on the threads every request shares).
    with ctx.read_session_factory() as session:
        signed_in = console_sessions.find_session(
            session=session, clock=ctx.clock, session_id=session_id
        )
    if request.method not in _SAFE_METHODS:
        console_sessions.check_csrf(signed_in, request.headers.get(CSRF_HEADER))
    return signed_in


def client_address(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def check_admin_token(request: Request, ctx: AppContext, token: str, *, then: str) -> None:
    """A presented admin token (header or console sign-in), checked by
    `access.admin_token.check_presented`, throttled per client address."""
    if ctx.admin_token is None:  # the artifact host: none of its routes takes one
        raise AdminAuthError(
            "this process takes no admin token", "send admin requests to the control plane"
        )
    admin_token.check_presented(
        source=ctx.admin_token,
        throttle=ctx.sign_in_throttle,
        clock=ctx.clock,
        address=client_address(request),
        presented=token,
        then=then,
    )


AdminDep = Depends(require_admin)


def get_audit(request: Request, ctx: ContextDep, session: SessionDep) -> Iterator[Audit]:
    """The audit entry of an admin request (AU-1): written with the route's transaction when it
    succeeds (this dependency's exit runs before the session's commit); when it fails, the
    route's transaction is rolled back first (releasing its locks) and the entry, with the
    refusal's code, is written in a transaction of its own."""
    audit = Audit(actor=getattr(request.state, "actor", ADMIN_TOKEN_ACTOR), clock=ctx.clock)
    try:
        yield audit
    except Exception as exc:
        session.rollback()
        # The code the request is answered with (a database outage's 503 included).
        audit.refused(ctx.session_factory, refusal_for(exc).code)
        raise
    audit.succeeded(session)


AuditDep = Annotated[Audit, Depends(get_audit, scope="function")]


async def require_node(
    ctx: ContextDep,
    authorization: Annotated[str | None, Header(include_in_schema=True)] = None,
) -> NodePrincipal:
    """Authenticate the node credential; a database read only for a `jti` not seen before."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise CredentialError(
            "This endpoint needs the node credential.",
            "Send it as `Authorization: Bearer <credential>`; the agent does this itself.",
            code="CREDENTIAL_MISSING",
        )
    token = token.strip()
    principal = ctx.authority.cached_active(token)
    if principal is None:
        principal = await run_in_threadpool(ctx.authority.authenticate, token)
    return principal


NodeDep = Annotated[NodePrincipal, Depends(require_node)]
