"""GET /api/v1/services/{id}/traffic: the gateway's counters for one service (the console's
Traffic panel), after real requests through the gateway and a node's tunnel
(the peers of tests/control_plane/test_gateway.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.control_plane.test_gateway import _Fleet, _wait_connected
from tests.factories import control_plane


@pytest.fixture
def fleet(tmp_path: Path, database_url: str) -> Iterator[_Fleet]:
    with control_plane(tmp_path, database_url) as cp, ExitStack() as stack:
        yield _Fleet(cp, stack)


def test_traffic_counts_one_services_requests_answers_and_latency(fleet: _Fleet) -> None:
    node = fleet.node("a")
    iris = fleet.service("iris", [node])
    idle = fleet.service("idle", [])  # no replica: the gateway answers 503 itself
    _wait_connected(fleet)
    client, admin = fleet.cp.client, fleet.cp.admin

    before = client.get(f"/api/v1/services/{iris}/traffic", headers=admin)
    assert before.status_code == 200, before.text
    assert before.json()["name"] == "iris"
    assert before.json()["requests"] == {} and before.json()["count"] == 0

    headers = fleet.token(iris)
    for _ in range(3):
        assert client.get("/v2/models/iris", headers=headers).status_code == 200
    assert client.get("/v2/models/idle", headers=fleet.token(idle)).status_code == 503

    traffic = client.get(f"/api/v1/services/{iris}/traffic", headers=admin).json()
    assert traffic["service_id"] == iris
    assert traffic["requests"] == {"200": 3}
    assert traffic["errors"] == {}
    assert traffic["count"] == 3 and traffic["seconds_sum"] >= 0  # the test clock stands still
    assert (traffic["in_flight"], traffic["queue"]) == (0, 0)
    bounds = [bucket["le"] for bucket in traffic["buckets"]]
    assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1])
    assert traffic["buckets"][-1]["count"] == 3
    # The other service's answers are its own.
    other = client.get(f"/api/v1/services/{idle}/traffic", headers=admin).json()
    assert other["requests"] == {"503": 1}
    assert other["errors"] == {"no_replica": 1}


def test_traffic_of_an_unknown_service_is_404_and_needs_the_admin(fleet: _Fleet) -> None:
    client = fleet.cp.client
    missing = client.get("/api/v1/services/svc-nope/traffic", headers=fleet.cp.admin)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "SERVICE_NOT_FOUND"
    assert client.get("/api/v1/services/svc-nope/traffic").status_code == 401
