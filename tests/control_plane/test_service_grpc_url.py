"""A service's gRPC address (issue 26): the node agent reports the gRPC port beside the HTTP one,
and the service's view shows it as `grpc_url`, `host:port` as gRPC clients take it; a report
without one (a command service, or an agent older than gRPC ports) shows none, and the address
goes when the service leaves its node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from control_plane.background.service_placement import place_services
from tests.control_plane.test_jobs import _node
from tests.control_plane.test_workloads import _deploy, _service, _sync
from tests.factories import control_plane


def _status(service_id: str, **ports: Any) -> dict[str, Any]:
    return {"service_id": service_id, "generation": 1, "state": "healthy", **ports}


def test_the_view_shows_the_reported_grpc_address_until_the_service_leaves_its_node(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        first = _node(cp)
        service_id = _deploy(cp)["service_id"]
        assert place_services(cp.ctx) == 1
        assert _service(cp, service_id)["grpc_url"] is None  # nothing reported yet

        both = _status(service_id, port=8123, grpc_port=8124)
        _sync(cp, first, service_host="fd00::5", services=[both])
        view = _service(cp, service_id)
        assert view["url"] == "http://[fd00::5]:8123"
        assert view["grpc_url"] == "[fd00::5]:8124"

        # An agent that reports no gRPC port (or is older than them): no gRPC address.
        _sync(cp, first, service_host="10.0.0.5", services=[_status(service_id, port=8123)])
        view = _service(cp, service_id)
        assert view["url"] == "http://10.0.0.5:8123" and view["grpc_url"] is None

        # A port out of range is refused and changes nothing.
        for bad in (0, 65536):
            response = cp.client.post(
                "/api/v1/agent/services/sync",
                headers={"Authorization": first["Authorization"]},
                json={"services": [_status(service_id, port=8123, grpc_port=bad)]},
            )
            assert response.status_code == 422, response.text
        assert _service(cp, service_id)["grpc_url"] is None

        # Its node goes offline: placed again elsewhere, without the old node's addresses.
        _sync(cp, first, service_host="10.0.0.5", services=[both])
        assert _service(cp, service_id)["grpc_url"] == "10.0.0.5:8124"
        cp.clock.advance(cp.ctx.settings.node_offline_after_seconds + 1)
        second = _node(cp)
        assert place_services(cp.ctx) == 1
        moved = _service(cp, service_id)
        assert moved["node_id"] == second["node_id"]
        assert moved["url"] is None and moved["grpc_url"] is None

        _sync(cp, second, service_host="10.0.0.6", services=[both])
        assert _service(cp, service_id)["grpc_url"] == "10.0.0.6:8124"
        undeployed = cp.client.delete(f"/api/v1/services/{service_id}", headers=cp.admin)
        assert undeployed.json()["url"] is None and undeployed.json()["grpc_url"] is None


def test_addresses_show_only_with_direct_access_on_or_on_the_control_planes_machine(
    tmp_path: Path, database_url: str
) -> None:
    """Replicas listen on their node's loopback unless its agent turned direct access on by
    naming its service host: an agent that names none, connecting from another machine, gets no
    URL (nothing would answer there); one on the control plane's own machine (loopback) gets
    the loopback address, where its replicas answer."""
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        service_id = _deploy(cp)["service_id"]
        assert place_services(cp.ctx) == 1
        both = _status(service_id, port=8123, grpc_port=8124)
        headers = {"Authorization": node["Authorization"]}

        def sync_from(address: str, **body: Any) -> dict[str, Any]:
            agent = TestClient(cp.client.app, client=(address, 50000))
            response = agent.post("/api/v1/agent/services/sync", headers=headers, json=body)
            assert response.status_code == 200, response.text
            view = _service(cp, service_id)
            return {"url": view["url"], "grpc_url": view["grpc_url"]}

        assert sync_from("10.0.0.7", services=[both]) == {"url": None, "grpc_url": None}
        assert sync_from("10.0.0.7", service_host="gpu-box.lan", services=[both]) == {
            "url": "http://gpu-box.lan:8123",
            "grpc_url": "gpu-box.lan:8124",
        }
        # Direct access turned off again (the agent restarted without it): the URLs go.
        assert sync_from("10.0.0.7", services=[both]) == {"url": None, "grpc_url": None}
        assert sync_from("127.0.0.1", services=[both]) == {
            "url": "http://127.0.0.1:8123",
            "grpc_url": "127.0.0.1:8124",
        }
        assert sync_from("::1", services=[both]) == {
            "url": "http://[::1]:8123",
            "grpc_url": "[::1]:8124",
        }
