"""Artifact lifetime for admins (AR-3a): the artifact list with who names each artifact, and the
sweep on demand (audited as `artifact.sweep`). Uploads and downloads live in `api/jobs.py`."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Body, Query

from control_plane.access.roles import Area
from control_plane.api.deps import AuditDep, ContextDep, SessionDep, needs
from control_plane.api.routing import LaneRoute
from control_plane.artifacts import sweep
from control_plane.artifacts.schemas import (
    ArtifactListed,
    ArtifactSweepReport,
    ArtifactSweepRequest,
)
from modelforge_contracts.digests import DIGEST_PATTERN

router = APIRouter(
    prefix="/api/v1", tags=["artifacts"], dependencies=[needs(Area.WORK)], route_class=LaneRoute
)


@router.get("/artifacts", response_model=list[ArtifactListed])
def list_artifacts(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
    before: Annotated[str | None, Query(pattern=f"^{DIGEST_PATTERN}$")] = None,
) -> list[ArtifactListed]:
    """Newest first, each with the models, deployed services and queued or running jobs that
    name it; pass the last digest of a page as `before` for the next one."""
    rows = sweep.list_artifacts(session=session, limit=limit, before=before)
    return [ArtifactListed.model_validate(row) for row in rows]


@router.post(
    "/admin/artifacts/sweep",
    response_model=ArtifactSweepReport,
    dependencies=[needs(Area.FLEET)],
)
def sweep_artifacts(
    ctx: ContextDep,
    session: SessionDep,
    audit: AuditDep,
    body: Annotated[ArtifactSweepRequest | None, Body()] = None,
) -> ArtifactSweepReport:
    """Delete the artifacts nothing names that are older than the grace period
    (`MODELFORGE_ARTIFACT_GRACE_SECONDS`); `{"dry_run": true}` only reports."""
    dry_run = body.dry_run if body is not None else False
    audit("artifact.sweep", "artifacts", dry_run=dry_run)
    report = sweep.sweep(
        session=session,
        store=ctx.artifacts,
        clock=ctx.clock,
        grace=timedelta(seconds=ctx.settings.artifact_grace_seconds),
        dry_run=dry_run,
    )
    audit(
        "artifact.sweep",
        "artifacts",
        dry_run=dry_run,
        deleted=len(report.deleted),
        removed_files=len(report.removed_files),
        bytes_freed=report.bytes_freed,
    )
    return ArtifactSweepReport.model_validate(report)
