"""The catalog's request and response bodies: models (WL-5c) and the `name@version` reference
jobs and services name one by."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from control_plane.schemas import Digest, Name, StrictModel

Runner = Literal["onnx", "llama.cpp", "command"]
#: A model by `name@version`, as jobs and services name the one they run.
ModelRef = Annotated[
    str,
    StringConstraints(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}@[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$",
        max_length=201,
    ),
]


class ModelCreate(StrictModel):
    name: Name
    version: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")]
    runner: Runner = "onnx"
    weights: Digest
    params: dict[str, Any] = Field(default_factory=dict)


class ModelPublic(BaseModel):
    model_id: str
    name: str
    version: str
    ref: str
    runner: str
    weights: str
    params: dict[str, Any]
    created_at: datetime
