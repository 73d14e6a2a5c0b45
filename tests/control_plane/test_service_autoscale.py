"""Autoscaling and scale to zero (issue 27): replicas follow the requests in flight that this
process's gateway counts (`ctx.traffic`, which the gateway reports into), up at once, down only
after the cool-down and never below `min`; with `min` 0 to zero after `idle_seconds` without a
request, and back to one replica when a request wakes it. The real app over HTTP on SQLite and
PostgreSQL, the loops' rounds called on the test's clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from control_plane.api.front import wake_service
from control_plane.background.loops import advance_rollouts, autoscale_services
from control_plane.background.service_placement import place_services
from control_plane.services.autoscale import SHARED_FRESH_SECONDS, Autoscaler, Traffic, apply
from tests.control_plane.test_jobs import _node
from tests.control_plane.test_workloads import _deploy, _service, _sync
from tests.factories import ControlPlane, control_plane, heartbeat_body

SCALING = {"min": 1, "max": 4, "target_in_flight": 2, "scale_down_seconds": 30}


def _count(cp: ControlPlane, service_id: str) -> int:
    return int(_service(cp, service_id)["desired_replicas"])


def _autoscale_events(cp: ControlPlane, service_id: str) -> list[dict[str, Any]]:
    response = cp.client.get(f"/api/v1/services/{service_id}/events", headers=cp.admin)
    return [e["data"] for e in response.json() if e["kind"] == "autoscale"]


def test_replicas_follow_requests_in_flight_up_at_once_down_after_the_cool_down(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        service = _deploy(cp, autoscale=SCALING)
        sid = service["service_id"]
        assert service["autoscale"]["max"] == 4 and service["desired_replicas"] == 1

        for _ in range(7):  # 7 in flight / 2 a replica -> 4
            cp.ctx.traffic.began(sid)
        assert autoscale_services(cp.ctx) == 1
        view = _service(cp, sid)
        assert view["desired_replicas"] == 4 and len(view["replicas"]) == 4
        assert view["last_request_at"] is not None
        for _ in range(10):  # more than max asks: never above max
            cp.ctx.traffic.began(sid)
        autoscale_services(cp.ctx)
        assert _count(cp, sid) == 4

        for _ in range(15):  # 2 in flight -> 1 wished, but only after the cool-down
            cp.ctx.traffic.ended(sid)
        autoscale_services(cp.ctx)
        cp.clock.advance(20)
        cp.ctx.traffic.began(sid)  # 3 in flight -> 2 wished within the window
        autoscale_services(cp.ctx)
        assert _count(cp, sid) == 4
        cp.clock.advance(11)
        autoscale_services(cp.ctx)
        assert _count(cp, sid) == 2  # the most it wished over the window
        for _ in range(3):
            cp.ctx.traffic.ended(sid)
        autoscale_services(cp.ctx)
        cp.clock.advance(31)
        autoscale_services(cp.ctx)
        assert _count(cp, sid) == 1  # never below min, however idle
        steps = [(e["from"], e["to"]) for e in _autoscale_events(cp, sid) if "from" in e]
        assert steps == [(1, 4), (4, 2), (2, 1)]


def test_several_control_plane_processes_size_a_service_from_all_their_requests(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        sid = _deploy(cp, autoscale=SCALING)["service_id"]
        # A second control-plane process on the same database: its own gateway's traffic and
        # its own autoscaler, as behind a load balancer.
        other_traffic, other = Traffic(cp.clock), Autoscaler(cp.clock)

        def other_round() -> int:
            return apply(
                session_factory=cp.ctx.session_factory,
                clock=cp.clock,
                autoscaler=other,
                loads=other_traffic.loads(),
            )

        for _ in range(3):
            cp.ctx.traffic.began(sid)
        for _ in range(4):
            other_traffic.began(sid)
        autoscale_services(cp.ctx)  # 3 here, none shared yet: 2 replicas
        other_round()  # 4 there and the 3 shared: 7 / 2 -> 4
        assert _count(cp, sid) == 4
        assert _autoscale_events(cp, sid)[-1]["in_flight"] == 7

        # Nothing in flight here any more, but 4 there: neither wishes it smaller than 2, so
        # after the cool-down it is 2, not the 1 this process alone would have wished.
        for _ in range(3):
            cp.ctx.traffic.ended(sid)
        for _ in range(2):
            other_round()
            autoscale_services(cp.ctx)
            cp.clock.advance(3)  # each process writes its row every round: all stay fresh
        cp.clock.advance(25)
        other_round()
        autoscale_services(cp.ctx)
        assert _count(cp, sid) == 2

        # The other process stops (its row ages out): only this one's requests count.
        cp.clock.advance(SHARED_FRESH_SECONDS + 1)
        autoscale_services(cp.ctx)
        cp.clock.advance(31)
        autoscale_services(cp.ctx)
        assert _count(cp, sid) == 1


def test_min_zero_scales_to_zero_when_idle_and_a_request_wakes_it(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url, service_drain_seconds=0) as cp:
        node = _node(cp)
        scaling = {"min": 0, "max": 2, "target_in_flight": 1, "idle_seconds": 60}
        sid = _deploy(cp, autoscale=scaling)["service_id"]
        assert place_services(cp.ctx) == 1
        (spec,) = _sync(cp, node)["services"]
        state = {"service_id": spec["replica_id"], "generation": 1, "state": "healthy", "port": 81}
        _sync(cp, node, services=[state])

        cp.ctx.traffic.began(sid)
        cp.ctx.traffic.ended(sid)
        autoscale_services(cp.ctx)
        cp.clock.advance(59)
        _sync(cp, node, services=[state])  # the node stays online
        autoscale_services(cp.ctx)
        assert _count(cp, sid) == 1  # not idle long enough
        cp.clock.advance(2)
        autoscale_services(cp.ctx)
        advance_rollouts(cp.ctx)  # its drain (0 s here) ends
        idle = _service(cp, sid)
        assert idle["desired_replicas"] == 0 and idle["state"] == "idle" and idle["replicas"] == []
        assert _sync(cp, node)["services"] == []
        assert "no request for 60 s" in _autoscale_events(cp, sid)[-1]["reason"]
        listed = cp.client.get("/api/v1/services?state=idle", headers=cp.admin).json()
        assert [s["service_id"] for s in listed] == [sid]

        # A request arrives with no warm replica: the gateway's wake asks for one and places it.
        beat = cp.client.post(
            "/api/v1/agent/heartbeat",
            headers={"Authorization": node["Authorization"]},
            json=heartbeat_body(),
        )
        assert beat.status_code == 200, beat.text
        wake_service(cp.ctx, sid)
        woken = _service(cp, sid)
        assert woken["desired_replicas"] == 1 and woken["state"] == "starting"
        assert [r["node_id"] for r in woken["replicas"]] == [node["node_id"]]
        assert _autoscale_events(cp, sid)[-1]["reason"] == "a request arrived at the gateway"
        # Woken counts as a request: it is not scaled back to zero before being served.
        autoscale_services(cp.ctx)
        assert _count(cp, sid) == 1
        wake_service(cp.ctx, sid)  # a second waiting request asks for nothing more
        assert _count(cp, sid) == 1


def test_autoscale_settings_are_validated_and_changed_without_a_revision(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        for bad in (
            {"min": 3, "max": 2, "target_in_flight": 1},
            {"min": 0, "max": 17, "target_in_flight": 1},
            {"min": 0, "max": 2, "target_in_flight": 0},
            {"min": -1, "max": 2, "target_in_flight": 1},
        ):
            payload = {"name": "w", "command": ["x", "{port}"], "autoscale": bad}
            refused = cp.client.post("/api/v1/services", headers=cp.admin, json=payload)
            assert refused.status_code == 422, bad
        assert cp.client.get("/api/v1/services", headers=cp.admin).json() == []

        sid = _deploy(cp, replicas=5)["service_id"]
        url = f"/api/v1/services/{sid}"
        changed = cp.client.patch(url, headers=cp.admin, json={"autoscale": SCALING}).json()
        assert changed["autoscale"]["target_in_flight"] == 2 and changed["revision"] == 1
        assert changed["desired_replicas"] == 4  # brought within its bounds
        off = cp.client.patch(url, headers=cp.admin, json={"autoscale": None}).json()
        assert off["autoscale"] is None and off["desired_replicas"] == 4
        cp.ctx.traffic.began(sid)
        assert autoscale_services(cp.ctx) == 0  # no longer autoscaled
