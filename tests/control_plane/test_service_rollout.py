"""Rolling updates (issue 27): a change of what runs makes a new revision whose replicas start
beside the old ones, which keep serving until every new one is warm, then drain and stop; a
failing new replica (or the deadline) stops the rollout and leaves the old ones serving; one
rollout at a time; a change of `replicas` alone only scales. The real app over HTTP on SQLite
and PostgreSQL, the agents' side driven by their HTTP calls, the loops' rounds called on the
test's clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from control_plane.background.loops import advance_rollouts
from control_plane.background.service_placement import place_services
from tests.control_plane.test_jobs import _node
from tests.control_plane.test_workloads import _deploy, _service, _sync
from tests.factories import ControlPlane, control_plane, heartbeat_body


def _patch(cp: ControlPlane, service_id: str, body: dict[str, Any], code: int = 200) -> Any:
    response = cp.client.patch(f"/api/v1/services/{service_id}", headers=cp.admin, json=body)
    assert response.status_code == code, response.text
    return response.json()


def _events(cp: ControlPlane, service_id: str) -> list[dict[str, Any]]:
    response = cp.client.get(f"/api/v1/services/{service_id}/events", headers=cp.admin)
    assert response.status_code == 200, response.text
    return list(response.json())


def _report(
    cp: ControlPlane, node: dict[str, str], states: dict[str, str], **extra: Any
) -> dict[str, Any]:
    """The node reports each replica id's state (port 80 + its position); returns the answer."""
    services = [
        {"service_id": rid, "generation": 1, "state": state, "port": 8000 + i, **extra}
        for i, (rid, state) in enumerate(states.items())
    ]
    return _sync(cp, node, service_host="10.0.0.9", services=services)


