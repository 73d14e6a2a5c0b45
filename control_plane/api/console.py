"""The web console: its sign-in session endpoints, and its built single-page app
served at `/`.

Signing in exchanges the admin token, or a user's name and password, for an HttpOnly,
SameSite=Strict cookie (Secure over TLS); the console keeps the CSRF token in memory and sends it
with every change. Neither the admin token nor a password is stored by the browser.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request, Response, status
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

from control_plane.access import console_sessions, people
from control_plane.access.roles import Role
from control_plane.access.schemas import ConsoleSessionInfo, SignInRequest
from control_plane.api.deps import (
    SESSION_COOKIE,
    ContextDep,
    SessionDep,
    check_admin_token,
    client_address,
    console_session,
)
from control_plane.api.routing import LaneRoute
from control_plane.errors import AdminAuthError
from control_plane.models import User

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
        user = people.check_password(
            session=session,
            clock=ctx.clock,
            throttle=ctx.password_throttle,
            address=client_address(request),
            name=body.name or "",
            password=body.password.get_secret_value() if body.password else "",
        )
    lifetime = ctx.settings.console_session_seconds
    signed_in = console_sessions.start_session(
        session=session,
        clock=ctx.clock,
        lifetime=timedelta(seconds=lifetime),
        user_id=None if user is None else user.id,
    )
    response.set_cookie(
        SESSION_COOKIE,
        signed_in.session_id,
        max_age=int(lifetime),
        path="/",
        httponly=True,
        samesite="strict",
        secure=_is_tls(request, ctx.settings.public_url),
    )
    response.headers["Cache-Control"] = "no-store"
    return _info(signed_in, user)


@router.get("/session", response_model=ConsoleSessionInfo)
def current_session(request: Request, response: Response, ctx: ContextDep) -> ConsoleSessionInfo:
    """Lets a reloaded console recover its CSRF token and who is signed in; readable only by the
    same origin."""
    signed_in = console_session(request, ctx, _cookie(request))
    response.headers["Cache-Control"] = "no-store"
    user = None
    if signed_in.user_id is not None:
        with ctx.read_session_factory() as session:
            user = session.get(User, signed_in.user_id)
    return _info(signed_in, user)


def _info(signed_in: console_sessions.SignedIn, user: User | None) -> ConsoleSessionInfo:
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
