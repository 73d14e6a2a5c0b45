"""The HTTP/REST front: the Open Inference Protocol on Granian's RSGI interface (`ModelApp`),
with the binary tensor data extension and Triton's metrics at `/metrics`.

It only decodes and encodes: bodies into `_oip.InferRequest`s, the data plane's arrays and
`ServingError`s into answers (`{"error": "..."}` with the error's HTTP status), each sent in
one write (`response_bytes`; hyper sets TCP_NODELAY), on kept-alive HTTP/1.1 connections.

Memory is bounded before anything is kept (`Limits`): a body over `max_request_bytes` and a
JSON part over `max_json_bytes` are refused from their declared lengths (413), and every body
being read, decoded, queued or run holds its size — its JSON part counted `JSON_EXPANSION`
times, what parsing it into Python objects may take — against one budget, `max_inflight_bytes`
(bodies over `SMALL_BODY` only three quarters of it, so that clients slow to send large bodies
cannot stall small requests); a request that does not fit waits for room (up to
`BUDGET_WAIT_SECONDS`, its body unread), then is refused (503). A compressed body holds its
size while it arrives, and the most it may inflate to only once it is here (in the large
bodies' lane), so that clients slow to send one hold only what they sent. A body comes with a
Content-Length and no Transfer-Encoding (411) and is read as it arrives, never past that length.
A body refused for its JSON part is read and dropped first, so that the client hears why.
Nesting too deep for the parser is a 400. It logs nothing about a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from runtime_worker._oip import ServingError, decode_infer_request, encode_infer_response
from runtime_worker._oip import split_request as split_body
from runtime_worker.serving import metrics
from runtime_worker.serving.batcher import CallerGone
from runtime_worker.serving.dataplane import DataPlane

log = logging.getLogger("modelforge.onnx_server")

#: What parsing JSON into Python objects may take, per byte of JSON (a nested list of one-digit
#: numbers is about 16 bytes of objects per byte).
JSON_EXPANSION = 16
#: How long a request waits for room in the byte budget before a 503.
BUDGET_WAIT_SECONDS = 30.0
#: A body larger than this may hold only three quarters of the budget (see `_infer`).
SMALL_BODY = 1024 * 1024

#: The route of calls relayed by the native gRPC front (`grpc_native.Relay`), followed by the
#: method's name; it answers only requests with the front's token.
RELAY_PREFIX = "/_modelforge/grpc/"

_JSON = [("content-type", "application/json")]
_CLOSE = [("content-type", "application/json"), ("connection", "close")]


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 64 * 1024 * 1024
    max_json_bytes: int = 8 * 1024 * 1024
    max_inflight_bytes: int = 512 * 1024 * 1024


class ByteBudget:
    """Bytes held by the requests in flight (on the event loop: no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._released: asyncio.Event | None = None

    def reserve(self, size: int) -> bool:
        """Hold `size` bytes now, or say no."""
        if self.used + size > self.limit:
            return False
        self.used += size
        return True

    async def wait_to_reserve(self, size: int, timeout: float, *, within: int = 0) -> bool:
        """Hold `size` bytes once others have released enough for all that is held to stay
        `within` (default: the limit), waiting at most `timeout` seconds; False at once for
        more than that."""
        within = min(within or self.limit, self.limit)
        deadline = time.monotonic() + timeout
        while self.used + size > within:
            left = deadline - time.monotonic()
            if size > within or left <= 0:
                return False
            if self._released is None:
                self._released = asyncio.Event()
            try:
                await asyncio.wait_for(self._released.wait(), left)
            except TimeoutError:
                return False
        self.used += size
        return True

    def release(self, size: int) -> None:
        self.used -= size
        if self._released is not None:  # wake the waiters; each checks again
            self._released.set()
            self._released = None


#: zlib's window bits for each compression this server inflates (gzip's header, zlib's).
WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def inflate(data: bytes, encoding: str, limit: int, what: str) -> bytes:
    """`data` (a request's `what`: body, message) inflated as `encoding` (a key of `WBITS`),
    never past `limit` bytes: 413 past it (nothing more is inflated), 400 when it does not
    inflate or ends before its stream does."""
    inflater = zlib.decompressobj(WBITS[encoding])
    try:
        inflated = inflater.decompress(data, limit + 1)
    except zlib.error:
        raise ServingError(400, f"the {what} does not inflate as {encoding}") from None
    if len(inflated) > limit:
        raise ServingError(
            413,
            f"the {what} inflates to more than {limit} bytes, the most this server takes "
            "(--max-request-bytes)",
        )
    if not inflater.eof:
        raise ServingError(400, f"the {what} ends before its {encoding} stream does")
    return inflated


def _error(status: int, message: str) -> bytes:
    return json.dumps({"error": message}, separators=(",", ":")).encode()


class ModelApp:
    """The RSGI application Granian runs: routes, limits, and the answers of one `DataPlane`.

    `on_start` and `on_stop` are coroutines run on Granian's event loop at start and stop (the
    entry point loads the model and starts the gRPC front there)."""

    def __init__(self, dataplane: DataPlane, limits: Limits) -> None:
        self.dataplane, self.limits = dataplane, limits
        self.budget = ByteBudget(limits.max_inflight_bytes)
        #: The native gRPC front's relay, when it runs (`grpc_native.Relay`).
        self.relay: Any = None
        self.name = dataplane.model.name
        self._infer_paths = {
            f"/v2/models/{self.name}/infer": None,
            f"/v2/models/{self.name}/versions/1/infer": "1",
        }

    # -- RSGI ------------------------------------------------------------------------------

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        if scope.proto != "http":
            return
        path, method = scope.path, scope.method
        try:
            if method == "POST" and path in self._infer_paths:  # the hot path
                await self._infer(scope, protocol, self.name, self._infer_paths[path])
                return
            relay = self.relay
            if (
                relay is not None
                and method == "POST"
                and path.startswith(RELAY_PREFIX)
                and relay.admits(scope.headers)
            ):
                await relay.answer(path[len(RELAY_PREFIX) :], scope.headers, protocol)
                return
            status, body, content_type = self._route(method, path)
        except ServingError as exc:
            protocol.response_bytes(exc.http_status, _JSON, _error(exc.http_status, exc.message))
            return
        except Exception as exc:  # a bug: answered, and logged without the request's data
            log.error("internal error on %s: %s", method, type(exc).__name__)
            body = _error(500, f"internal server error ({type(exc).__name__})")
            protocol.response_bytes(500, _JSON, body)
            return
        protocol.response_bytes(status, [("content-type", content_type)], body)

    def _route(self, method: str, path: str) -> tuple[int, bytes, str]:
        parts = [unquote(part) for part in path.split("/") if part]
        dataplane = self.dataplane
        if method == "GET" and parts == ["metrics"]:
            return 200, dataplane.metrics_text(), metrics.CONTENT_TYPE
        if method in ("GET", "HEAD"):
            if parts == ["v2"]:
                return _ok(dataplane.server_metadata())
            if parts == ["v2", "health", "live"]:
                return _ok({"live": dataplane.live()})
            if parts == ["v2", "health", "ready"]:
                ready = dataplane.ready()
                return _ok({"ready": ready}, 200 if ready else 503)
        target = _model_target(parts)
        if target is None:
            raise self._no_route(method, path)
        name, version, action = target
        if method in ("GET", "HEAD") and action == "ready":
            ready = dataplane.model_ready(name, version)
            return _ok({"name": name, "ready": ready}, 200 if ready else 503)
        if method in ("GET", "HEAD") and action == "":
            return _ok(dataplane.model_metadata(name, version))
        if method == "POST" and action == "infer":
            dataplane.check_model(name, version)  # the hot path took this model's own paths
        raise self._no_route(method, path)

    def _no_route(self, method: str, path: str) -> ServingError:
        name = self.name
        return ServingError(
            404,
            f"no route {method} {path[:200]}; this server answers /v2, /v2/health/live|ready, "
            f"/v2/models/{name}, /v2/models/{name}/ready, POST /v2/models/{name}/infer "
            "and /metrics",
        )

    # -- inference -------------------------------------------------------------------------

    async def _infer(self, scope: Any, protocol: Any, name: str, version: str | None) -> None:
        headers, limits = scope.headers, self.limits
        declared = _declared(headers.get("content-length"))
        # A body comes only as Content-Length bytes: with a Transfer-Encoding beside it, which
        # of the two frames the body is the HTTP server's choice, not what was counted.
        if declared is None or headers.get("transfer-encoding") is not None:
            message = "send the body with a Content-Length and no Transfer-Encoding (not chunked)"
            protocol.response_bytes(411, _CLOSE, _error(411, message))
            return
        if declared > limits.max_request_bytes:
            message = (
                f"the request body is {declared} bytes; this server accepts at most "
                f"{limits.max_request_bytes} (--max-request-bytes)"
            )
            protocol.response_bytes(413, _CLOSE, _error(413, message))
            return
        encoding = headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", "gzip", "deflate"):
            message = f"Content-Encoding {encoding[:40]} is not supported: gzip, deflate or none"
            protocol.response_bytes(400, _CLOSE, _error(400, message))
            return
        header_length = headers.get("inference-header-content-length")
        if encoding == "identity":
            json_length = _declared(header_length) if header_length is not None else declared
            cost = declared + JSON_EXPANSION * min(json_length or 0, declared)
        else:  # the inflated size is known only once inflated: counted once the body is here
            json_length, cost = None, declared
        if json_length is not None and json_length > limits.max_json_bytes:
            # Read and dropped (never kept), so that the client, still sending, hears why.
            await _discard(protocol)
            protocol.response_bytes(413, _JSON, _error(413, self._json_too_large(json_length)))
            return
        # A large body may not take the last of the budget: small requests (most inferences)
        # keep a lane of their own, so clients slow to send large bodies cannot stall them.
        lane = self.budget.limit if declared <= SMALL_BODY else self.budget.limit * 3 // 4
        if not await self.budget.wait_to_reserve(cost, BUDGET_WAIT_SECONDS, within=lane):
            await self._refuse_busy(protocol, cost)
            return
        try:
            body = await _read_body(protocol, declared)
            if body is None:
                return  # the body was cut short: the client has gone
            if encoding != "identity":
                # The most it may inflate to, held only while it is inflated, decoded and run
                # (not while a slow client sends it) and in the large bodies' lane.
                inflated = limits.max_request_bytes + JSON_EXPANSION * limits.max_json_bytes
                large_lane = self.budget.limit * 3 // 4
                if not await self.budget.wait_to_reserve(
                    inflated, BUDGET_WAIT_SECONDS, within=large_lane
                ):
                    protocol.response_bytes(503, _JSON, _error(503, self._busy(inflated)))
                    return
                cost += inflated
            status, answer, reply_headers = await self._answer(
                body, encoding, header_length, name, version, protocol
            )
        except CallerGone:
            return  # the client went away while its request waited: nobody to answer
        except ServingError as exc:  # a body longer than declared: never kept
            protocol.response_bytes(exc.http_status, _CLOSE, _error(exc.http_status, exc.message))
            return
        finally:
            self.budget.release(cost)
        protocol.response_bytes(status, reply_headers, answer)

    async def _refuse_busy(self, protocol: Any, cost: int) -> None:
        await _discard(protocol)  # so that the client, still sending, hears why
        protocol.response_bytes(503, _JSON, _error(503, self._busy(cost)))

    def _busy(self, cost: int) -> str:
        return (
            f"the request would hold {cost} bytes and {self.budget.used} of "
            f"{self.budget.limit} (--max-inflight-bytes) stayed held by requests in flight "
            f"for {BUDGET_WAIT_SECONDS:.0f} s; retry later or send tensors as binary data"
        )

    async def _answer(
        self,
        body: bytes,
        encoding: str,
        header_length: str | None,
        name: str,
        version: str | None,
        protocol: Any,
    ) -> tuple[int, bytes, list[tuple[str, str]]]:
        dataplane = self.dataplane
        try:
            if encoding != "identity":
                body = inflate(body, encoding, self.limits.max_request_bytes, "body")
                size = len(body) if header_length is None else (_declared(header_length) or 0)
                if size > self.limits.max_json_bytes:
                    raise ServingError(413, self._json_too_large(size))
            header, binary = split_body(body, header_length)
            request = decode_infer_request(
                header, binary, dataplane.inputs(name, version), dataplane.outputs(name, version)
            )
        except ServingError as exc:
            if exc.http_status != 503:  # a model still loading has no requests to count
                dataplane.request_failed()
            return exc.http_status, _error(exc.http_status, exc.message), _JSON
        try:
            gone = protocol.client_disconnect  # watched only while the request waits
            arrays = await dataplane.infer(name, version, request, gone)
            answer, json_size = encode_infer_response(name, request, arrays)
        except ServingError as exc:
            return exc.http_status, _error(exc.http_status, exc.message), _JSON
        if json_size is None:
            return 200, answer, _JSON
        return (
            200,
            answer,
            [
                ("content-type", "application/octet-stream"),
                ("inference-header-content-length", str(json_size)),
            ],
        )

    def _json_too_large(self, size: int) -> str:
        return (
            f"the JSON part of the request is {size} bytes; this server parses at most "
            f"{self.limits.max_json_bytes} (--max-json-bytes): send tensors as binary data "
            "(the binary tensor data extension, tritonclient's default)"
        )


async def _read_body(protocol: Any, declared: int) -> bytes | None:
    """The body as it arrives, or None when the client went away before `declared` bytes; a
    `ServingError` (400) as soon as more than `declared` arrived (none of it kept)."""
    chunks, received = [], 0
    try:
        async for chunk in protocol:
            received += len(chunk)
            if received > declared:
                raise ServingError(
                    400, f"the body is longer than its Content-Length ({declared} bytes)"
                )
            if chunk:
                chunks.append(chunk)
    except RuntimeError:  # RSGIProtocolClosed: the client went away mid-body
        return None
    if received != declared:
        return None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _discard(protocol: Any) -> None:
    """Read the request's body to its end, keeping none of it."""
    try:
        async for _ in protocol:
            pass
    except RuntimeError:  # RSGIProtocolClosed: the client has gone
        pass


def _ok(payload: Any, status: int = 200) -> tuple[int, bytes, str]:
    return status, json.dumps(payload, separators=(",", ":")).encode(), "application/json"


def _declared(text: str | None) -> int | None:
    """A header's decimal length; None when absent or not plain ASCII digits."""
    if text is None or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def _model_target(parts: list[str]) -> tuple[str, str | None, str] | None:
    """(name, version or None, what follows) for a path under /v2/models/{name}."""
    if parts[:2] != ["v2", "models"] or len(parts) < 3:
        return None
    name, rest, version = parts[2], parts[3:], None
    if rest[:1] == ["versions"]:
        if len(rest) < 2:
            return None
        version, rest = rest[1], rest[2:]
    return name, version, "/".join(rest)
