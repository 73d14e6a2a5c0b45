"""`GET /metrics` (OB-1): the Prometheus text format, outside `/api/v1` as Prometheus expects.

Read with the admin token (`X-ModelForge-Admin-Token`, the one check admin routes use) or with
`MODELFORGE_METRICS_TOKEN` as `Authorization: Bearer <token>`. The metrics token opens this
route and no other: nothing else reads it. Neither token is ever logged or echoed.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request, Response

from control_plane.access import metrics_token
from control_plane.api.deps import ContextDep, check_admin_token
from control_plane.api.routing import LaneRoute
from control_plane.errors import AdminAuthError
from control_plane.metrics import CONTENT_TYPE

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
    metrics_token.check_presented(presented=presented, configured=ctx.settings.metrics_token)


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
