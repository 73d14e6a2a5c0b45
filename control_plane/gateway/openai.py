"""The OpenAI API at the control plane's address (issue 43; docs/llm.md): which service a call's
`model` names, what a call may ask of it, and every refusal in OpenAI's error shape.

The native front takes `POST /v1/chat/completions`, `/v1/completions` and `/v1/embeddings`
(`native/gateway_front/src/openai.rs`): it reads the body whole (bounded), refuses one that is
not a JSON object with a `model`, and asks for the request as `/services/{model}{path}` with the
call's facts (`Call`). The gateway then decides as for any request to that service (its key, its
rate, a replica), and here:

- the key (`Authorization: Bearer`, a service's access token) must open the model: a key that
  opens nothing is 401 `invalid_api_key`; a valid key that does not open the named model, or a
  model that is not an LLM service, is 404 `model_not_found` (the same answer whether the model
  exists or not, so a key learns no other service's name);
- `max_tokens` (or `max_completion_tokens`) above the service's `llm.max_tokens` is 400;
- a key whose calls of the last minute used its `tokens_per_minute` is 429 with `Retry-After`
  (`tokens_spent`; the window is `gateway/usage.py`'s);
- every answer the gateway gives itself is reshaped to `{"error": {"message", "type", "param",
  "code"}}` with the same status. The engine's own answers (a prompt beyond the context is
  llama-server's 400) reach the client as the engine gave them.

It decides nothing else and imports no transport: `api/gateway_native.py` applies it, and
`api/openai_models.py` serves `GET /v1/models` from `models_opened`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.gateway.routing import ServiceTarget
from control_plane.gateway.usage import UsageBook
from control_plane.models import Service
from control_plane.services import aliases
from control_plane.services.access_tokens import Grant
from control_plane.services.schemas import LLM_RUNNERS

#: The calls the front carries as the OpenAI API (`GET /v1/models` is the API's own route).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

#: OpenAI's error `type` for a status (5xx: `server_error`).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
#: The `code` of a gateway answer by its status, when nothing more specific applies.
_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    408: "request_timeout",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    502: "replica_unreachable",
    503: "model_unavailable",
    504: "replica_timeout",
}


@dataclass(frozen=True, slots=True)
class Call:
    """What the front read of an OpenAI call's body: the model it names and the tokens it
    asks for at most (None: not given)."""

    model: str
    max_tokens: int | None

    @classmethod
    def from_ask(cls, value: Any) -> Call:
        if not isinstance(value, dict) or not isinstance(value.get("model"), str):
            raise ValueError("an OpenAI call names its model")
        limit = value.get("max_tokens")
        if not isinstance(limit, int) or isinstance(limit, bool):
            limit = None
        return cls(value["model"], limit)


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_not_found(model: str) -> tuple[int, dict[str, Any]]:
    shown = json.dumps(model[:200])
    message = (
        f"The model {shown} does not exist, is not an LLM service, or this API key does not "
        "open it. List the models this key may call with GET /v1/models."
    )
    return 404, error_body(404, message, "model_not_found", "model")


def refusal(service: ServiceTarget, call: Call) -> tuple[int, dict[str, Any]] | None:
    """Why a granted call may not go to `service` (None: it may)."""
    if service.kind != "llm":
        return model_not_found(call.model)
    limit = service.max_tokens
    if limit is not None and call.max_tokens is not None and call.max_tokens > limit:
        message = (
            f"max_tokens is {call.max_tokens}; model {service.name!r} allows at most {limit}. "
            "Ask for fewer tokens."
        )
        return 400, error_body(400, message, "max_tokens_exceeded", "max_tokens")
    return None


def tokens_spent(grant: Grant, usage: UsageBook | None) -> tuple[dict[str, Any], bytes] | None:
    """For a key whose calls of the last minute used its `tokens_per_minute`: the 429's body in
    OpenAI's shape and its `Retry-After`; None while the key may call."""
    limit = grant.tokens_per_minute
    if limit is None or usage is None:
        return None
    wait = usage.wait_for(grant.token_id, limit)
    if wait is None:
        return None
    message = (
        f"This API key's limit of {limit} tokens per minute is reached. Retry after {wait} s; "
        "an administrator can mint a key with a higher tokens_per_minute."
    )
    return error_body(429, message, "tokens_per_minute_exceeded"), str(wait).encode()


def llm_elsewhere(
    service: ServiceTarget, what: str, method: str
) -> tuple[int, str, list[tuple[bytes, bytes]]] | None:
    """An LLM service reached outside `/v1` (None: it may be): the Open Inference Protocol's
    paths are not its (404), and at `/services/{name}/` its engine's routes answer `GET` and
    `HEAD` only (405): generation goes through `/v1`, where its tokens are counted and limited."""
    if service.kind != "llm":
        return None
    where = f"service {service.name!r} is an LLM: call it with the OpenAI API at /v1"
    if what in ("model", "model_ready"):
        return 404, f"{where} (model {service.name!r})", []
    if method not in ("GET", "HEAD"):
        message = (
            f"{where} (model {service.name!r}); its engine's own routes at "
            f"/services/{service.name}/<path> answer GET only"
        )
        return 405, message, [(b"allow", b"GET, HEAD")]
    return None


def reshaped(status: int, body: Any, call: Call, *, key_valid: bool) -> tuple[int, dict[str, Any]]:
    """The gateway's own answer (`{"error": message}`) in OpenAI's shape: a 401 for a key
    that is valid (for another service) becomes `model_not_found`."""
    if status == 401 and key_valid:
        return model_not_found(call.model)
    message = body.get("error") if isinstance(body, dict) else None
    if not isinstance(message, str):
        message = "the gateway refused the call"
    return status, error_body(status, message, _CODES.get(status, "gateway_error"))


def models_opened(session: Session, grant: Grant) -> list[dict[str, Any]]:
    """`GET /v1/models`' list for a key: the deployed LLM services it opens (its own service,
    those it names, or all), each by its name and then its aliases, in OpenAI's model
    shape."""
    query = select(Service.id, Service.name, Service.created_at).where(
        Service.state != "stopped", Service.runner.in_(sorted(LLM_RUNNERS))
    )
    if grant.scope == "services":
        query = query.where(Service.id.in_(sorted(grant.services)))
    elif grant.scope != "llm":
        query = query.where(Service.id == grant.service_id)
    rows = session.execute(query.order_by(Service.name)).all()
    held = aliases.by_service(session, [service_id for service_id, _, _ in rows])
    return [
        {"id": model, "object": "model", "created": int(at.timestamp()), "owned_by": "modelforge"}
        for service_id, name, at in rows
        for model in (name, *held.get(service_id, []))
    ]
