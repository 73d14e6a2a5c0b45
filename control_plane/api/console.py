"""The web console: its sign-in session endpoints, and its built single-page app
served at `/`.

Signing in exchanges the admin token, or a user's name and password, for an HttpOnly,
SameSite=Strict cookie (Secure over TLS); the console keeps the CSRF token in memory and sends it
with every change. Neither the admin token nor a password is stored by the browser.
"""

from __future__ import annotations

from datetime import timedelta
from html import escape
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, FastAPI, Query, Request, Response, status
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from control_plane.access import console_sessions, oidc, people
from control_plane.access.roles import Role
from control_plane.access.schemas import ConsoleSessionInfo, SignInOptions, SignInRequest
from control_plane.api.deps import (
    SESSION_COOKIE,
    ContextDep,
    SessionDep,
    check_admin_token,
    client_address,
    console_session,
)
from control_plane.api.routing import LaneRoute
from control_plane.context import AppContext
from control_plane.errors import AdminAuthError, ModelForgeError

CONSOLE_DIST = Path(__file__).resolve().parent.parent / "console" / "dist"
#: The console's routes (client-side); each serves index.html.
CONSOLE_ROUTES = (
    "/",
    "/hardware",
    "/nodes",
    "/jobs",
    "/jobs/{job_id}",
    "/services",
    "/services/{service_id}",
    "/models",
    "/artifacts",
    "/provisioning",
    "/audit",
    "/people",
)
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
        "form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

router = APIRouter(prefix="/api/v1/console", tags=["console"], route_class=LaneRoute)
#: The browser's half of a sign-in through the OpenID provider (its PKCE verifier).
OIDC_COOKIE = "modelforge_oidc"
OIDC_PATH = "/api/v1/console/oidc"


def _is_tls(request: Request, public_url: str | None) -> bool:
    return request.url.scheme == "https" or (public_url or "").startswith("https://")


@router.post("/session", status_code=status.HTTP_201_CREATED, response_model=ConsoleSessionInfo)
def sign_in(
    body: SignInRequest, request: Request, response: Response, ctx: ContextDep, session: SessionDep
) -> ConsoleSessionInfo:
    user = None
    if body.admin_token is not None:
        check_admin_token(request, ctx, body.admin_token.get_secret_value(), then="sign in")
    else:  # the body's rule: the name and the password (anything missing fails the check)
        with ctx.read_session_factory() as reading:  # the hash's ~0.1 s takes no write lock
            user = people.check_password(
                session=reading,
                clock=ctx.clock,
                throttle=ctx.password_throttle,
                address=client_address(request),
                name=body.name or "",
                password=body.password.get_secret_value() if body.password else "",
            )
    signed_in = console_sessions.start_session(
        session=session,
        clock=ctx.clock,
        lifetime=timedelta(seconds=ctx.settings.console_session_seconds),
        user=user,
    )
    _set_session(response, request, ctx, signed_in)
    return _info(signed_in)


def _set_session(
    response: Response, request: Request, ctx: AppContext, signed_in: console_sessions.SignedIn
) -> None:
    response.set_cookie(
        SESSION_COOKIE,
        signed_in.session_id,
        max_age=int(ctx.settings.console_session_seconds),
        path="/",
        httponly=True,
        samesite="strict",
        secure=_is_tls(request, ctx.settings.public_url),
    )
    response.headers["Cache-Control"] = "no-store"


@router.get("/sign-in-options", response_model=SignInOptions)
def sign_in_options(ctx: ContextDep) -> SignInOptions:
    """How one may sign in here: always a name and password (and the admin token); the OpenID
    provider's button when single sign-on is configured."""
    return SignInOptions(sso=None if ctx.oidc is None else ctx.oidc.display_name)


@router.get("/oidc/login", response_class=RedirectResponse, status_code=303)
def oidc_login(request: Request, ctx: ContextDep) -> Response:
    """Start a sign-in through the OpenID provider: to its authorization page (303), with the
    browser's half of the sign-in in a cookie scoped to the callback (SameSite=Lax: sent on the
    provider's redirect back, a top-level GET)."""
    if ctx.oidc is None:
        return _page(oidc.not_configured())
    try:
        with ctx.session_factory.begin() as session:
            begun = ctx.oidc.begin(session)
    except ModelForgeError as exc:
        return _page(exc)
    response = RedirectResponse(begun.url, status_code=303, headers={"Cache-Control": "no-store"})
    response.set_cookie(
        OIDC_COOKIE,
        begun.verifier,
        max_age=int(oidc.LOGIN_LIFETIME.total_seconds()),
        path=OIDC_PATH,
        httponly=True,
        samesite="lax",
        secure=_is_tls(request, ctx.settings.public_url),
    )
    return response


