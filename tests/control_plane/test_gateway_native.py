"""The native front's control channel (`api/gateway_native.py`), driven as the front drives it:
JSON lines in, JSON lines out, on the control plane's own event loop, against a real in-process
control plane (its database, tokens, routing table, admission and metrics).

- A request with a good token is granted: a ticket, the node, the OPEN frame the replica gets
  (no token in it) and what the fast path may remember; its `done` gives everything back.
- A wrong token is answered 401 by the control plane, exactly as its Python gateway answers.
- The routes pushed name the service's replicas in rotation and their nodes.
- The fast path's reports land in the metrics and the autoscaler's traffic, and a front that
  goes away leaves nothing counted in flight.
- An agent's tunnel is accepted for its credential, refused without one.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from functools import partial
from typing import Any

from sqlalchemy import select

from control_plane.api.gateway_native import NativeChannel
from control_plane.models import Service, ServiceReplica
from tests.control_plane.test_gateway import _Fleet, fleet  # noqa: F401 - its fixture

_ = fleet


class _Transport:
    """What the channel writes to the front, as parsed lines."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def write(self, data: bytes) -> None:
        self.lines += [json.loads(line) for line in data.split(b"\n") if line]

    def close(self) -> None:
        pass


async def _exchange(
    fleet: _Fleet, messages: list[dict[str, Any]], *, then_lost: bool = False
) -> tuple[list[dict[str, Any]], NativeChannel]:
    """Send `messages` to a fresh channel; the lines it wrote once every ask is answered."""
    channel = NativeChannel(fleet.cp.ctx, fleet.cp.client.app.app)  # type: ignore[attr-defined]
    transport = _Transport()
    channel.connection_made(transport)  # type: ignore[arg-type]
    asks = {message["id"] for message in messages if "id" in message}
    for message in messages:
        channel.data_received(json.dumps(message).encode() + b"\n")
    for _ in range(500):
        if asks <= {line.get("id") for line in transport.lines}:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the routes' first push
    if then_lost:
        channel.connection_lost(None)
    else:
        channel._transport = None  # ends the routes' loop
    return transport.lines, channel


def _request(ask: int, headers: dict[str, str], path: str = "/v2/models/iris/infer") -> dict:
    pairs = [[k.lower(), v] for k, v in {**headers, "content-length": "2"}.items()]
    return {"op": "request", "id": ask, "method": "POST", "path": path, "query": "x=1",
            "headers": pairs, "client": "10.0.0.9:5000"}  # fmt: skip


def _requests_counted(fleet: _Fleet, code: str) -> float:
    value = fleet.cp.ctx.metrics.registry.get_sample_value(
        "modelforge_gateway_requests_total", {"service": "iris", "code": code}
    )
    return value or 0.0


def test_a_granted_request_and_its_done(fleet: _Fleet) -> None:
    node = fleet.cp.ready_node().node_id
    headers = fleet.token(fleet.service("iris", [node]))
    portal = fleet.cp.client.portal
    assert portal is not None
    lines, _channel = portal.call(_exchange, fleet, [_request(1, headers)])
    grant = next(line for line in lines if line.get("id") == 1)
    assert grant["node"] == node and grant["whole"] is True
    opened = json.loads(grant["open"])
    assert opened["replica_id"] == "iris-r0"
    assert opened["path"].endswith("/infer") and opened["query"] == "x=1"
    assert "authorization" not in {name for name, _ in opened["headers"]}
    assert grant["auth"]["service"] == "iris" and 0 < grant["auth"]["ttl"] <= 1
    routes = next(line for line in lines if line.get("op") == "routes")
    (iris,) = routes["services"]
    assert (iris["name"], iris["replicas"], iris["kind"]) == ("iris", [["iris-r0", node]], "onnx")
    gateway = fleet.cp.client.app.app  # type: ignore[attr-defined]
    assert gateway.admission.running("iris") == 1
    before = _requests_counted(fleet, "200")

    async def done() -> None:
        line = {"op": "done", "ticket": grant["ticket"], "status": 200, "error": ""}
        _channel.data_received(json.dumps(line).encode() + b"\n")

    portal.call(done)
    assert gateway.admission.running("iris") == 0
    assert gateway.balancer.outstanding == {}
    assert _requests_counted(fleet, "200") == before + 1


def _set_state(fleet: _Fleet, service_id: str, state: str) -> None:
    """The service and its replicas in `state`, as the agents' services sync leaves them."""
    with fleet.cp.ctx.session_factory.begin() as session:
        service = session.get(Service, service_id)
        assert service is not None
        service.state = state
        for replica in session.scalars(
            select(ServiceReplica).where(ServiceReplica.service_id == service_id)
        ):
            replica.state = state
            replica.ready_at = datetime.now(UTC) if state == "healthy" else None


