"""The native front's control channel: the gateway's decisions for `modelforge-gateway-front`.

The front (`native/gateway_front`, Rust) listens on the control plane's port. It carries the
gateway's requests to the replicas through the agents' tunnels, which it holds itself, and
passes every other request to Granian. What it carries is decided here, on the control plane's
event loop, by the same code as the Python gateway (`api/gateway.py`): the front asks over a
Unix socket, one JSON object per line each way (`native/gateway_front/src/control.rs` is the
other end).

- `request` (a path under `/v2` or `/services/`): `Gateway.prepare` (health, metadata, the
  token, the bounds), then a place among the service's requests (`Admission`) and a replica
  (`Gateway.choose`): the reply is the gateway's own answer, `pass` (not the gateway's: the
  front hands it to Granian), or a grant: a ticket, the node whose tunnel carries it, and the
  OPEN frame's payload. `retry` (the attempt failed before any answer, the body kept) gets
  another replica or the answer; `done` ends the ticket: its place, the replica's count, the
  service's traffic (autoscaling) and the metrics, exactly as the Python path keeps them.
- The front's fast path (`native/gateway_front/src/fast.rs`) carries what these decisions
  already cover without asking: a grant says for how long its token stands (`auth`, as long
  as `GatewayAuth`'s check of it, for a token with no rate limit), `routes` (pushed whenever
  they change, looked at every `ROUTES_EVERY`) say which replicas of which services take
  requests, and `stats` (four times a second) bring back what happened, into the metrics,
  the autoscaler's traffic and the per-service limit (`Admission.held`).
- `tunnel` (an agent's WebSocket upgrade): the node's credential is checked as
  `api/tunnel.py` checks it; once accepted, the process's `TunnelHub` serves a stand-in for it
  (`FrontTunnel`), so the tunnel is recorded where the replicas look for it and closed when its
  credential is revoked or expires, by the hub as every tunnel is; the close goes to the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, cast

from control_plane.api.deps import require_node
from control_plane.api.edge import SECURITY_HEADERS
from control_plane.api.gateway import Answer, Gateway
from control_plane.api.gateway_forward import encode_segment
from control_plane.api.openai_models import openai_answer, shaped
from control_plane.context import AppContext
from control_plane.errors import ModelForgeError
from control_plane.gateway import openai
from control_plane.gateway.auth import RATE_LIMITED
from control_plane.gateway.balancer import Refused
from control_plane.gateway.paths import gateway_target
from control_plane.gateway.routing import ReplicaTarget, RoutingSnapshot, ServiceTarget
from control_plane.gateway.tunnels import CLOSE_REPLACED
from control_plane.gateway.usage import reported_timing, reported_usage
from modelforge_contracts.tunnel import MAX_PAYLOAD

log = logging.getLogger(__name__)

#: Where the served process listens for the front (`native_front.py` sets it; unset: no front).
CONTROL_ENV = "MODELFORGE_GATEWAY_FRONT_CONTROL"

#: Seconds between two looks at whether the fast path's routes changed.
ROUTES_EVERY = 0.1
#: How the front reports a request's end (`done`'s `error`), as the Python path counts it.
_DONE_ERRORS = frozenset({"response_broken", "client_gone", "client_timeout", "too_large"})


@dataclass
class _Ticket:
    """One request the front carries: what `done` must give back."""

    service: ServiceTarget
    snapshot: RoutingSnapshot
    started: float
    open_payload: Any  # `Outbound`
    whole: bool
    tried: set[str] = field(default_factory=set)
    replica: str | None = None
    failure: str = ""
    #: What the front may remember for its fast path: this token opens this service, for the
    #: seconds the token's check stands here (`GatewayAuth.standing`); None for a token with a
    #: rate limit, whose every request comes here to its bucket.
    auth: dict[str, Any] | None = None
    #: An OpenAI API call's facts (its answers in OpenAI's shape); None for any other request.
    call: openai.Call | None = None
    #: The access token it came with (its usage is counted against it).
    token_id: str = ""


class FrontTunnel:
    """A tunnel the front holds, as the process's `TunnelHub` sees it: nothing to read or send
    through here (the frames never reach Python); its end is the front's `tunnel_closed`, and
    a close (revoked, expired, the node deleted, shutdown) is sent to the front."""

    def __init__(self, channel: NativeChannel, node_id: str) -> None:
        self._channel = channel
        self._node_id = node_id
        self._ended = asyncio.Event()

    async def send(self, message: bytes) -> None:
        raise ConnectionError("the native front carries this node's tunnel")

    async def receive(self) -> bytes | None:
        await self._ended.wait()
        return None

    async def close(self, code: int, reason: str) -> None:
        self._ended.set()
        if code != CLOSE_REPLACED:  # replaced: the front replaced it itself
            close = {"op": "close", "node": self._node_id, "code": code, "reason": reason}
            self._channel.send(close)

    def ended(self) -> None:
        self._ended.set()


class NativeChannel(asyncio.Protocol):
    """The control channel's server side, one front connected at a time (see the module)."""

    def __init__(self, ctx: AppContext, gateway: Gateway) -> None:
        self.ctx = ctx
        self.gateway = gateway
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._out: list[bytes] = []
        self._tickets: dict[int, _Ticket] = {}
        self._numbers = itertools.count(1)
        self._tunnels: dict[str, FrontTunnel] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: The fast path's requests in flight as it last reported, by label: (service id, n).
        self._front_in_flight: dict[str, tuple[str, int]] = {}

    # -- the socket ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a stream socket's (uvloop's own)
        log.info("the native gateway front connected")
        self._spawn(self._push_routes())

    def data_received(self, data: bytes) -> None:
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        for line in lines:
            if line:
                self._dispatch(json.loads(line))

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        log.warning("the native gateway front's control channel closed")
        for task in list(self._tasks):
            task.cancel()
        self._forget_front_counts()
        for tunnel in self._tunnels.values():
            tunnel.ended()
        self._tunnels.clear()
        for number in list(self._tickets):
            self._done(number, 502, "response_broken")

    def send(self, message: dict[str, Any]) -> None:
        """Queue a line; the lines of one turn of the event loop leave in one write."""
        if self._transport is None:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(json.dumps(message, separators=(",", ":")).encode())

    def _flush(self) -> None:
        lines, self._out = self._out, []
        if self._transport is not None and lines:
            self._transport.write(b"\n".join(lines) + b"\n")

    def _dispatch(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "done":
            counted = reported_usage(message.get("usage"))
            timing = reported_timing(message.get("timing"))
            self._done(message["ticket"], int(message["status"]), message["error"], counted, timing)
        elif op == "request":
            self._spawn(self._request(message))
        elif op == "retry":
            self._spawn(self._retry(message))
        elif op == "tunnel":
            self._spawn(self._tunnel(message))
        elif op == "stats":
            self._stats(message["services"])
        elif op == "tunnel_closed":
            tunnel = self._tunnels.pop(message["node"], None)
            if tunnel is not None:
                tunnel.ended()
        else:
            log.warning("the native front sent an unknown message %r", op)

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the gateway's requests ---------------------------------------------------------------

    async def _request(self, message: dict[str, Any]) -> None:
        ask = message["id"]
        try:
            self.send(await self._decide(ask, message))
        except Exception as exc:
            log.error("unexpected %s deciding a gateway request", type(exc).__name__, exc_info=exc)
            self.send(_answer(ask, Answer(500, {"error": "the gateway failed; retry"})))

    async def _decide(self, ask: int, message: dict[str, Any]) -> dict[str, Any]:
        method = message["method"]
        target = gateway_target(method, message["path"])
        if target is None:
            return {"id": ask, "pass": True}
        gateway = self.gateway
        call = openai.Call.from_ask(message["openai"]) if "openai" in message else None
        started = gateway.clock.monotonic()
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in message["headers"]]
        prepared = await gateway.prepare(
            target, method, headers, message.get("query", ""), openai=call is not None
        )
        if isinstance(prepared, Answer):
            elapsed = gateway.clock.monotonic() - started
            gateway.metrics.answered(prepared.label, prepared.status, elapsed)
            if call is not None:
                prepared = await openai_answer(gateway, prepared, call, message["headers"])
            return _answer(ask, prepared)
        service = prepared.service
        label = service.name
        if call is not None and (refused := openai.refusal(service, call)) is not None:
            status, body = refused
            gateway.metrics.answered(label, status, gateway.clock.monotonic() - started)
            return _answer(ask, Answer(status, body, label=label))
        if call is not None and (spent := openai.tokens_spent(prepared.grant, gateway.usage)):
            gateway.metrics.error(label, RATE_LIMITED)
            gateway.metrics.answered(label, 429, gateway.clock.monotonic() - started)
            return _answer(ask, Answer(429, spent[0], [(b"retry-after", spent[1])], label))
        gateway.traffic.began(service.id)
        try:
            await gateway.admit(label)
        except Refused as refused:
            gateway.traffic.ended(service.id)
            gateway.metrics.error(label, "busy")
            busy = Answer(503, {"error": gateway.busy(service, full=refused.full)}, label=label)
            gateway.metrics.answered(label, 503, gateway.clock.monotonic() - started)
            return _answer(ask, shaped(busy, call))
        except BaseException:
            gateway.traffic.ended(service.id)
            raise
        gateway.metrics.in_flight.labels(label).inc()
        expected = prepared.outbound.expected
        whole = expected is not None and expected <= min(MAX_PAYLOAD, gateway.limits.retry_bytes)
        number = next(self._numbers)
        ticket = _Ticket(service, prepared.snapshot, started, prepared.outbound, whole)
        ticket.call, ticket.token_id = call, prepared.grant.token_id
        if prepared.grant.rate_per_second is None:
            authorization = next((v for k, v in message["headers"] if k == "authorization"), "")
            standing = gateway.auth.standing(authorization)
            if standing > 0:
                ticket.auth = {"service": service.name, "ttl": round(standing, 3)}
        self._tickets[number] = ticket
        try:
            return await self._grant(ask, number)
        except BaseException:  # cancelled (the front went away), or failed: the ticket ends
            self._done(number, 500, "")
            raise

    async def _grant(self, ask: int, number: int) -> dict[str, Any]:
        """The ticket's next replica, or the answer when there is none (the ticket then ends)."""
        ticket = self._tickets[number]
        gateway = self.gateway
        snapshot, service, replica = await gateway.choose(
            ticket.snapshot, ticket.service, ticket.tried
        )
        ticket.snapshot, ticket.service = snapshot, service
        if number not in self._tickets:  # the channel closed meanwhile
            return {"id": ask, "status": 503, "headers": [], "body": ""}
        if replica is None or replica.node_id is None:
            answer = self._none_left(ticket)
            self._done(number, answer.status, "")
            return _answer(ask, answer)
        ticket.tried.add(replica.id)
        ticket.replica = replica.id
        gateway.balancer.started(replica.id)
        return _grant(ask, number, replica, ticket)

    def _none_left(self, ticket: _Ticket) -> Answer:
        gateway, label = self.gateway, ticket.service.name
        if ticket.tried:
            gateway.metrics.error(label, "unreachable")
            message = (
                f"no replica of service {label!r} could be reached "
                f"({ticket.failure or 'transport'}); retry in a few seconds"
            )
            return shaped(Answer(502, {"error": message}, label=label), ticket.call)
        gateway.metrics.error(label, "no_replica")
        answer = Answer(503, {"error": gateway.no_replica(ticket.service)}, label=label)
        return shaped(answer, ticket.call)

    async def _retry(self, message: dict[str, Any]) -> None:
        ask, number = message["id"], message["ticket"]
        ticket = self._tickets.get(number)
        if ticket is None:
            self.send({"id": ask, "status": 503, "headers": [], "body": ""})
            return
        gateway, label = self.gateway, ticket.service.name
        if ticket.replica is not None:
            gateway.balancer.ended(ticket.replica)
            ticket.replica = None
        gateway.metrics.error(label, "transport")
        ticket.failure = str(message.get("cause", ""))[:200]
        if len(ticket.tried) >= 2:  # as the Python path: two attempts
            answer = self._none_left(ticket)
            self._done(number, answer.status, "")
            self.send(_answer(ask, answer))
            return
        gateway.metrics.error(label, "retried")
        try:
            self.send(await self._grant(ask, number))
        except Exception as exc:
            log.error("unexpected %s retrying a gateway request", type(exc).__name__, exc_info=exc)
            self._done(number, 500, "")
            self.send(_answer(ask, Answer(500, {"error": "the gateway failed; retry"})))
        except BaseException:  # cancelled: the front went away
            self._done(number, 500, "")
            raise

    def _done(
        self,
        number: int,
        status: int,
        error: str,
        usage: tuple[int, int] | None = None,
        timing: tuple[float, float] | None = None,
    ) -> None:
        ticket = self._tickets.pop(number, None)
        if ticket is None:
            return
        gateway, service = self.gateway, ticket.service
        label = service.name
        if ticket.call is not None:
            gateway.metrics.llm_call(label, usage, timing)
            if gateway.usage is not None and ticket.token_id:
                gateway.usage.record(ticket.token_id, service.id, usage)
        if ticket.replica is not None:
            gateway.balancer.ended(ticket.replica)
        if error in _DONE_ERRORS:
            gateway.metrics.error(label, error)
        elif error == "transport":  # the front's 502 for a body it could not send again
            gateway.metrics.error(label, "transport")
            gateway.metrics.error(label, "unreachable")
        gateway.metrics.in_flight.labels(label).dec()
        gateway.admission.leave(label)
        gateway.traffic.ended(service.id)
        gateway.metrics.answered(label, status, gateway.clock.monotonic() - ticket.started)

    # -- the fast path's decisions and reports ------------------------------------------------

    async def _push_routes(self) -> None:
        """The services the fast path may carry and where (`native/gateway_front/src/fast.rs`):
        each with replicas in its rotation now, sent whenever that changes (checked every
        `ROUTES_EVERY`), so a replica leaving the rotation stops getting its requests there."""
        gateway, sent = self.gateway, ""
        while self._transport is not None:
            try:
                snapshot = await gateway.table.current()
            except Exception:  # noqa: BLE001 - the database: logged by the table
                # No routes: every request is asked, and answered as the Python gateway
                # answers without its table (503). Looked at again as a request would.
                self.send({"op": "routes", "services": []})
                sent = "[]"
                await asyncio.sleep(gateway.table.max_age)
                continue
            routes = self._routes(snapshot)
            text = json.dumps(routes, separators=(",", ":"))
            if text != sent:
                self.send({"op": "routes", "services": routes})
                sent = text
            await asyncio.sleep(ROUTES_EVERY)

    def _routes(self, snapshot: RoutingSnapshot) -> list[dict[str, Any]]:
        gateway, routes = self.gateway, []
        for service in snapshot.services.values():
            if service.kind == "llm":  # every call decided here: its tokens, its method
                continue
            replicas = [
                [replica.id, replica.node_id]
                for replica in gateway.table.rotation(snapshot, service)
                if replica.node_id is not None
            ]
            if replicas:
                model = encode_segment(service.model_name)
                routes.append(
                    {
                        "name": service.name,
                        "id": service.id,
                        "kind": service.kind,
                        "model_path": f"/v2/models/{model}",
                        "replicas": replicas,
                        # What the service's limit leaves beside this process's own.
                        "limit": gateway.limits.concurrent
                        - gateway.admission.running(service.name),
                    }
                )
        return routes

    def _stats(self, services: dict[str, Any]) -> None:
        """The fast path's report: its answers and errors into the metrics, its requests in
        flight into the gauge, the autoscaler's traffic and the per-service limit."""
        gateway = self.gateway
        for label, report in services.items():
            service_id = str(report["id"])
            answers = report.get("answers", [])
            for status, seconds in answers:
                gateway.metrics.answered(label, int(status), float(seconds))
            for cause, count in report.get("errors", {}).items():
                gateway.metrics.errors.labels(label, str(cause)).inc(int(count))
            in_flight = int(report.get("in_flight", 0))
            change = in_flight - self._front_in_flight.get(label, (service_id, 0))[1]
            self._front_in_flight[label] = (service_id, in_flight)
            gateway.metrics.in_flight.labels(label).inc(change)
            gateway.traffic.add(service_id, change, requested=bool(answers) or in_flight > 0)
            if in_flight:
                gateway.admission.held[label] = in_flight
            else:
                gateway.admission.held.pop(label, None)

    def _forget_front_counts(self) -> None:
        """The front is gone: none of its requests is in flight any more."""
        gateway = self.gateway
        for label, (service_id, in_flight) in self._front_in_flight.items():
            gateway.metrics.in_flight.labels(label).dec(in_flight)
            gateway.traffic.add(service_id, -in_flight, requested=False)
            gateway.admission.held.pop(label, None)
        self._front_in_flight.clear()

    # -- the agents' tunnels ------------------------------------------------------------------

    async def _tunnel(self, message: dict[str, Any]) -> None:
        ask = message["id"]
        ctx = self.ctx
        authorization = next(
            (value for name, value in message["headers"] if name.lower() == "authorization"),
            None,
        )
        try:
            principal = await require_node(ctx, authorization)
        except ModelForgeError as refusal:
            headers = [[k, v] for k, v in (refusal.response_headers() or {}).items()]
            headers.append(["content-type", "application/json"])
            body = json.dumps(refusal.to_body(), separators=(",", ":"))
            self.send({"id": ask, "status": refusal.http_status, "headers": headers, "body": body})
            return
        node_id = principal.node_id
        tunnel = FrontTunnel(self, node_id)
        previous = self._tunnels.get(node_id)
        self._tunnels[node_id] = tunnel
        if previous is not None:
            previous.ended()
        self.send({"id": ask, "node": node_id})
        with contextlib.suppress(asyncio.CancelledError):
            await ctx.hub.serve(
                node_id,
                tunnel,
                still_active=lambda: ctx.authority.still_active(principal),
                expired=lambda: ctx.authority.has_expired(principal),
                watch_silence=False,  # the front closes a silent tunnel itself
            )
        if self._tunnels.get(node_id) is tunnel:
            del self._tunnels[node_id]


def _answer(ask: int, answer: Answer) -> dict[str, Any]:
    body = json.dumps(answer.body, separators=(",", ":"))
    headers = [["content-type", "application/json"]]
    headers += [[k.decode("latin-1"), v.decode("latin-1")] for k, v in SECURITY_HEADERS]
    headers += [[k.decode("latin-1"), v.decode("latin-1")] for k, v in answer.extra]
    return {"id": ask, "status": answer.status, "headers": headers, "body": body}


def _grant(ask: int, number: int, replica: ReplicaTarget, ticket: _Ticket) -> dict[str, Any]:
    payload = ticket.open_payload.to(replica.id).to_payload()
    grant = {
        "id": ask,
        "ticket": number,
        "node": replica.node_id,
        "open": payload.decode(),
        "whole": ticket.whole,
    }
    if ticket.auth is not None:
        grant["auth"] = ticket.auth
    return grant


async def listen(ctx: AppContext, gateway: Gateway) -> asyncio.AbstractServer | None:
    """The control channel's socket, where the native front runs (else None)."""
    path = os.environ.get(CONTROL_ENV)
    if not path:
        return None
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: NativeChannel(ctx, gateway), path)
    os.chmod(path, 0o600)
    return server
