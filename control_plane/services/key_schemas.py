"""The bodies of the gateway's access tokens and the OpenAI API's keys (issues 27 and 43): a
service's own token, a key of several services or of every LLM service, their views, and the
usage of their calls."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from control_plane.schemas import Line, StrictModel

# -- access tokens (the gateway's) -------------------------------------------------------------


class AccessTokenCreate(StrictModel):
    """A service's access token: `rate_per_second` requests a second with bursts of `burst`
    (default: a second's worth), per control-plane process; neither: unlimited.
    `tokens_per_minute`: the LLM tokens its OpenAI calls may use in any 60 s (None: no limit)."""

    model_config = ConfigDict(strict=True)

    name: Annotated[Line, StringConstraints(min_length=1, max_length=100)]
    rate_per_second: Annotated[float, Field(gt=0, le=1_000_000)] | None = None
    burst: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    tokens_per_minute: Annotated[int, Field(ge=1, le=1_000_000_000)] | None = None


class ApiKeyCreate(StrictModel):
    """An API key of no one service: it opens the `services` named (their names or ids), or
    with `llm_services` every LLM service; limited as a service's token may be."""

    model_config = ConfigDict(strict=True)

    name: Annotated[Line, StringConstraints(min_length=1, max_length=100)]
    services: Annotated[
        list[Annotated[Line, StringConstraints(min_length=1, max_length=100)]],
        Field(max_length=100),
    ] = Field(default_factory=list)
    llm_services: bool = False
    rate_per_second: Annotated[float, Field(gt=0, le=1_000_000)] | None = None
    burst: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    tokens_per_minute: Annotated[int, Field(ge=1, le=1_000_000_000)] | None = None


class AccessTokenPublic(BaseModel):
    """A token as lists show it: its hint, never the token."""

    id: str
    #: The service it was minted under (scope `service`); None for a key of no one service.
    service_id: str | None
    #: What it opens: `service` (its service), `services` (those in `services`), `llm` (every
    #: LLM service).
    scope: Literal["service", "services", "llm"] = "service"
    services: list[str] = Field(default_factory=list)
    name: str
    hint: str
    rate_per_second: float | None
    burst: int | None
    tokens_per_minute: int | None
    created_at: datetime
    created_by: str
    last_used_at: datetime | None
    revoked_at: datetime | None


class AccessTokenMinted(AccessTokenPublic):
    #: Shown once, in the answer to the mint; only its SHA-256 digest is kept.
    token: str = Field(repr=False)


# -- the OpenAI API's usage --------------------------------------------------------------------


class TokenUsage(BaseModel):
    """One access token's OpenAI calls to a service over a window, as the engine counted
    their tokens (a call whose answer carried no count adds a request and no tokens)."""

    token_id: str
    name: str
    hint: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


class ServiceUsage(BaseModel):
    """`GET /api/v1/services/{id}/usage`: its OpenAI calls from `since` to `until` (whole
    minutes), per token and in total."""

    service_id: str
    since: datetime
    until: datetime
    tokens: list[TokenUsage]
    requests: int
    prompt_tokens: int
    completion_tokens: int
