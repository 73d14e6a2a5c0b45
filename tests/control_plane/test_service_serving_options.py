"""An onnx service's `batching` and `instances` (issue 26): checked at deploy time with a clear
error that changes nothing, kept with the service's params, and handed to its node; the runtime
worker turns them into the model server's flags. The real app over HTTP, SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from control_plane.background.service_placement import place_services
from runtime_worker._service_spec import InvalidService, ServiceSpec
from tests.control_plane.test_jobs import _node
from tests.control_plane.test_workloads import _sync, _upload
from tests.factories import control_plane

BATCHING = {
    "max_batch_size": 32,
    "preferred_batch_size": [8, 16],
    "max_queue_delay_microseconds": 500,
    "max_queue_size": 256,
}


def test_batching_and_instances_reach_the_node_and_become_the_servers_flags(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        weights = _upload(cp, b"onnx weights")
        body = {
            "name": "mlp",
            "runner": "onnx",
            "weights": weights,
            "batching": BATCHING,
            "instances": 2,
            "resources": {"cpus": 3.5},
        }
        created = cp.client.post("/api/v1/services", headers=cp.admin, json=body)
        assert created.status_code == 201, created.text
        assert created.json()["batching"] == BATCHING and created.json()["instances"] == 2
        node = _node(cp)
        assert place_services(cp.ctx) == 1
        (spec,) = _sync(cp, node, service_host="10.0.0.9")["services"]
    assert spec["params"] == {"batching": BATCHING, "instances": 2}
    # What the agent hands the runtime worker, and the worker's command for the server.
    worker_body = {
        "generation": spec["generation"],
        "name": spec["name"],
        "runner": spec["runner"],
        "weights_path": "/cache/mlp.onnx",
        "params": spec["params"],
        "resources": spec["resources"],
    }
    argv = ServiceSpec.from_json(worker_body, service_id=spec["service_id"]).argv
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--batching"] == (
        '{"max_batch_size":32,"preferred_batch_size":[8,16],'
        '"max_queue_delay_microseconds":500,"max_queue_size":256}'
    )
    assert flags["--instances"] == "2" and flags["--cpus"] == "4"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"batching": {"max_batch_size": "8"}}, "max_batch_size"),  # strict: no "8" for 8
        ({"batching": {"max_batch_size": 8.0}}, "max_batch_size"),
        ({"batching": {"max_batch_size": -1}}, "max_batch_size"),
        ({"batching": {"max_batch_size": 4, "preferred_batch_size": [8]}}, "preferred"),
        ({"batching": {"max_queue_delay_microseconds": 61_000_000}}, "delay"),
        ({"batching": {"max_queue_size": True}}, "max_queue_size"),
        ({"batching": {"max_batch": 8}}, "batching"),  # a misspelt field (never quoted)
        ({"batching": [8]}, "batching"),
        ({"instances": 0}, "instances"),
        ({"instances": 65}, "instances"),
        ({"instances": "2"}, "instances"),
    ],
)
def test_bad_batching_or_instances_are_refused_at_deploy_and_change_nothing(
    tmp_path: Path, database_url: str, fields: dict[str, Any], named: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        weights = _upload(cp, b"onnx weights")
        body = {"name": "mlp", "runner": "onnx", "weights": weights, **fields}
        response = cp.client.post("/api/v1/services", headers=cp.admin, json=body)
        assert response.status_code == 422, response.text
        assert named in response.text
        assert cp.client.get("/api/v1/services", headers=cp.admin).json() == []


def test_serving_options_are_the_onnx_runners_and_a_models_are_checked_too(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        command = {"name": "web", "command": ["serve", "{port}"], "instances": 2}
        refused = cp.client.post("/api/v1/services", headers=cp.admin, json=command)
        assert refused.status_code == 422 and "onnx runner" in refused.text
        weights = _upload(cp, b"onnx weights")
        model: dict[str, Any] = {"name": "m", "version": "1", "weights": weights}
        model["params"] = {"batching": {"max_batch_size": "lots"}}
        assert cp.client.post("/api/v1/models", headers=cp.admin, json=model).status_code == 201
        deployed = cp.client.post(
            "/api/v1/services", headers=cp.admin, json={"name": "m", "model": "m@1"}
        )
        assert deployed.status_code == 422, deployed.text
        error = deployed.json()["error"]
        assert error["code"] == "INVALID_SERVING_OPTIONS"
        assert "batching.max_batch_size" in error["message"] and error["next_step"]
        overridden = cp.client.post(
            "/api/v1/services",
            headers=cp.admin,
            json={"name": "m", "model": "m@1", "batching": {"max_batch_size": 8}},
        )
        assert overridden.status_code == 201, overridden.text  # the service's own wins
        assert overridden.json()["batching"]["max_batch_size"] == 8
        assert len(cp.client.get("/api/v1/services", headers=cp.admin).json()) == 1


def test_a_change_to_a_command_with_serving_options_is_refused_as_a_deploy_is(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        command = ["serve", "{port}"]
        deploy = {"name": "web", "command": command, "instances": 2}
        refused = cp.client.post("/api/v1/services", headers=cp.admin, json=deploy)
        assert refused.status_code == 422, refused.text
        weights = _upload(cp, b"onnx weights")
        onnx = {"name": "web", "runner": "onnx", "weights": weights, "batching": BATCHING}
        created = cp.client.post("/api/v1/services", headers=cp.admin, json=onnx)
        assert created.status_code == 201, created.text
        url = f"/api/v1/services/{created.json()['service_id']}"
        for extra in ({"instances": 2}, {"batching": BATCHING}):
            changed = cp.client.patch(url, headers=cp.admin, json={"command": command, **extra})
            # Deploy's refusal, code and message, never the serving options dropped.
            assert changed.status_code == 422, changed.text
            assert changed.json() == refused.json()
        moved = cp.client.patch(url, headers=cp.admin, json={"command": command})
        assert moved.status_code == 200, moved.text  # the options go with the onnx runner
        assert moved.json()["batching"] is None and moved.json()["revision"] == 2
        # Now a command service: the options alone would make it invalid; nothing changes.
        alone = cp.client.patch(url, headers=cp.admin, json={"instances": 2})
        assert alone.status_code == 422, alone.text
        error = alone.json()["error"]
        assert error["code"] == "INVALID_SERVICE_UPDATE" and "onnx runner" in error["message"]
        after = cp.client.get(url, headers=cp.admin).json()
        assert after["revision"] == 2 and after["instances"] is None


def test_the_worker_refuses_serving_options_it_cannot_take() -> None:
    base = {"generation": 1, "name": "m", "runner": "onnx", "weights_path": "/w.onnx"}
    for params in ({"batching": {"max_batch_size": "8"}}, {"instances": 0}):
        with pytest.raises(InvalidService):
            ServiceSpec.from_json({**base, "params": params}, service_id="svc_1")
