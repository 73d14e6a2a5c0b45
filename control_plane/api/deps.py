"""Named dependencies: the app context, a database session, who a request acts as (a person, a
key, the admin token: `needs(area)` checks the role) and the node principal."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, Header, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from control_plane.access import admin_token, console_sessions, people
from control_plane.access.console_sessions import SignedIn
from control_plane.access.principals import Principal
from control_plane.access.roles import Area, Role, Scope
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


def current_principal(
    request: Request,
    ctx: ContextDep,
    token: Annotated[
        str | None, Header(alias="X-ModelForge-Admin-Token", include_in_schema=True)
    ] = None,
    authorization: Annotated[str | None, Header(include_in_schema=True)] = None,
) -> Principal:
    """Who the request acts as: the admin token header (break-glass, scripts), a personal API
    key (`Authorization: Bearer mfk_...`), or a console session cookie plus, for any change, the
    session's CSRF token (a cookie alone never authorises a change). A disabled user's session
    or key stops here, at its next request."""
    principal = _principal(request, ctx, token, authorization)
    request.state.actor = principal.actor
    return principal


def _principal(
    request: Request, ctx: AppContext, token: str | None, authorization: str | None
) -> Principal:
    if token:
        check_admin_token(request, ctx, token, then="send the X-ModelForge-Admin-Token header")
        return BREAK_GLASS
    scheme, _, presented = (authorization or "").partition(" ")
    presented = presented.strip()
    if scheme.lower() == "bearer" and presented.startswith(people.KEY_PREFIX):
        with ctx.read_session_factory() as session:
            key, user = people.find_key(session, ctx.clock, presented)
        return Principal(
            actor=f"user:{user.name} key:{key.id[4:12]}",
            role=Role(user.role),
            via="key",
            user_id=user.id,
            user_name=user.name,
            scopes=frozenset(Scope(scope) for scope in key.scopes),
        )
    session_id = request.cookies.get(SESSION_COOKIE)
    if not session_id:
        raise AdminAuthError(
            "This endpoint needs a signed-in user, a personal API key or the admin token.",
            "Sign in to the console, send `Authorization: Bearer <key>` (docs/access.md), or "
            "send the X-ModelForge-Admin-Token header.",
            code="ADMIN_TOKEN_MISSING",
        )
    signed_in = console_session(request, ctx, session_id)
    if signed_in.user_id is None:
        return Principal(
            actor=console_actor(sha256_hex(session_id)), role=Role.ADMIN, via="session"
        )
    person = signed_in.user
    if person is None or person.disabled:
        raise AdminAuthError(
            "This console session's user is disabled.",
            "Ask an admin to enable the user again, then sign in.",
            code="USER_DISABLED",
        )
    return Principal(
        actor=f"user:{person.name}",
        role=Role(person.role),
        via="session",
        user_id=person.id,
        user_name=person.name,
    )


PrincipalDep = Annotated[Principal, Depends(current_principal)]
BREAK_GLASS = Principal(actor=ADMIN_TOKEN_ACTOR, role=Role.ADMIN, via="admin-token")


class _Needs:
    """The one role check of a route: its area, read by GET and HEAD, changed by the rest."""

    def __init__(self, area: Area) -> None:
        self.area = area

    def __call__(self, request: Request, principal: PrincipalDep) -> Principal:
        principal.check(self.area, request.method not in _READ_METHODS)
        return principal


def needs(area: Area) -> Any:
    """The dependency a router (or a route narrower than its router) names its area with."""
    return Depends(_Needs(area))


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
