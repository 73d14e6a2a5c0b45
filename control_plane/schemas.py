"""The shared base of the request and response bodies, kept separate from the ORM tables:
`StrictModel` (what every input body refuses), the text, label and digest types the domains'
bodies are made of, the error body, and the control plane's own bodies (health, version, the
audit log). Each domain's bodies live in its own `schemas.py`; this module imports none of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from functools import cache
from typing import Annotated, Any, Literal, get_args, get_origin

from fastapi import Path
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from modelforge_contracts.digests import DIGEST_PATTERN
from modelforge_contracts.text import UNSAFE_LINE, UNSAFE_TEXT


def _refuse(unsafe: re.Pattern[str], allowed: str) -> Callable[[str], str]:
    """A validator refusing text shown to people that holds control characters (ANSI escapes
    included) or bidirectional-text controls; `allowed` names the exceptions."""

    def check(value: str) -> str:
        if unsafe.search(value):
            raise ValueError(
                f"must not contain control characters{allowed} (ANSI escapes included) or "
                "bidirectional-text controls"
            )
        return value

    return check


#: A line of text for people: no control characters, no bidirectional-text controls.
Line = Annotated[str, AfterValidator(_refuse(UNSAFE_LINE, " (line breaks too)"))]
#: Text of several lines: the same, but tabs and line breaks allowed.
Text = Annotated[str, AfterValidator(_refuse(UNSAFE_TEXT, " other than tab and line breaks"))]
LabelKey = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([a-z0-9._/-]{0,62})$")]
LabelValue = Annotated[Line, StringConstraints(max_length=128)]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=32)]
Hostname = Annotated[Line, StringConstraints(min_length=1, max_length=255, pattern=r"^[^\s]+$")]
Version = Annotated[Line, StringConstraints(min_length=1, max_length=64)]
NonNegative = Annotated[float, Field(ge=0)]
#: The largest value an INTEGER column holds on PostgreSQL (int4; SQLite holds up to 2**63 - 1):
#: an integer sent to be stored in one, or compared with one, is refused above it.
DB_INT_MAX = 2**31 - 1
#: Path parameters naming a resource (`node_…`, `enr_…`).
ResourceId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
ShortText = Annotated[Line, StringConstraints(max_length=96)]
#: An artifact's content digest (a job's inputs and outputs, a model's or service's weights).
Digest = Annotated[str, StringConstraints(pattern=f"^{DIGEST_PATTERN}$")]
#: The name of a model or of a service.
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")]


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(key) or _has_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_has_nul(item) for item in value)
    return False


class StrictModel(BaseModel):
    """Input bodies: unknown fields refused; NUL characters refused (no database stores them)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: Any) -> Any:
        # The message names the field when it is one of the model's, never a key it was sent.
        if isinstance(data, dict):
            for key, item in data.items():
                if _has_nul(key) or _has_nul(item):
                    name = key if key in cls.model_fields else "a field"
                    raise ValueError(f"{name} must not contain NUL characters")
        elif _has_nul(data):
            raise ValueError("the value must not contain NUL characters")
        return data


@cache
def schema_words() -> frozenset[str]:
    """The field names of every request body, and the values of their literal fields (the tags
    of a union among them): the words a validation error may name without quoting the input."""
    words: set[str] = set()
    pending: list[type[BaseModel]] = [StrictModel]
    while pending:
        model = pending.pop()
        pending.extend(model.__subclasses__())
        for name, field in model.model_fields.items():
            words.add(name)
            if field.alias:
                words.add(field.alias)
            if get_origin(field.annotation) is Literal:
                words.update(str(value) for value in get_args(field.annotation))
    return frozenset(words)


# -- errors ------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    code: str
    message: str
    next_step: str


class ErrorBody(BaseModel):
    error: ErrorDetail


# -- shared by several domains -----------------------------------------------------------------

#: A node's liveness state (the fleet judges it; the metrics count by it).
NodeState = Literal["online", "stale", "offline"]


class Accepted(BaseModel):
    accepted: bool = True
    received_at: datetime


# What a job or a service asks of its node.
class JobResources(StrictModel):
    #: Strict: `"1"` or `true` for a number is refused, not read as 1.
    model_config = ConfigDict(strict=True)

    cpus: Annotated[float, Field(ge=0, le=4096)] = 1.0
    gpus: Annotated[int, Field(ge=0, le=64)] = 0
    memory_mb: Annotated[int, Field(ge=0, le=16_000_000)] = 0


# -- the control plane's own -------------------------------------------------------------------


class StorageHealth(BaseModel):
    """The room left in the data dir (the least of its file systems, the artifacts' included)."""

    status: Literal["ok", "low"]
    free_bytes: int
    total_bytes: int
    #: `MODELFORGE_STORAGE_LOW_FREE_BYTES`: below this much free room the status is `low`.
    low_below_bytes: int


class Health(BaseModel):
    #: `degraded`: it serves, but needs an operator soon (the storage is low).
    status: Literal["ok", "degraded"]
    database: Literal["ok"]
    storage: StorageHealth


class VersionInfo(BaseModel):
    version: str
    protocol_version: int
    accepted_protocols: list[int]


class AuditEntryPublic(BaseModel):
    id: int
    at: datetime
    actor: str
    action: str
    target: str
    outcome: str
    detail: dict[str, Any]