@router.get("/oidc/callback", response_class=RedirectResponse, status_code=303)
def oidc_callback(
    request: Request,
    ctx: ContextDep,
    code: Annotated[str | None, Query(max_length=2048)] = None,
    state: Annotated[str | None, Query(max_length=200)] = None,
    error: Annotated[str | None, Query(max_length=200)] = None,
) -> Response:
    """The provider's answer: the ID token checked, the person found or made with the role their
    groups map to, a console session started (a new session id), and on to the console. Any
    refusal is a page that names it and the next step, and signs nobody in."""
    try:
        if ctx.oidc is None:
            raise oidc.not_configured()
        if error or not code or not state:
            raise oidc.OidcRefused(
                "The provider did not sign you in"
                + (f" ({error[:60]})." if error and error.isascii() else "."),
                "Start again from the console's sign-in page.",
            )
        with ctx.session_factory.begin() as session:
            taken = ctx.oidc.take(session, state=state)
        claims = ctx.oidc.finish(taken, code=code, verifier=request.cookies.get(OIDC_COOKIE))
        with ctx.session_factory.begin() as session:
            user = ctx.oidc.person(session, claims)
            signed_in = console_sessions.start_session(
                session=session,
                clock=ctx.clock,
                lifetime=timedelta(seconds=ctx.settings.console_session_seconds),
                user=user,
            )
    except ModelForgeError as exc:
        return _page(exc)
    response = RedirectResponse("/", status_code=303)
    _set_session(response, request, ctx, signed_in)
    response.delete_cookie(OIDC_COOKIE, path=OIDC_PATH, httponly=True, samesite="lax")
    return response


def _page(refusal: ModelForgeError) -> HTMLResponse:
    """A refusal a browser was sent to: its code, message and next step, and a way back."""
    body = (
        "<!doctype html><meta charset=utf-8><title>ModelForge: sign-in refused</title>"
        f"<h1>Sign-in refused</h1><p><code>{escape(refusal.code)}</code>: "
        f"{escape(refusal.message)}</p><p>Next step: {escape(refusal.next_step)}</p>"
        '<p><a href="/">Back to the sign-in page</a></p>'
    )
    return HTMLResponse(body, status_code=refusal.http_status, headers=_SECURITY_HEADERS)


@router.get("/session", response_model=ConsoleSessionInfo)
def current_session(request: Request, response: Response, ctx: ContextDep) -> ConsoleSessionInfo:
    """Lets a reloaded console recover its CSRF token and who is signed in; readable only by the
    same origin."""
    signed_in = console_session(request, ctx, _cookie(request))
    response.headers["Cache-Control"] = "no-store"
    return _info(signed_in)


def _info(signed_in: console_sessions.SignedIn) -> ConsoleSessionInfo:
    user = signed_in.user
    if user is None:
        return ConsoleSessionInfo(csrf_token=signed_in.csrf_token, expires_at=signed_in.expires_at)
    return ConsoleSessionInfo(
        csrf_token=signed_in.csrf_token,
        expires_at=signed_in.expires_at,
        user=user.name,
        role=Role(user.role),
    )


@router.delete("/session", status_code=status.HTTP_204_NO_CONTENT)
def sign_out(request: Request, ctx: ContextDep, session: SessionDep) -> Response:
    """Ends the session server-side: the cookie stops working everywhere at once."""
    session_id = _cookie(request)
    console_session(request, ctx, session_id)  # a DELETE: the CSRF token is required
    console_sessions.end_session(session=session, session_id=session_id)
    response = Response(
        status_code=status.HTTP_204_NO_CONTENT, headers={"Cache-Control": "no-store"}
    )
    response.delete_cookie(
        SESSION_COOKIE,
        path="/",
        httponly=True,
        samesite="strict",
        secure=_is_tls(request, ctx.settings.public_url),
    )
    return response


def _cookie(request: Request) -> str:
    session_id = request.cookies.get(SESSION_COOKIE)
    if not session_id:
        raise AdminAuthError(
            "Not signed in to the console.",
            "Sign in with your name and password, or the admin token.",
            code="SESSION_MISSING",
        )
    return session_id


def mount_console(app: FastAPI, dist: Path = CONSOLE_DIST) -> None:
    """Serve the built console; without a build, `/` says how to make one."""
    index = dist / "index.html"

    async def page() -> Response:
        if not index.is_file():
            return HTMLResponse(
                "<!doctype html><title>ModelForge</title><p>The console is not built. Run "
                "<code>make install</code> (it runs <code>npm ci && npm run build</code> in "
                "control_plane/console); the API is at <a href=/docs>/docs</a>.</p>",
                status_code=503,
                headers=_SECURITY_HEADERS,
            )
        return FileResponse(index, headers=_SECURITY_HEADERS)

    for path in CONSOLE_ROUTES:
        app.add_api_route(path, page, methods=["GET"], include_in_schema=False)
    if (dist / "assets").is_dir():
        app.mount("/assets", StaticFiles(directory=dist / "assets"), name="console-assets")
