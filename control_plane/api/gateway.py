"""The gateway: every deployed service at the control plane's own address (issue 27).

A named layer of the `Front` (`api/front.py`), just inside the agents' fast path and in front of
the edge: it answers its own paths and hands every other request on untouched.

- The Open Inference Protocol (v2, KServe's REST protocol) for `onnx` services:
  `GET /v2/health/live`, `GET /v2/health/ready` (no token: the gateway itself),
  `GET /v2/models/{name}` (metadata, from a replica), `GET /v2/models/{name}/ready` (from the
  routing table: 200 while a replica takes requests, else 503), `POST /v2/models/{name}/infer`,
  and each under `/v2/models/{name}/versions/{v}/...` too. `{name}` is the service's name; the
  replica is asked under its model's own name.
- Any service at `/services/{name}/{path...}` (any method, bodies streamed both ways); the
  replica gets `/{path...}` with the query. (`/services` and `/services/{id}` stay the console's.)

The path is read as the client sent it (`received_path`: percent-encoded), one segment at a
time, each decoded once: the service's name is decoded exactly once, and what follows it goes
to the replica still encoded, so `%2F`, `%3F`, `%23` or `%25` in it mean there what they meant
to the client (on Granian's RSGI, which decodes the path before the app sees it, all but `%2F`).

Each request needs a token of that service (`Authorization: Bearer mfs_...`): 401 without one,
429 past its rate (`authorize`). Then the bounds: headers, the body (413 by its length or as
it arrives), a place among the service's concurrent requests (503 once its queue is full or its
wait ran out), a client slow to send its body (408). Replica choice is `gateway/balancer.py`'s
over `gateway/routing.py`'s rotation; the carrying, `gateway_forward.py`'s. Every answer of its
own is the protocol's error shape, `{"error": "<message>"}`, naming what to do next.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import unquote

from control_plane import RELEASE_VERSION
from control_plane.api.asgi import ASGIApp, Receive, Scope, Send
from control_plane.api.edge import SECURITY_HEADERS
from control_plane.api.gateway_forward import (
    BodyTooLarge,
    ClientGone,
    ClientTimeout,
    Opener,
    Outbound,
    RequestBody,
    ResponseBroken,
    TransportFailed,
    crossing,
    encode_segment,
    finish,
    open_exchange,
    received_path,
    relay_response,
)
from control_plane.clock import Clock
from control_plane.gateway.auth import GatewayAuth, GatewayDenied
from control_plane.gateway.balancer import Admission, Balancer, Refused
from control_plane.gateway.metrics import GatewayMetrics
from control_plane.gateway.routing import RoutingSnapshot, RoutingTable, ServiceTarget
from control_plane.services.autoscale import Traffic

log = logging.getLogger(__name__)

#: The most header bytes a gateway request may bring (a tunnel's OPEN frame holds 16 KiB, and
#: the headers' JSON there may be larger still: `Outbound.oversized` judges that).
MAX_HEADER_BYTES = 12 * 1024
#: A request whose decoded path starts so may be the gateway's (`gateway_target` decides).
_PREFIXES = ("/v2", "/services/")
_JSON = (b"content-type", b"application/json")


#: Asks for a replica of a service scaled to zero (the services' autoscale; may be None).
ScaleUp = Callable[[ServiceTarget], Awaitable[None]]


@dataclass(frozen=True)
class GatewayLimits:
    body_bytes: int = 64 * 1024 * 1024
    retry_bytes: int = 8 * 1024 * 1024
    body_timeout: float = 30.0
    concurrent: int = 64
    queue: int = 256
    queue_wait: float = 10.0
    cold_start_wait: float = 60.0


@dataclass(frozen=True, slots=True)
class _Target:
    """What a gateway path asks: `what` is live, ready, server, model, model_ready or proxy."""

    what: str
    name: str = ""
    path: str = ""


def gateway_target(method: str, path: str) -> _Target | None:
    """Which of the gateway's requests `method path` is, if one. `path` is percent-encoded
    (`received_path`): each segment is decoded once to be read, and a target's `path` (what the
    replica gets) keeps the segments as they came."""
    raw = path.split("/")
    if len(raw) < 2 or raw[0]:
        return None
    words = [unquote(segment) for segment in raw[1:4]]
    if words[0] == "services":
        if len(raw) < 4 or not words[1]:
            return None  # `/services/{id}`: the console's
        return _Target("proxy", words[1], "/" + "/".join(raw[3:]))
    if words[0] != "v2":
        return None
    if len(raw) == 2 or raw[2:] == [""]:
        return _Target("server")
    if words[1:] == ["health", "live"] and len(raw) == 4:
        return _Target("live")
    if words[1:] == ["health", "ready"] and len(raw) == 4:
        return _Target("ready")
    if words[1] != "models" or len(raw) < 4 or not words[2]:
        return None
    name, rest = words[2], raw[4:]
    if rest and not rest[-1]:
        rest = rest[:-1]  # one trailing slash
    versioned = ""
    if len(rest) >= 2 and unquote(rest[0]) == "versions" and rest[1]:
        versioned, rest = f"/versions/{rest[1]}", rest[2:]
    action = unquote(rest[0]) if len(rest) == 1 else None
    if rest and action not in ("ready", "infer"):
        return None
    if action == "ready":
        return _Target("model_ready", name)
    # The replica's server answers its model's name; the name part is replaced later.
    return _Target("model", name, versioned + (f"/{action}" if action else ""))


class Gateway:
    """The gateway layer: its paths answered here, the rest handed to `app` (the edge)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        table: RoutingTable,
        opener: Callable[[], Opener | None],
        auth: GatewayAuth,
        metrics: GatewayMetrics,
        clock: Clock,
        limits: GatewayLimits,
        scale_up: ScaleUp | None = None,
        traffic: Traffic | None = None,
    ) -> None:
        self.app = app
        self.table = table
        self.opener = opener
        self.auth = auth
        self.metrics = metrics
        self.clock = clock
        self.limits = limits
        self.scale_up = scale_up
        #: Each service's requests in flight and last request, which its autoscaling reads.
        self.traffic = traffic or Traffic(clock)
        self.balancer = Balancer()
        self.admission = Admission(
            limit=limits.concurrent, queue=limits.queue, wait=limits.queue_wait
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = None
        if scope["type"] == "http" and scope["path"].startswith(_PREFIXES):
            target = gateway_target(scope["method"], received_path(scope))
        if target is None:
            await self.app(scope, receive, send)
            return
        started = self.clock.monotonic()
        label, status = "", 500
        try:
            label, status = await self._serve(target, scope, receive, send)
        except ResponseBroken as broken:  # counted under its service, by the status it began
            label, status = broken.service, broken.status
            raise
        finally:
            self.metrics.answered(label, status, self.clock.monotonic() - started)

    async def _serve(
        self, target: _Target, scope: Scope, receive: Receive, send: Send
    ) -> tuple[str, int]:
        """Serve one gateway request; returns the service's label and the status answered."""
        what = target.what
        if what == "live":
            return "", await _answer(send, 200, {"live": True})
        if what == "server":
            body = {"name": "modelforge", "version": RELEASE_VERSION, "extensions": []}
            return "", await _answer(send, 200, body)
        try:
            snapshot = await self.table.current()
        except Exception:  # noqa: BLE001 - the database: logged once by the table
            if what == "ready":
                return "", await _answer(send, 503, {"ready": False})
            message = "the gateway cannot read which replicas serve now; retry in a few seconds"
            return "", await _error(send, 503, message)
        if what == "ready":
            return "", await _answer(send, 200, {"ready": True})
        return await self._serve_service(target, snapshot, scope, receive, send)

    async def _serve_service(
        self,
        target: _Target,
        snapshot: RoutingSnapshot,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> tuple[str, int]:
        method = scope["method"]
        headers = scope["headers"]
        authorization = _header(headers, b"authorization")
        service = snapshot.services.get(target.name)
        # An unknown name is refused exactly as a known one with a missing or wrong token
        # (the same check, against no service: the same body, headers and reads), so the
        # answer confirms no name to one without its token.
        label = "" if service is None else service.name
        try:
            await self.auth.authorize_async(authorization, "" if service is None else service.id)
        except GatewayDenied as denial:
            self.metrics.error(label, denial.cause)
            extra = [(k.lower().encode(), v.encode()) for k, v in denial.headers.items()]
            return label, await _error(send, denial.status, denial.message, extra)
        if service is None:  # no grant opens no service: refused above
            raise AssertionError("a grant for no service")
        if target.what in ("model", "model_ready") and service.kind != "onnx":
            message = (
                f"service {service.name!r} runs a command, not a model: reach it at "
                f"/services/{service.name}/<path>"
            )
            return label, await _error(send, 404, message)
        if target.what == "model_ready":
            ready = bool(self.table.rotation(snapshot, service))
            body = {"name": service.name, "ready": ready}
            return label, await _answer(send, 200 if ready else 503, body)
        if sum(len(name) + len(value) for name, value in headers) > MAX_HEADER_BYTES:
            self.metrics.error(label, "headers_too_large")
            message = f"the request's headers pass {MAX_HEADER_BYTES} bytes; send fewer or shorter"
            return label, await _error(send, 431, message)
        declared = _header(headers, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limits.body_bytes:
            self.metrics.error(label, "too_large")
            return label, await _error(send, 413, self._too_large(), [(b"connection", b"close")])
        if target.what == "model":
            path = f"/v2/models/{encode_segment(service.model_name)}{target.path}"
            if method == "POST" and not target.path.endswith("/infer"):
                return label, await _error(send, 405, "POST is for .../infer; GET the metadata")
        else:
            path = target.path
        forwarded = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in headers
            if crossing(name.decode("latin-1").lower())
        ]
        query = scope.get("query_string", b"").decode("latin-1")
        if declared is not None:
            expected = int(declared) if declared.isdigit() else None
        else:  # no length: no body, unless it comes chunked
            expected = None if _header(headers, b"transfer-encoding") else 0
        outbound = Outbound(method, path, query, forwarded, expected)
        # Past the tunnel's OPEN frame it could only fail at each replica: refused here, once.
        oversized = outbound.oversized(max((len(r.id) for r in service.replicas), default=64))
        if oversized is not None:
            self.metrics.error(label, f"{oversized}_too_large")
            return label, await _error(send, *_OVERSIZED[oversized])
        self.traffic.began(service.id)
        try:
            return await self._admitted(service, snapshot, receive, send, outbound)
        finally:
            self.traffic.ended(service.id)

    async def _admitted(
        self,
        service: ServiceTarget,
        snapshot: RoutingSnapshot,
        receive: Receive,
        send: Send,
        outbound: Outbound,
    ) -> tuple[str, int]:
        label = service.name
        try:
            self.metrics.queue.labels(label).inc()
            try:
                await self.admission.enter(label)
            finally:
                self.metrics.queue.labels(label).dec()
        except Refused as refused:
            self.metrics.error(label, "busy")
            return label, await _error(send, 503, self._busy(service, full=refused.full))
        self.metrics.in_flight.labels(label).inc()
        try:
            return label, await self._forward(service, snapshot, receive, send, outbound)
        finally:
            self.metrics.in_flight.labels(label).dec()
            self.admission.leave(label)

    async def _forward(
        self,
        service: ServiceTarget,
        snapshot: RoutingSnapshot,
        receive: Receive,
        send: Send,
        outbound: Outbound,
    ) -> int:
        label = service.name
        limits = self.limits
        body = RequestBody(
            receive,
            limit=limits.body_bytes,
            timeout=limits.body_timeout,
            retry_bytes=limits.retry_bytes,
            expected=outbound.expected,
        )
        tried: set[str] = set()
        failure = ""
        try:
            for attempt in (0, 1):
                # The replica is chosen from a table at most `max_age` old when its OPEN goes
                # (after the queue and a small body's read, each of which may take seconds): a
                # replica left the rotation that long ago gets no new request, which is what
                # lets a draining one stop once none is in flight (`services/rollout.idle`).
                await body.whole()
                snapshot, service = await self._fresh(snapshot, service)
                rotation = self.table.rotation(snapshot, service)
                if not rotation and attempt == 0 and service.scales_from_zero:
                    snapshot, rotation = await self._wait_warm(service)
                replica = self.balancer.choose(rotation, exclude=frozenset(tried))
                if replica is None or replica.node_id is None:
                    break
                opener = self.opener()
                if opener is None:
                    failure = "no tunnel hub"
                    break
                tried.add(replica.id)
                self.balancer.started(replica.id)
                try:
                    exchange = await open_exchange(
                        opener,
                        node_id=replica.node_id,
                        request=outbound.to(replica.id),
                        body=body,
                    )
                except TransportFailed as failed:
                    self.balancer.ended(replica.id)
                    self.metrics.error(label, "transport")
                    failure = failed.cause
                    if not body.replayable:
                        break
                    if attempt == 0:
                        self.metrics.error(label, "retried")
                    continue
                try:
                    await relay_response(exchange, send, SECURITY_HEADERS, body=body)
                except ResponseBroken as broken:
                    self.metrics.error(label, "response_broken")
                    cut = ResponseBroken(broken.cause, status=broken.status, service=label)
                    raise cut from None
                finally:
                    self.balancer.ended(replica.id)
                    if exchange.pump.done():
                        await finish(exchange.pump)
                return exchange.status
        except ClientTimeout:
            self.metrics.error(label, "client_timeout")
            message = (
                f"no part of the request body arrived for {limits.body_timeout:g} s; "
                "send the body without pausing"
            )
            return await _error(send, 408, message, [(b"connection", b"close")])
        except BodyTooLarge:
            self.metrics.error(label, "too_large")
            return await _error(send, 413, self._too_large(), [(b"connection", b"close")])
        except ClientGone:
            self.metrics.error(label, "client_gone")
            return 499
        finally:
            body.close()
        if tried:
            message = (
                f"no replica of service {label!r} could be reached ({failure or 'transport'}); "
                "retry in a few seconds"
            )
            self.metrics.error(label, "unreachable")
            return await _error(send, 502, message)
        self.metrics.error(label, "no_replica")
        return await _error(send, 503, self._no_replica(service))

    async def _fresh(
        self, snapshot: RoutingSnapshot, service: ServiceTarget
    ) -> tuple[RoutingSnapshot, ServiceTarget]:
        """The routing table as it is now (in memory unless older than its `max_age`), and the
        service in it; what was read before when the database cannot be read now."""
        try:
            snapshot = await self.table.current()
        except Exception:  # noqa: BLE001 - the database: logged once by the table
            return snapshot, service
        return snapshot, snapshot.services.get(service.name, service)

    async def _wait_warm(self, service: ServiceTarget) -> tuple[RoutingSnapshot, list]:  # type: ignore[type-arg]
        """Hold a request for a service scaled to zero while a replica starts (bounded)."""
        if self.scale_up is not None:
            await self.scale_up(service)
        deadline = self.clock.monotonic() + self.limits.cold_start_wait
        while True:
            left = deadline - self.clock.monotonic()
            await self.table.next_read(max(0.0, min(left, 1.0)))
            snapshot = await self.table.current()
            current = snapshot.services.get(service.name, service)
            rotation = self.table.rotation(snapshot, current)
            if rotation or self.clock.monotonic() >= deadline:
                return snapshot, rotation

    def _too_large(self) -> str:
        return (
            f"the request body is larger than the gateway accepts ({self.limits.body_bytes} "
            "bytes); send a smaller one, or an operator raises MODELFORGE_GATEWAY_MAX_BODY_BYTES"
        )

    def _busy(self, service: ServiceTarget, *, full: bool) -> str:
        limits = self.limits
        why = (
            f"{limits.queue} requests already wait"
            if full
            else f"none of its {limits.concurrent} places came free within {limits.queue_wait:g} s"
        )
        return (
            f"service {service.name!r} is busy: {why}; retry later, or add replicas "
            "(or raise MODELFORGE_GATEWAY_MAX_CONCURRENT_PER_SERVICE)"
        )

    def _no_replica(self, service: ServiceTarget) -> str:
        if service.scales_from_zero:
            return (
                f"no replica of service {service.name!r} became ready within "
                f"{self.limits.cold_start_wait:g} s of the request; retry, or see the "
                "service's events (GET /api/v1/services/{id}/events)"
            )
        return (
            f"service {service.name!r} has no replica ready ({service.state}); retry once it "
            "is healthy, or see its events (GET /api/v1/services/{id}/events)"
        )


#: A request whose OPEN frame would not fit: its status and message, by what is too large.
_OVERSIZED = {
    "headers": (
        431,
        "the request's headers are too large to carry to a replica once encoded (non-ASCII "
        "characters take up to 6 bytes each); send fewer or shorter headers",
    ),
    "target": (
        414,
        "the request's path and query are too large to carry to a replica; send the data in "
        "the body instead",
    ),
}


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _answer(
    send: Send, status: int, body: object, extra: list[tuple[bytes, bytes]] | None = None
) -> int:
    data = json.dumps(body, separators=(",", ":")).encode()
    headers = [_JSON, (b"content-length", str(len(data)).encode()), *SECURITY_HEADERS]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": data})
    return status


async def _error(
    send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None
) -> int:
    return await _answer(send, status, {"error": message}, extra)
