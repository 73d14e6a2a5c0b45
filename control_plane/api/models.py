"""The model catalogue (WL-5c) for users (admin token or console session): register a model
version, list and read them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status

from control_plane.access.roles import Area
from control_plane.api.deps import AuditDep, ContextDep, SessionDep, needs
from control_plane.api.routing import LaneRoute
from control_plane.catalog import catalog
from control_plane.catalog.schemas import ModelCreate, ModelPublic
from control_plane.schemas import ResourceId

router = APIRouter(
    prefix="/api/v1", tags=["models"], dependencies=[needs(Area.WORK)], route_class=LaneRoute
)


@router.post("/models", status_code=status.HTTP_201_CREATED, response_model=ModelPublic)
def create_model(
    body: ModelCreate, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> ModelPublic:
    audit("model.create", f"{body.name}@{body.version}", weights=body.weights)
    model = catalog.create_model(session=session, clock=ctx.clock, request=body)
    return catalog.model_public(model)


@router.get("/models", response_model=list[ModelPublic])
def list_models(
    session: SessionDep,
    name: Annotated[str | None, Query(max_length=100)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[ModelPublic]:
    rows = catalog.list_models(session=session, name=name, limit=limit)
    return [catalog.model_public(row) for row in rows]


@router.get("/models/{model_id}", response_model=ModelPublic)
def get_model(model_id: ResourceId, session: SessionDep) -> ModelPublic:
    return catalog.model_public(catalog.get_model(session=session, model_id=model_id))
