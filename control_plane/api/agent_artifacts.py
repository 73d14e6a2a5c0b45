"""Agent API for artifacts: streaming upload and ranged download, authenticated by the node
credential. Served by every control-plane process, and alone by an artifact host
(`control_plane/artifact_host.py`, `modelforge-control-plane --artifacts-only`)."""

from __future__ import annotations

from fastapi import APIRouter, Request, status
from fastapi.responses import FileResponse

from control_plane.api.deps import ContextDep, NodeDep
from control_plane.api.ranges import artifact_response
from control_plane.api.routing import LaneRoute
from control_plane.artifacts import store
from control_plane.artifacts.schemas import ArtifactPublic
from control_plane.schemas import Digest

router = APIRouter(prefix="/api/v1/agent", tags=["agent"], route_class=LaneRoute)


@router.put(
    "/artifacts/{digest}", status_code=status.HTTP_201_CREATED, response_model=ArtifactPublic
)
async def upload_artifact(
    digest: Digest, request: Request, node: NodeDep, ctx: ContextDep
) -> ArtifactPublic:
    """Streaming upload; refused unless the content hashes to `digest`."""
    stored, size = await ctx.artifacts.receive(request.stream(), expected=digest)

    def record() -> ArtifactPublic:
        with ctx.session_factory.begin() as session:
            row = store.record_upload(
                session=session, clock=ctx.clock, digest=stored, size=size, node_id=node.node_id
            )
            return ArtifactPublic(
                digest=row.digest, size_bytes=row.size_bytes, created_at=row.created_at
            )

    return await ctx.lanes.agent.run(record)


@router.get("/artifacts/{digest}", response_class=FileResponse)
def download_artifact(
    digest: Digest, request: Request, node: NodeDep, ctx: ContextDep
) -> FileResponse:
    """Streaming download with HTTP range requests, so an interrupted transfer resumes. Only
    what this node's jobs name, or what it uploaded; anything else is 404 ARTIFACT_NOT_FOUND."""
    with ctx.read_session_factory() as session:  # read-only: waits for no writer
        store.get_artifact_for_node(
            session=session,
            store=ctx.artifacts,
            clock=ctx.clock,
            digest=digest,
            node_id=node.node_id,
        )
    return artifact_response(ctx.artifacts.path_for(digest), digest=digest, headers=request.headers)
