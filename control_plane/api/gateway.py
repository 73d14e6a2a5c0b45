"""The gateway: every deployed service at the control plane's own address (issue 27).

A named layer of the `Front` (`api/front.py`), just inside the agents' fast path and in front of
the edge: it answers its own paths and hands every other request on untouched.

- The Open Inference Protocol (v2, KServe's REST) for `onnx` services: `GET /v2/health/live`,
  `/v2/health/ready` (no token: the gateway itself), `/v2/models/{name}` (metadata, from a
  replica), `/v2/models/{name}/ready` (the routing table's: 200 while a replica takes requests,
  else 503), `POST /v2/models/{name}/infer`, each under `.../versions/{v}/...` too. `{name}` is
  the service's name; the replica is asked under its model's own name.
- Any service at `/services/{name}/{path...}` (any method, bodies streamed both ways); the
  replica gets `/{path...}` with the query. (`/services` and `/services/{id}` stay the console's.)

The path is read as the client sent it (`gateway/paths.py`): the service's name decoded once,
the rest to the replica still encoded (on Granian's RSGI, which decodes it first, all but `%2F`).

A request whose framing is ambiguous is 400, the forwarding headers the gateway's own
(`gateway_headers.py`). Each needs a token of the service (`Authorization: Bearer mfs_...`): 401
without one, 429 past its rate. Then the bounds: headers, the body (413 by its length or as it
arrives), a place among the service's concurrent requests (503 once its queue is full or its
wait ran out), a client slow to send its body (408). Replica choice is `gateway/balancer.py`'s
over `gateway/routing.py`'s rotation; the carrying, `gateway_forward.py`'s. Every answer of its
own is the protocol's error shape, `{"error": "<message>"}`, naming what to do next.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

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
from control_plane.api.gateway_headers import framing_refusal, with_forwarding
from control_plane.clock import Clock
from control_plane.gateway.auth import GatewayAuth, GatewayDenied
from control_plane.gateway.balancer import Admission, Balancer, Refused
from control_plane.gateway.metrics import GatewayMetrics
from control_plane.gateway.openai import llm_elsewhere
from control_plane.gateway.paths import PREFIXES, Target, gateway_target
from control_plane.gateway.routing import (
    ReplicaTarget,
    RoutingSnapshot,
    RoutingTable,
    ServiceTarget,
)
from control_plane.gateway.usage import UsageBook
from control_plane.services.access_tokens import Grant
from control_plane.services.autoscale import Traffic

log = logging.getLogger(__name__)

#: The most header bytes a gateway request may bring (a tunnel's OPEN frame holds 16 KiB, and
#: the headers' JSON there may be larger still: `Outbound.oversized` judges that).
MAX_HEADER_BYTES = 12 * 1024
_JSON = (b"content-type", b"application/json")


#: Asks for a replica of a service scaled to zero (the services' autoscale; may be None).
ScaleUp = Callable[[ServiceTarget], Awaitable[None]]


#: A request's or an answer's headers, as the ASGI server gives them.
Headers = list[tuple[bytes, bytes]]


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
class Answer:
    """The gateway's own answer: `body` as JSON, `extra` headers, counted under `label`."""

    status: int
    body: object
    extra: Headers = field(default_factory=list)
    label: str = ""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request to carry to a replica of `service` (`Gateway.prepare`)."""

    service: ServiceTarget
    snapshot: RoutingSnapshot
    outbound: Outbound
    grant: Grant


def _refusal(status: int, message: str, extra: Headers | None = None, label: str = "") -> Answer:
    return Answer(status, {"error": message}, extra or [], label)


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
        usage: UsageBook | None = None,
    ) -> None:
        self.app = app
        #: The OpenAI calls' tokens per key and service (`gateway/usage.py`); None: not kept.
        self.usage = usage
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
        if scope["type"] == "http" and scope["path"].startswith(PREFIXES):
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
        self, target: Target, scope: Scope, receive: Receive, send: Send
    ) -> tuple[str, int]:
        """Serve one gateway request; returns the service's label and the status answered."""
        query = scope.get("query_string", b"").decode("latin-1")
        headers = with_forwarding(scope)
        prepared = await self.prepare(target, scope["method"], headers, query)
        if isinstance(prepared, Answer):
            return prepared.label, await _answer(
                send, prepared.status, prepared.body, prepared.extra
            )
        service = prepared.service
        self.traffic.began(service.id)
        try:
            return await self._admitted(
                service, prepared.snapshot, receive, send, prepared.outbound
            )
        finally:
            self.traffic.ended(service.id)

    async def prepare(
        self, target: Target, method: str, headers: Headers, query: str, openai: bool = False
    ) -> Answer | Prepared:
        """What a gateway request gets before any replica: the gateway's own answer (health,
        metadata, a refusal: counted in the metrics already; an ambiguous framing first, as
        nothing of it may be carried), or the service and the request to carry to one of its
        replicas. The Python path (`__call__`) and the native front's both start here;
        `openai`: the request is an OpenAI API call the native front rewrote to its service."""
        what = target.what
        if (ambiguous := framing_refusal(headers)) is not None:
            return _refusal(400, ambiguous, [(b"connection", b"close")])
        if what == "live":
            return Answer(200, {"live": True})
        if what == "server":
            return Answer(200, {"name": "modelforge", "version": RELEASE_VERSION, "extensions": []})
        try:
            snapshot = await self.table.current()
        except Exception:  # noqa: BLE001 - the database: logged once by the table
            if what == "ready":
                return Answer(503, {"ready": False})
            message = "the gateway cannot read which replicas serve now; retry in a few seconds"
            return _refusal(503, message)
        if what == "ready":
            return Answer(200, {"ready": True})
        return await self._prepare_service(target, snapshot, method, headers, query, openai)

    async def _prepare_service(
        self,
        target: Target,
        snapshot: RoutingSnapshot,
        method: str,
        headers: Headers,
        query: str,
        openai: bool,
    ) -> Answer | Prepared:
        authorization = _header(headers, b"authorization")
        service = snapshot.named(target.name, alias=openai)  # an OpenAI call's model: an alias too
        # An unknown name is refused exactly as a known one with a missing or wrong token
        # (the same check, against no service: the same body, headers and reads), so the
        # answer confirms no name to one without its token.
        label = "" if service is None else service.name
        key = ("", "") if service is None else (service.id, service.kind)
        try:
            grant = await self.auth.authorize_async(authorization, *key)
        except GatewayDenied as denial:
            self.metrics.error(label, denial.cause)
            extra = [(k.lower().encode(), v.encode()) for k, v in denial.headers.items()]
            return _refusal(denial.status, denial.message, extra, label)
        if service is None:  # no grant opens no service: refused above
            raise AssertionError("a grant for no service")
        if not openai and (elsewhere := llm_elsewhere(service, target.what, method)):
            return _refusal(*elsewhere, label=label)
        if target.what in ("model", "model_ready") and service.kind != "onnx":
            message = (
                f"service {service.name!r} runs a command, not a model: reach it at "
                f"/services/{service.name}/<path>"
            )
            return _refusal(404, message, label=label)
        if target.what == "model_ready":
            ready = bool(self.table.rotation(snapshot, service))
            body = {"name": service.name, "ready": ready}
            return Answer(200 if ready else 503, body, label=label)
        if sum(len(name) + len(value) for name, value in headers) > MAX_HEADER_BYTES:
            self.metrics.error(label, "headers_too_large")
            message = f"the request's headers pass {MAX_HEADER_BYTES} bytes; send fewer or shorter"
            return _refusal(431, message, label=label)
        declared = _header(headers, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limits.body_bytes:
            self.metrics.error(label, "too_large")
            return _refusal(413, self.too_large(), [(b"connection", b"close")], label)
        if target.what == "model":
            path = f"/v2/models/{encode_segment(service.model_name)}{target.path}"
            if method == "POST" and not target.path.endswith("/infer"):
                return _refusal(405, "POST is for .../infer; GET the metadata", label=label)
        else:
            path = target.path
        forwarded = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in headers
            if crossing(name.decode("latin-1").lower())
        ]
        # No length: no body, unless chunked. A length is checked (`framing_refusal`): the
        # replica gets it, and the agent's relay holds the body to it.
        expected = None if _header(headers, b"transfer-encoding") else 0
        if declared is not None:
            forwarded.append(("content-length", str(expected := int(declared))))
        outbound = Outbound(method, path, query, forwarded, expected)
        # Past the tunnel's OPEN frame it could only fail at each replica: refused here, once.
        oversized = outbound.oversized(max((len(r.id) for r in service.replicas), default=64))
        if oversized is not None:
            self.metrics.error(label, f"{oversized}_too_large")
            return _refusal(*_OVERSIZED[oversized], label=label)
        return Prepared(service, snapshot, outbound, grant)

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
            await self.admit(label)
        except Refused as refused:
            self.metrics.error(label, "busy")
            return label, await _error(send, 503, self.busy(service, full=refused.full))
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
                snapshot, service, replica = await self.choose(snapshot, service, tried)
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
            message = body_timeout_message(limits.body_timeout)
            return await _error(send, 408, message, [(b"connection", b"close")])
        except BodyTooLarge:
            self.metrics.error(label, "too_large")
            return await _error(send, 413, self.too_large(), [(b"connection", b"close")])
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
        return await _error(send, 503, self.no_replica(service))

    async def admit(self, label: str) -> None:
        """A place among the service's requests (waiting in its queue, counted in the queue's
        gauge meanwhile); `Refused` when its queue is full or the wait ran out."""
        self.metrics.queue.labels(label).inc()
        try:
            await self.admission.enter(label)
        finally:
            self.metrics.queue.labels(label).dec()

    async def choose(
        self, snapshot: RoutingSnapshot, service: ServiceTarget, tried: set[str]
    ) -> tuple[RoutingSnapshot, ServiceTarget, ReplicaTarget | None]:
        """The replica for the next attempt (none of `tried`), from the table as it is now; a
        first attempt at a service scaled to zero waits (bounded) for one to start."""
        # A first attempt finding none looks again in a read begun after it (`routed`).
        snapshot, service, rotation = await self.table.routed(snapshot, service, confirm=not tried)
        if not rotation and not tried and service.scales_from_zero:
            snapshot, rotation = await self._wait_warm(service)
        return snapshot, service, self.balancer.choose(rotation, exclude=frozenset(tried))

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

    def too_large(self) -> str:
        return too_large_message(self.limits.body_bytes)

    def busy(self, service: ServiceTarget, *, full: bool) -> str:
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

    def no_replica(self, service: ServiceTarget) -> str:
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


def too_large_message(body_bytes: int) -> str:
    """413's message (the native front's too: `native_front.py` gives it the text)."""
    return (
        f"the request body is larger than the gateway accepts ({body_bytes} bytes); send a "
        "smaller one, or an operator raises MODELFORGE_GATEWAY_MAX_BODY_BYTES"
    )


def body_timeout_message(timeout: float) -> str:
    """408's message, for a client that stopped sending its body."""
    return f"no part of the request body arrived for {timeout:g} s; send the body without pausing"


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


def _header(headers: Headers, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _answer(send: Send, status: int, body: object, extra: Headers | None = None) -> int:
    data = json.dumps(body, separators=(",", ":")).encode()
    headers = [_JSON, (b"content-length", str(len(data)).encode()), *SECURITY_HEADERS]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": data})
    return status


async def _error(send: Send, status: int, message: str, extra: Headers | None = None) -> int:
    return await _answer(send, status, {"error": message}, extra)