def test_a_service_the_api_calls_healthy_is_routed_at_once(fleet: _Fleet) -> None:
    """Issue 40's race: the routing table held says "starting" (read for the request before;
    the test's clock never ages it, as the front's routes loop keeps a real one young), the
    service turns healthy and the API says so: the next request is granted, not refused 503
    from the copy held."""
    node = fleet.cp.ready_node().node_id
    service_id = fleet.service("iris", [node])
    headers = fleet.token(service_id)
    _set_state(fleet, service_id, "starting")
    portal = fleet.cp.client.portal
    assert portal is not None
    lines, _ = portal.call(_exchange, fleet, [_request(1, headers)])
    refused = next(line for line in lines if line.get("id") == 1)
    assert refused["status"] == 503
    assert "no replica ready (starting)" in json.loads(refused["body"])["error"]
    _set_state(fleet, service_id, "healthy")
    seen = fleet.cp.client.get(f"/api/v1/services/{service_id}", headers=fleet.cp.admin)
    assert seen.json()["state"] == "healthy"
    lines, channel = portal.call(_exchange, fleet, [_request(2, headers)])
    granted = next(line for line in lines if line.get("id") == 2)
    assert granted.get("node") == node, granted
    assert json.loads(granted["open"])["replica_id"] == "iris-r0"
    portal.call(_finish, channel, granted["ticket"])


async def _finish(channel: NativeChannel, ticket: int) -> None:
    line = {"op": "done", "ticket": ticket, "status": 200, "error": ""}
    channel.data_received(json.dumps(line).encode() + b"\n")


def test_a_wrong_token_is_answered_401_by_the_control_plane(fleet: _Fleet) -> None:
    node = fleet.cp.ready_node().node_id
    fleet.service("iris", [node])
    portal = fleet.cp.client.portal
    assert portal is not None
    wrong = {"Authorization": "Bearer mfs_" + "A" * 43}
    lines, _ = portal.call(_exchange, fleet, [_request(7, wrong), _request(8, {}, "/v2x")])
    refused = next(line for line in lines if line.get("id") == 7)
    assert refused["status"] == 401 and "ticket" not in refused
    assert "access token" in json.loads(refused["body"])["error"]
    assert ["www-authenticate", 'Bearer realm="modelforge"'] in refused["headers"]
    assert next(line for line in lines if line.get("id") == 8) == {"id": 8, "pass": True}


def test_the_fast_paths_reports_are_counted_and_forgotten_with_the_front(fleet: _Fleet) -> None:
    node = fleet.cp.ready_node().node_id
    service_id = fleet.service("iris", [node])
    portal = fleet.cp.client.portal
    assert portal is not None
    gateway = fleet.cp.client.app.app  # type: ignore[attr-defined]
    before = _requests_counted(fleet, "200")
    report = {
        "op": "stats",
        "services": {
            "iris": {
                "id": service_id,
                "in_flight": 3,
                "answers": [[200, 0.002], [200, 0.004], [502, 0.1]],
                "errors": {"transport": 1, "unreachable": 1},
            }
        },
    }
    lines, channel = portal.call(_exchange, fleet, [report])
    assert _requests_counted(fleet, "200") == before + 2
    assert _requests_counted(fleet, "502") == 1
    assert gateway.admission.held == {"iris": 3}
    assert gateway.traffic.loads()[service_id].in_flight == 3
    registry = fleet.cp.ctx.metrics.registry
    in_flight = {"service": "iris"}
    assert registry.get_sample_value("modelforge_gateway_in_flight", in_flight) == 3

    async def lost() -> None:
        channel._transport = _Transport()  # type: ignore[assignment]
        channel.connection_lost(None)

    portal.call(lost)
    assert gateway.admission.held == {}
    assert gateway.traffic.loads()[service_id].in_flight == 0
    assert registry.get_sample_value("modelforge_gateway_in_flight", in_flight) == 0


def test_an_agents_tunnel_is_accepted_for_its_credential_only(fleet: _Fleet) -> None:
    ready = fleet.cp.ready_node()
    portal = fleet.cp.client.portal
    assert portal is not None
    credential = [[name.lower(), value] for name, value in ready.headers.items()]
    asks = [
        {"op": "tunnel", "id": 1, "headers": credential, "client": "10.0.0.9:5000"},
        {"op": "tunnel", "id": 2, "headers": [], "client": "10.0.0.9:5001"},
    ]
    lines, _ = portal.call(partial(_exchange, fleet, asks, then_lost=True))
    assert next(line for line in lines if line.get("id") == 1) == {"id": 1, "node": ready.node_id}
    refused = next(line for line in lines if line.get("id") == 2)
    assert refused["status"] == 401 and "node" not in refused
