"""Models (WL-5c): `name@version` entries naming a runner, weights and default params.
Immutable once created: a version is never changed or reused, so a job or service that names
one always gets the same weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from control_plane.artifacts.store import reference_artifacts
from control_plane.catalog.schemas import ModelCreate, ModelPublic
from control_plane.clock import Clock
from control_plane.errors import Conflict, NotFound
from control_plane.models import Model
from control_plane.security import new_id


def create_model(*, session: Session, clock: Clock, request: ModelCreate) -> Model:
    ref = f"{request.name}@{request.version}"
    reference_artifacts(session, [request.weights], required=True, named_by=f"model {ref}")
    if _find(session, request.name, request.version) is not None:
        raise _exists(ref)
    model = Model(
        id=new_id("mdl"),
        name=request.name,
        version=request.version,
        runner=request.runner,
        weights=request.weights,
        params=request.params,
        created_at=clock.now(),
    )
    try:
        with session.begin_nested():  # two creations of one version at once: one wins
            session.add(model)
    except IntegrityError:
        raise _exists(ref) from None
    return model


def _exists(ref: str) -> Conflict:
    return Conflict(
        f"Model {ref} exists already; models are immutable.",
        "Create a new version (e.g. bump the version) instead of changing this one.",
        code="MODEL_EXISTS",
    )


def _find(session: Session, name: str, version: str) -> Model | None:
    return session.scalars(
        select(Model).where(Model.name == name, Model.version == version)
    ).one_or_none()


def list_models(*, session: Session, name: str | None, limit: int) -> list[Model]:
    query = select(Model).order_by(Model.created_at.desc(), Model.id).limit(limit)
    if name:
        query = query.where(Model.name == name)
    return list(session.scalars(query))


def get_model(*, session: Session, model_id: str) -> Model:
    model = session.get(Model, model_id)
    if model is None:
        raise NotFound(
            "No model with this id.", "List models with GET /api/v1/models.", code="MODEL_NOT_FOUND"
        )
    return model


@dataclass(frozen=True)
class ResolvedModel:
    ref: str
    runner: str
    weights: str
    params: dict[str, Any]


def resolve(session: Session, ref: str, *, named_by: str) -> ResolvedModel:
    """What `name@version` stands for; its weights are referenced (locked against the sweep)
    by the caller's transaction."""
    name, _, version = ref.partition("@")
    model = _find(session, name, version)
    if model is None:
        raise NotFound(
            f"{named_by} names model {ref}, which does not exist.",
            "Create it with POST /api/v1/models, or list the models with GET /api/v1/models.",
            code="MODEL_NOT_FOUND",
        )
    reference_artifacts(session, [model.weights], required=True, named_by=named_by)
    return ResolvedModel(ref, model.runner, model.weights, dict(model.params or {}))


def model_public(model: Model) -> ModelPublic:
    return ModelPublic(
        model_id=model.id,
        name=model.name,
        version=model.version,
        ref=f"{model.name}@{model.version}",
        runner=model.runner,
        weights=model.weights,
        params=model.params,
        created_at=model.created_at,
    )
