"""The OpenAI API's routes the control plane answers itself (issue 43; docs/llm.md):
`GET /v1/models`, the LLM services the caller's key opens, in OpenAI's list shape; and the
gateway's own answers to an OpenAI call in OpenAI's error shape (`openai_answer`, `shaped`: the
native front's decisions, `api/gateway_native.py`, apply them).

The calls (`POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`) are the gateway's,
carried by the native front (`native/gateway_front/src/openai.rs`, decided in
`gateway/openai.py`). They reach these routes only when the gateway runs in Python (with a peer
address, or `MODELFORGE_GATEWAY_FRONT=python`), which does not carry them: the answer is a 503
in OpenAI's shape that names why, never a 404 that looks like an unknown route.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from control_plane.api.deps import ContextDep
from control_plane.api.gateway import Answer, Gateway
from control_plane.api.routing import LaneRoute
from control_plane.gateway import openai

router = APIRouter(tags=["openai"], route_class=LaneRoute)


async def openai_answer(
    gateway: Gateway, answer: Answer, call: openai.Call, headers: list[list[str]]
) -> Answer:
    """The gateway's own answer to an OpenAI call, in OpenAI's shape: a key refused for this
    model is told apart from a key that opens nothing (`openai.reshaped`)."""
    key_valid = False
    if answer.status == 401:
        authorization = next((v for k, v in headers if k == "authorization"), "")
        key_valid = await gateway.auth.holder_async(authorization) is not None
    status, body = openai.reshaped(answer.status, answer.body, call, key_valid=key_valid)
    extra = [pair for pair in answer.extra if status == 401 or pair[0] != b"www-authenticate"]
    return Answer(status, body, extra, answer.label)


def shaped(answer: Answer, call: openai.Call | None) -> Answer:
    """`answer` in OpenAI's shape for an OpenAI call (unchanged for any other request)."""
    if call is None:
        return answer
    status, body = openai.reshaped(answer.status, answer.body, call, key_valid=True)
    return Answer(status, body, answer.extra, answer.label)


@router.get("/v1/models")
async def list_models(request: Request, ctx: ContextDep) -> JSONResponse:
    """The LLM services the `Authorization: Bearer` key opens (a service's access token its own
    service; a key of several services those it names, or every LLM service)."""
    gateway = request.app.state.gateway
    grant = await gateway.auth.holder_async(request.headers.get("authorization"))
    if grant is None:
        message = (
            "Send an API key as `Authorization: Bearer <key>`: a service's access token, "
            "minted with POST /api/v1/services/{service_id}/tokens."
        )
        return JSONResponse(
            openai.error_body(401, message, "invalid_api_key"),
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="modelforge"'},
        )
    with ctx.read_session_factory() as session:
        data = openai.models_opened(session, grant)
    return JSONResponse({"object": "list", "data": data})


async def _not_carried(ctx: ContextDep) -> JSONResponse:
    settings = ctx.settings
    reason = (
        "MODELFORGE_GATEWAY_FRONT=python"
        if settings.gateway_front == "python"
        else "a peer address is set"
        if settings.gateway_peer_address
        else "its native front is not running"
    )
    message = (
        f"The OpenAI API's calls are carried by the native gateway front, and this control "
        f"plane runs its gateway in Python ({reason}). Unset MODELFORGE_GATEWAY_FRONT and "
        "run one control-plane replica without MODELFORGE_GATEWAY_PEER_ADDRESS (docs/llm.md)."
    )
    return JSONResponse(openai.error_body(503, message, "openai_api_unavailable"), status_code=503)


for _path in openai.ENDPOINTS:
    router.add_api_route(_path, _not_carried, methods=["POST"], include_in_schema=False)