def _running(cp: ControlPlane, *nodes: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each replica id any node is told to run, with its spec."""
    return {spec["replica_id"]: spec for node in nodes for spec in _sync(cp, node)["services"]}


def _deployed_healthy(cp: ControlPlane) -> tuple[dict[str, Any], list[dict[str, str]]]:
    nodes = [_node(cp), _node(cp)]
    service = _deploy(cp, replicas=2, env={"MODE": "old"})
    assert place_services(cp.ctx) == 2
    for node in nodes:
        (spec,) = _sync(cp, node)["services"]
        _report(cp, node, {spec["replica_id"]: "healthy"})
    assert _service(cp, service["service_id"])["state"] == "healthy"
    return service, nodes


def _new_ones_warm(
    cp: ControlPlane, nodes: list[dict[str, str]], new_ids: set[str]
) -> dict[str, dict[str, str]]:
    """The rollout's new replicas placed and reported healthy: the rollout succeeds (its old
    ones drain). Returns the node each replica runs on."""
    assert place_services(cp.ctx) == 2
    on_node = {rid: node for node in nodes for rid in _running(cp, node)}
    for rid in new_ids:
        _report(cp, on_node[rid], {rid: "healthy"})
    assert advance_rollouts(cp.ctx) == 1
    return on_node


def test_a_change_rolls_out_new_replicas_before_the_old_ones_drain_and_stop(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url, service_drain_seconds=5) as cp:
        service, nodes = _deployed_healthy(cp)
        sid = service["service_id"]
        old_ids = {r["id"] for r in _service(cp, sid)["replicas"]}

        changed = _patch(cp, sid, {"env": {"MODE": "new"}})
        assert changed["revision"] == 2 and changed["rollout"]["state"] == "running"
        assert changed["env"] == {"MODE": "new"}
        new_ids = {r["id"] for r in changed["replicas"]} - old_ids
        assert len(new_ids) == 2
        assert {r["revision"] for r in changed["replicas"] if r["id"] in new_ids} == {2}
        # One rollout at a time: another change waits; the old replicas still serve.
        refused = _patch(cp, sid, {"env": {"MODE": "newer"}}, code=409)
        assert refused["error"]["code"] == "ROLLOUT_IN_PROGRESS"
        assert _service(cp, sid)["state"] == "healthy"

        assert place_services(cp.ctx) == 2
        specs = _running(cp, *nodes)
        # Each replica runs its own revision's spec, side by side.
        assert {specs[rid]["env"]["MODE"] for rid in old_ids} == {"old"}
        assert {specs[rid]["env"]["MODE"] for rid in new_ids} == {"new"}
        assert advance_rollouts(cp.ctx) == 0  # none of the new ones is warm yet

        # One new one warm: the old ones keep serving (nothing drains before all are warm).
        first, second = sorted(new_ids)
        on_node = {rid: node for node in nodes for rid in _running(cp, node)}
        _report(cp, on_node[first], {first: "healthy"})
        advance_rollouts(cp.ctx)
        states = {r["id"]: r["state"] for r in _service(cp, sid)["replicas"]}
        assert {states[rid] for rid in old_ids} == {"healthy"}

        _report(cp, on_node[second], {second: "healthy"})
        assert advance_rollouts(cp.ctx) == 1
        done = _service(cp, sid)
        assert done["rollout"]["state"] == "succeeded" and done["state"] == "healthy"
        states = {r["id"]: r["state"] for r in done["replicas"]}
        assert {states[rid] for rid in old_ids} == {"draining"}
        # A draining replica still runs (its requests finish), and stays out of the rotation
        # whatever its node reports.
        assert old_ids <= set(_running(cp, *nodes))
        for rid in old_ids:
            _report(cp, on_node[rid], {rid: "healthy"})
        states = {r["id"]: r["state"] for r in _service(cp, sid)["replicas"]}
        assert {states[rid] for rid in old_ids} == {"draining"}

        cp.clock.advance(5)
        advance_rollouts(cp.ctx)
        after = _service(cp, sid)
        assert {r["id"] for r in after["replicas"]} == new_ids  # stopped ones are not listed
        assert set(_running(cp, *nodes)) == new_ids
        rollouts = [e["data"] for e in _events(cp, sid) if e["kind"] == "rollout"]
        assert [r["state"] for r in rollouts] == ["running", "succeeded"]
        # The next change rolls out revision 3.
        assert _patch(cp, sid, {"env": {"MODE": "newer"}})["revision"] == 3


def test_a_draining_replica_stops_once_its_node_reports_no_request_in_flight(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url, service_drain_seconds=60) as cp:
        service, nodes = _deployed_healthy(cp)
        sid = service["service_id"]
        old_ids = {r["id"] for r in _service(cp, sid)["replicas"]}
        new_ids = {r["id"] for r in _patch(cp, sid, {"env": {"MODE": "new"}})["replicas"]} - old_ids
        on_node = _new_ones_warm(cp, nodes, new_ids)
        specs = _running(cp, *nodes)
        assert {rid for rid, spec in specs.items() if spec["draining"]} == old_ids
        busy, quiet = sorted(old_ids)  # one still answers a request for a while, one has none

        def report(replica_id: str, in_flight: int) -> None:
            _report(cp, on_node[replica_id], {replica_id: "healthy"}, in_flight=in_flight)

        def draining() -> set[str]:
            return {r["id"] for r in _service(cp, sid)["replicas"] if r["state"] == "draining"}

        # Reports made while a gateway may still choose them count for nothing.
        report(busy, 0)
        report(quiet, 0)
        assert advance_rollouts(cp.ctx) == 0
        cp.clock.advance(3)
        report(busy, 2)
        report(quiet, 0)  # the first after they settled: one may have been made before it came
        assert advance_rollouts(cp.ctx) == 0 and draining() == old_ids
        cp.clock.advance(1)
        report(busy, 0)
        report(quiet, 0)  # the second of none in a row: its drain is over, 4 s in, not 60
        assert advance_rollouts(cp.ctx) == 1 and draining() == {busy}
        assert quiet not in _running(cp, *nodes)
        cp.clock.advance(1)
        report(busy, 0)
        assert advance_rollouts(cp.ctx) == 1 and draining() == set()
        assert {r["id"] for r in _service(cp, sid)["replicas"]}.isdisjoint(old_ids)


def test_a_rollouts_new_replicas_take_distinct_nodes_beside_the_old_ones(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        service, nodes = _deployed_healthy(cp)
        sid = service["service_id"]
        old_nodes = {r["node_id"] for r in _service(cp, sid)["replicas"]}
        assert len(old_nodes) == 2  # one old replica on each node, holding both

        _patch(cp, sid, {"env": {"MODE": "new"}})
        assert place_services(cp.ctx) == 2
        placed = _service(cp, sid)["replicas"]
        new_nodes = [r["node_id"] for r in placed if r["revision"] == 2]
        # Spread by their own revision: one per node, as the old ones were.
        assert sorted(new_nodes) == sorted(old_nodes), placed
        # Each node is told to run one of each revision.
        for node in nodes:
            modes = sorted(spec["env"]["MODE"] for spec in _running(cp, node).values())
            assert modes == ["new", "old"], (node["node_id"], placed)


def test_a_failing_new_replica_stops_the_rollout_and_the_old_ones_keep_serving(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        service, nodes = _deployed_healthy(cp)
        sid = service["service_id"]
        old_ids = {r["id"] for r in _service(cp, sid)["replicas"]}
        _patch(cp, sid, {"command": ["python3", "-m", "nosuchmodule", "{port}"]})
        place_services(cp.ctx)
        new_ids = set(_running(cp, *nodes)) - old_ids
        bad = sorted(new_ids)[0]
        node = next(n for n in nodes if bad in _running(cp, n))
        event = {"kind": "error", "data": {"message": "No module named nosuchmodule"}}
        _report(cp, node, {bad: "failed"}, events=[event])
        assert advance_rollouts(cp.ctx) == 1

        view = _service(cp, sid)
        assert view["rollout"]["state"] == "failed"
        assert "is failed" in view["rollout"]["reason"]
        assert "No module named nosuchmodule" in view["rollout"]["reason"]
        # Back at revision 1: its command, its old replicas serving, the new ones stopped.
        assert view["revision"] == 1 and view["command"][2] == "http.server"
        assert {r["id"] for r in view["replicas"]} == old_ids
        assert view["state"] == "healthy"
        assert set(_running(cp, *nodes)) == old_ids
        (failed,) = [
            e["data"]
            for e in _events(cp, sid)
            if e["data"].get("state") == "failed" and e["kind"] == "rollout"
        ]
        assert failed["from"] == 1 and failed["to"] == 2 and "nosuchmodule" in failed["reason"]
        # A new change may start (revision 3: revision 2 stays in the history).
        assert _patch(cp, sid, {"env": {"MODE": "x"}})["revision"] == 3


def test_new_replicas_not_warm_by_the_deadline_stop_the_rollout(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url, service_rollout_timeout_seconds=20) as cp:
        service, nodes = _deployed_healthy(cp)
        sid = service["service_id"]
        _patch(cp, sid, {"resources": {"cpus": 1000}})  # no node has room for it
        assert place_services(cp.ctx) == 0
        cp.clock.advance(10)
        assert advance_rollouts(cp.ctx) == 0
        cp.clock.advance(11)
        for node in nodes:  # the nodes stay online
            beat = cp.client.post(
                "/api/v1/agent/heartbeat",
                headers={"Authorization": node["Authorization"]},
                json=heartbeat_body(),
            )
            assert beat.status_code == 200, beat.text
        assert advance_rollouts(cp.ctx) == 1
        view = _service(cp, sid)
        assert view["rollout"]["state"] == "failed"
        assert view["rollout"]["reason"].startswith("0 of 2 replicas of revision 2")
        assert view["revision"] == 1 and view["resources"]["cpus"] != 1000
        assert [r["state"] for r in view["replicas"]] == ["healthy", "healthy"]


def test_replicas_alone_scale_without_a_revision_and_bad_changes_change_nothing(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url, service_drain_seconds=0) as cp:
        service, nodes = _deployed_healthy(cp)
        sid = service["service_id"]
        grown = _patch(cp, sid, {"replicas": 3})
        assert grown["revision"] == 1 and grown["rollout"] is None
        assert grown["desired_replicas"] == 3
        assert [r["ordinal"] for r in grown["replicas"]] == [0, 1, 2]
        assert grown["state"] == "degraded" or grown["state"] == "healthy"

        shrunk = _patch(cp, sid, {"replicas": 1})
        # The pending one goes first, then the serving one of the highest ordinal drains.
        states = [(r["ordinal"], r["state"]) for r in shrunk["replicas"]]
        assert states == [(0, "healthy"), (1, "draining")]
        advance_rollouts(cp.ctx)
        assert [(r["ordinal"], r["state"]) for r in _service(cp, sid)["replicas"]] == [
            (0, "healthy")
        ]

        before = _service(cp, sid)
        bad = _patch(cp, sid, {"runner": "onnx"}, code=422)
        assert bad["error"]["code"] == "INVALID_SERVICE_UPDATE"
        assert _patch(cp, sid, {"replicas": 0}, code=422)["error"]["code"] != ""
        assert _patch(cp, sid, {}, code=422)
        assert _service(cp, sid)["revision"] == before["revision"]
        # The same value again is no change: no revision.
        assert _patch(cp, sid, {"env": {"MODE": "old"}})["revision"] == 1
        stopped = cp.client.delete(f"/api/v1/services/{sid}", headers=cp.admin)
        assert stopped.status_code == 200
        assert _patch(cp, sid, {"env": {}}, code=409)["error"]["code"] == "SERVICE_STOPPED"


def test_autoscale_changed_during_a_rollout_applies_its_bounds_when_it_ends(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url, service_drain_seconds=5) as cp:
        service, nodes = _deployed_healthy(cp)
        sid = service["service_id"]
        old_ids = {r["id"] for r in _service(cp, sid)["replicas"]}
        _patch(cp, sid, {"env": {"MODE": "new"}})
        # Taken, but the count waits for the rollout: none of its new replicas is retired.
        bounds = {"min": 1, "max": 1, "target_in_flight": 4}
        taken = _patch(cp, sid, {"autoscale": bounds})
        assert taken["autoscale"]["max"] == 1 and taken["desired_replicas"] == 2
        new_ids = {r["id"] for r in taken["replicas"]} - old_ids
        assert len(new_ids) == 2
        assert {r["state"] for r in taken["replicas"] if r["id"] in new_ids} == {"pending"}

        _new_ones_warm(cp, nodes, new_ids)
        done = _service(cp, sid)
        assert done["rollout"]["state"] == "succeeded" and done["desired_replicas"] == 1
        # The old ones drain (replaced), and of the new ones the highest ordinal (scaled down).
        states = {(r["revision"], r["ordinal"]): r["state"] for r in done["replicas"]}
        assert states == {
            (1, 0): "draining",
            (1, 1): "draining",
            (2, 0): "healthy",
            (2, 1): "draining",
        }
        kinds = [(e["kind"], e["data"].get("state")) for e in _events(cp, sid)]
        assert kinds.index(("rollout", "succeeded")) < kinds.index(("scale", None))
        (scaled,) = [e["data"] for e in _events(cp, sid) if e["kind"] == "scale"]
        assert scaled == {"from": 2, "to": 1, "reason": "autoscale bounds"}
        cp.clock.advance(5)
        advance_rollouts(cp.ctx)
        assert [(r["revision"], r["state"]) for r in _service(cp, sid)["replicas"]] == [
            (2, "healthy")
        ]
