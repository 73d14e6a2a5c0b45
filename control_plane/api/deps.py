"""Named dependencies: the app context, a database session, the admin and node principals."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from control_plane.context import AppContext
from control_plane.errors import AdminAuthError, CredentialError
from control_plane.services.credentials import NodePrincipal


async def get_context(request: Request) -> AppContext:
    ctx: AppContext = request.app.state.ctx
    return ctx


ContextDep = Annotated[AppContext, Depends(get_context)]


def get_session(ctx: ContextDep) -> Iterator[Session]:
    """One transaction per request, committed before the response is sent."""
    with ctx.session_factory.begin() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def require_admin(
    ctx: ContextDep,
    token: Annotated[
        str | None, Header(alias="X-ModelForge-Admin-Token", include_in_schema=True)
    ] = None,
) -> None:
    if not token:
        raise AdminAuthError(
            "This endpoint needs the admin token.",
            "Send it in the X-ModelForge-Admin-Token header.",
            code="ADMIN_TOKEN_MISSING",
        )
    if not ctx.admin_token.matches(token):
        raise AdminAuthError(
            "The admin token is not valid.",
            f"Use the token from {ctx.admin_token.origin}.",
            code="ADMIN_TOKEN_INVALID",
        )


AdminDep = Depends(require_admin)


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
    principal, known = ctx.authority.verify(token.strip())
    if not known:
        await run_in_threadpool(_load_status, ctx, principal)
    return principal


def _load_status(ctx: AppContext, principal: NodePrincipal) -> None:
    with ctx.session_factory() as session:
        ctx.authority.load_status(session, principal)


NodeDep = Annotated[NodePrincipal, Depends(require_node)]
