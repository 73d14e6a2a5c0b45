"""The vault's request and response bodies: secrets (WL-6a), never showing a value, and the
secret names jobs and services are given."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints

from control_plane.schemas import Labels, StrictModel

SecretName = Annotated[str, StringConstraints(pattern=r"^[A-Z_][A-Z0-9_]{0,99}$")]
SecretNames = Annotated[list[SecretName], Field(max_length=32)]


class SecretPut(StrictModel):
    value: Annotated[str, StringConstraints(min_length=1, max_length=65536)] = Field(repr=False)
    labels: Labels = Field(default_factory=dict)


class SecretPublic(BaseModel):
    """A secret as the API shows it: never its value."""

    name: str
    labels: dict[str, str]
    created_at: datetime
    updated_at: datetime
