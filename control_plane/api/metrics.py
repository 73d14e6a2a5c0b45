"""`GET /metrics` (OB-1): the Prometheus text format, outside `/api/v1` as Prometheus expects.

Read with the admin token (`X-ModelForge-Admin-Token`, the one check admin routes use) or with
`MODELFORGE_METRICS_TOKEN` as `Authorization: Bearer <token>`. The metrics token opens this
route and no other: nothing else reads it. Neither token is ever logged or echoed.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request, Response

from control_plane.api.deps import ContextDep, check_admin_token
from control_plane.api.routing import LaneRoute
from control_plane.errors import AdminAuthError
from control_plane.metrics import CONTENT_TYPE
from control_plane.security import sha256_hex

router = APIRouter(tags=["observability"], route_class=LaneRoute)


def require_metrics_reader(
    request: Request,
    ctx: ContextDep,
    admin_token: Annotated[
        str | None, Header(alias="X-ModelForge-Admin-Token", include_in_schema=True)
    ] = None,
    authorization: Annotated[str | None, Header(include_in_schema=True)] = None,
) -> None:
    """The admin token header, or the metrics token as a bearer token."""
    if admin_token:
        check_admin_token(
            request, ctx, admin_token, then="send the X-ModelForge-Admin-Token header"
        )
        return
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise AdminAuthError(
            "GET /metrics needs the metrics token or the admin token.",
            "Send `Authorization: Bearer <MODELFORGE_METRICS_TOKEN>` (Prometheus: "
            "`authorization: {credentials_file: …}`), or the X-ModelForge-Admin-Token header.",
            code="METRICS_TOKEN_MISSING",
        )
    configured = ctx.settings.metrics_token
    # Digests of both sides: equal lengths, so the comparison's time says nothing. Not
    # throttled like the admin token (a Prometheus server with an old token would otherwise
    # lock its address out of the console); settings require 16 characters or more.
    if configured is None or not hmac.compare_digest(
        sha256_hex(presented.strip()), sha256_hex(configured.get_secret_value().strip())
    ):
        raise AdminAuthError(
            "The metrics token is not valid."
            if configured is not None
            else "No metrics token is configured on this control plane.",
            "Use the value of MODELFORGE_METRICS_TOKEN, or set it and restart; or send the "
            "admin token in the X-ModelForge-Admin-Token header.",
            code="METRICS_TOKEN_INVALID",
        )


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format"}},
    dependencies=[Depends(require_metrics_reader)],
)
def metrics(ctx: ContextDep) -> Response:
    """Nodes by state, queued and running jobs, placements and dispatch latency, heartbeats
    accepted, job outcomes by code, artifact store bytes (docs/operations.md#metrics)."""
    # Sync: the store's values are read from the database, on the metrics lane (lanes.py).
    return Response(
        ctx.metrics.render(), media_type=CONTENT_TYPE, headers={"Cache-Control": "no-store"}
    )
