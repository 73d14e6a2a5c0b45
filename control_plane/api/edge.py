"""The edge of the served app: what every request meets before any route, written as two thin
pure-ASGI seams just inside the heartbeat fast path.

`Edge` refuses a query string that holds a control character, bounds every request body — by
its `Content-Length` before a byte is read, and by counting the bytes of a chunked body as they
arrive, so memory never holds more than the limit — and gives every response the security
headers (a strict Content-Security-Policy unless the response brings its own). `JsonGuard`
(between the edge and FastAPI) reads a body whole and refuses JSON that is malformed, nested
deeper than `MAX_JSON_DEPTH` or holds a number that is not finite, before any route sees it, so
nothing is stored that a later read cannot return.

The common heartbeat never reaches these seams: the fast path in front of them reads at most
16 KiB of it, parses it once with pydantic (which has its own depth limit, and the heartbeat
model no field a non-finite number could reach) and answers with the same security headers; any
other heartbeat is handed here, body intact, like every other request (a `Content-Length` over
the limit is refused at once). Artifact uploads stream past the guard
to disk under their own, larger limit.

Refusals here are `ModelForgeError`s, answered with the same error body as everywhere else; they
never quote the request.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote_plus

from pydantic_core import from_json

from control_plane.api.asgi import ASGIApp, Message, Receive, Scope, Send, replay
from control_plane.context import AppContext
from control_plane.errors import InvalidRequest, ModelForgeError, RequestTooLarge
from modelforge_contracts.json_trees import tree_problem
from modelforge_contracts.text import UNSAFE_LINE

#: The deepest nesting of arrays and objects accepted in a JSON body (the body itself is 1).
MAX_JSON_DEPTH = 64

#: Every response gets these unless it set them itself (the console and /docs set their own
#: Content-Security-Policy, which allows their own scripts and styles).
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (
        b"content-security-policy",
        b"default-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)

# Bodies with a limit of their own: job submissions and an agent's job reports and results
# ("job"); artifact uploads, which stream to disk ("artifact"). Everything else: the general one.
_JOB_BODIES = re.compile(
    r"^/api/v1/jobs(:batch)?/?$|^/api/v1/agent/jobs/[^/]+/(events|complete)/?$"
)
_ARTIFACT_UPLOADS = {
    "POST": re.compile(r"^/api/v1/artifacts/?$"),
    "PUT": re.compile(r"^/api/v1/agent/artifacts/[^/]+/?$"),
}


def _is_artifact_upload(method: str, path: str) -> bool:
    pattern = _ARTIFACT_UPLOADS.get(method)
    return pattern is not None and pattern.match(path) is not None


class Edge:
    """The served ASGI app: body limits and security headers in front of `app` (the heartbeat
    fast path); `ctx` is the running control plane's context."""

    def __init__(self, app: ASGIApp, ctx: AppContext) -> None:
        self.app = app
        self.ctx = ctx
        self.body_limit = ctx.settings.max_body_bytes
        self.job_body_limit = ctx.settings.max_job_body_bytes
        self.artifact_limit = ctx.settings.max_artifact_bytes

    def limit_for(self, method: str, path: str) -> tuple[int, str]:
        """The body limit of a request and the setting that holds it."""
        if _is_artifact_upload(method, path):
            return self.artifact_limit, "MODELFORGE_MAX_ARTIFACT_BYTES"
        if method == "POST" and _JOB_BODIES.match(path):
            return self.job_body_limit, "MODELFORGE_MAX_JOB_BODY_BYTES"
        return self.body_limit, "MODELFORGE_MAX_BODY_BYTES"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _unsafe_query(scope.get("query_string", b"")):
            await _refuse(send, _bad_query())
            return
        limit, setting = self.limit_for(scope["method"], scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _refuse(send, _too_large(limit, setting))
            return
        counted = _CountedBody(receive, limit, setting)
        started = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                exceeded = counted.exceeded
                if exceeded is not None and message["status"] != exceeded.http_status:
                    # The app read past the limit and answered something else (whatever it made
                    # of the refusal): the client is told what happened instead.
                    raise exceeded
                started = True
                message["headers"] = _with_security_headers(message.get("headers") or [])
            await send(message)

        try:
            await self.app(scope, counted.receive, guarded_send)
        except RequestTooLarge as refusal:
            if started:
                raise
            await _refuse(send, refusal)


class JsonGuard:
    """Refuses a JSON body that is malformed, too deep or not finite; hands on the rest, whole."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_artifact_upload(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            body = await _read_body(receive)
        except _Disconnected:
            return  # the client went away: nobody to answer
        except ModelForgeError as too_large:  # the edge's limit, reached while reading
            await _refuse(send, too_large)
            return
        refusal = check_json(body) if body else None
        if refusal is not None:
            await _refuse(send, refusal)
            return
        await self.app(scope, replay(body, receive), send)


def check_json(body: bytes) -> ModelForgeError | None:
    """Why `body` is refused as JSON, or None. Every route but the artifact uploads takes JSON,
    so a body is checked whatever its Content-Type claims."""
    try:
        value = from_json(body, allow_inf_nan=True, cache_strings=False)
    except ValueError as exc:
        if "recursion limit" in str(exc):  # deeper than the parser goes: deeper than ours
            return _too_deep()
        return invalid_json()
    problem = tree_problem(value, max_depth=MAX_JSON_DEPTH, finite=True)
    if problem == "too_deep":
        return _too_deep()
    return _not_finite() if problem == "not_finite" else None


def invalid_json() -> ModelForgeError:
    return ModelForgeError(
        "The body is not JSON this control plane can read (malformed, not UTF-8, a lone "
        "surrogate in a string, or an integer of more than 4300 digits).",
        "Send a JSON body matching the schema in /docs.",
        code="INVALID_JSON",
    )


def _too_deep() -> ModelForgeError:
    return InvalidRequest(
        f"The JSON body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels.",
        f"Flatten the data to at most {MAX_JSON_DEPTH} levels (for example, encode a deep "
        "structure as a string or upload it as an artifact).",
        code="JSON_TOO_DEEP",
    )


def _not_finite() -> ModelForgeError:
    return InvalidRequest(
        "The JSON body holds a number that is not finite (NaN, Infinity, -Infinity, or a number "
        "too large for a 64-bit float, such as 1e999).",
        "Send finite numbers only; encode a missing value as null.",
        code="JSON_NOT_FINITE",
    )


def _unsafe_query(raw: bytes) -> bool:
    """A query string that, decoded, holds a control character (NUL among them) or a mark that
    reorders text: no filter or option takes one, and PostgreSQL cannot even compare text with a
    NUL in it."""
    return bool(raw) and UNSAFE_LINE.search(unquote_plus(raw.decode("latin-1"))) is not None


def _bad_query() -> ModelForgeError:
    return InvalidRequest(
        "The query string holds a control character (such as NUL or an escape) or a "
        "bidirectional-text mark.",
        "Send printable text in query parameters, percent-encoded as URLs require.",
        code="INVALID_QUERY",
    )


def _too_large(limit: int, setting: str) -> RequestTooLarge:
    return RequestTooLarge(
        f"The request body is larger than this endpoint accepts ({limit} bytes).",
        f"Send a smaller body; an operator can raise the limit with {setting}.",
    )


class _Disconnected(Exception):
    pass


class _CountedBody:
    """`receive`, counting body bytes; past the limit it raises `RequestTooLarge` instead of
    returning the chunk, so no app ever holds more than the limit."""

    def __init__(self, receive: Receive, limit: int, setting: str) -> None:
        self._receive = receive
        self.limit = limit
        self.setting = setting
        self.seen = 0
        self.exceeded: RequestTooLarge | None = None

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit:
                self.exceeded = _too_large(self.limit, self.setting)
                raise self.exceeded
        return message


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            raise _Disconnected
        chunks.append(message.get("body", b""))
        more = bool(message.get("more_body"))
    return b"".join(chunks)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses such a request before it gets here
    return None


def _with_security_headers(headers: Any) -> Any:
    # A response with a policy of its own (the console's, /docs') brings all three itself.
    for name, _ in headers:
        if name == b"content-security-policy":
            return headers
    return [*headers, *SECURITY_HEADERS]


async def _refuse(send: Send, refusal: ModelForgeError) -> None:
    body = json.dumps(refusal.to_body(), separators=(",", ":")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *SECURITY_HEADERS,
    ]
    if isinstance(refusal, RequestTooLarge):
        headers.append((b"connection", b"close"))  # the rest of the body is never read
    await send({"type": "http.response.start", "status": refusal.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
