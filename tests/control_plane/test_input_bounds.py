"""Values the database cannot hold and values of the wrong type are refused with a 422 that names
the field, never a 500 and never coerced: label filters beyond their cap, integers past what an
INTEGER column stores, a string or a boolean where a number belongs. And an `onnx` service whose
health check names no path gets the model server's readiness path.

The real app over HTTP, on SQLite and on PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from control_plane.api.jobs import MAX_LABEL_FILTERS
from control_plane.background.service_placement import place_services
from control_plane.schemas import DB_INT_MAX
from tests.control_plane.test_jobs import _node, _submit
from tests.control_plane.test_workloads import _deploy, _service, _upload
from tests.factories import ControlPlane, control_plane

TOO_BIG = 10**40  # OverflowError in SQLite's binding, out of range for PostgreSQL's bigint


def _refused(response: httpx.Response, field: str) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "INVALID_REQUEST", error
    assert field in error["message"], error
    assert error["next_step"]
    return error


# -- caps and bounds ---------------------------------------------------------------------------


def test_label_filters_beyond_the_cap_are_refused(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        _submit(cp, labels={"team": "a"})
        at_cap = [("label", f"k{i}=v") for i in range(MAX_LABEL_FILTERS - 1)] + [
            ("label", "team=a")
        ]
        listed = cp.client.get("/api/v1/jobs", headers=cp.admin, params=at_cap)
        assert listed.status_code == 200, listed.text
        assert listed.json() == []  # every filter must hold, and the k<i> ones do not
        one = cp.client.get("/api/v1/jobs", headers=cp.admin, params=[("label", "team=a")])
        assert len(one.json()) == 1
        many = [("label", f"k{i}=v") for i in range(999)]
        _refused(cp.client.get("/api/v1/jobs", headers=cp.admin, params=many), "label")


@pytest.mark.parametrize(
    ("path", "parameter"),
    [
        ("/api/v1/admin/audit", "before"),
        ("/api/v1/jobs/job_x/events", "after"),
        ("/api/v1/services/svc_x/events", "after"),
    ],
)
def test_a_paging_integer_past_the_column_is_refused(
    tmp_path: Path, database_url: str, path: str, parameter: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        for value in (TOO_BIG, DB_INT_MAX + 1):
            response = cp.client.get(path, headers=cp.admin, params={parameter: str(value)})
            _refused(response, parameter)
        largest = cp.client.get(path, headers=cp.admin, params={parameter: str(DB_INT_MAX)})
        assert largest.status_code in (200, 404), largest.text


def test_a_service_sync_with_integers_past_the_column_is_refused(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        service = _deploy(cp)
        assert place_services(cp.ctx) == 1
        headers = {"Authorization": node["Authorization"]}

        def sync(**status: Any) -> httpx.Response:
            report = {"service_id": service["service_id"], "generation": 1, "state": "healthy"}
            body = {"services": [{**report, **status}]}
            return cp.client.post("/api/v1/agent/services/sync", headers=headers, json=body)

        for value in (2**63, DB_INT_MAX + 1):
            _refused(sync(restarts=value), "restarts")
            _refused(sync(generation=value), "generation")
        assert _service(cp, service["service_id"])["restarts"] == 0  # nothing changed
        accepted = sync(restarts=DB_INT_MAX)
        assert accepted.status_code == 200, accepted.text
        assert _service(cp, service["service_id"])["restarts"] == DB_INT_MAX


# -- types -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("resources.gpus", "1"),
        ("resources.gpus", True),
        ("resources.gpus", 1.0),
        ("resources.cpus", "1"),
        ("resources.memory_mb", "512"),
        ("restart.initial_backoff_seconds", "1"),
        ("restart.max_backoff_seconds", True),
        ("health.interval_seconds", "5"),
        ("health.failure_threshold", "3"),
    ],
)
def test_a_service_number_of_the_wrong_type_is_refused(
    tmp_path: Path, database_url: str, field: str, value: Any
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        section, key = field.split(".")
        body = {
            "name": "web",
            "command": ["python3", "-m", "http.server", "{port}"],
            section: {key: value},
        }
        response = cp.client.post("/api/v1/services", headers=cp.admin, json=body)
        _refused(response, field)
        listed = cp.client.get("/api/v1/services", headers=cp.admin)
        assert listed.json() == []  # nothing deployed


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("resources.gpus", "1"),
        ("resources.gpus", False),
        ("resources.cpus", "2"),
        ("timeout_seconds", "60"),
        ("silence_timeout_seconds", True),
    ],
)
def test_a_job_number_of_the_wrong_type_is_refused(
    tmp_path: Path, database_url: str, field: str, value: Any
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        entrypoint = {"kind": "python", "module": "m", "function": "f", "source": {"m.py": ""}}
        body: dict[str, Any] = {"entrypoint": entrypoint}
        if "." in field:
            section, key = field.split(".")
            body[section] = {key: value}
        else:
            body[field] = value
        _refused(cp.client.post("/api/v1/jobs", headers=cp.admin, json=body), field)
        batch = cp.client.post("/api/v1/jobs:batch", headers=cp.admin, json={"jobs": [body]})
        _refused(batch, field)
        assert cp.client.get("/api/v1/jobs", headers=cp.admin).json() == []
        # The right types are accepted, integers given for seconds included.
        right = {"entrypoint": entrypoint, "resources": {"cpus": 1}, "timeout_seconds": 60}
        assert cp.client.post("/api/v1/jobs", headers=cp.admin, json=right).status_code == 201


# -- the onnx runner's health path -------------------------------------------------------------


def _desired(cp: ControlPlane, node: dict[str, str]) -> list[dict[str, Any]]:
    headers = {"Authorization": node["Authorization"]}
    response = cp.client.post("/api/v1/agent/services/sync", headers=headers, json={})
    assert response.status_code == 200, response.text
    return list(response.json()["services"])


def test_an_onnx_service_health_without_a_path_checks_readiness(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        weights = _upload(cp, b"onnx weights")
        model = {"name": "tiny", "version": "1", "weights": weights}
        assert cp.client.post("/api/v1/models", headers=cp.admin, json=model).status_code == 201
        tuned = {"interval_seconds": 1, "failure_threshold": 5}
        onnx = {"command": None, "runner": "onnx", "weights": weights}
        by_runner = _deploy(cp, name="a", health=tuned, **onnx)
        by_model = _deploy(cp, name="b", command=None, model="tiny@1", health=tuned)
        command = _deploy(cp, name="c", health=tuned)
        explicit = _deploy(cp, name="d", health={"path": "/v2/health/live"}, **onnx)
        expected = {
            by_runner["service_id"]: "/v2/health/ready",
            by_model["service_id"]: "/v2/health/ready",
            command["service_id"]: "/",
            explicit["service_id"]: "/v2/health/live",
        }
        for service_id, path in expected.items():
            health = _service(cp, service_id)["health"]
            assert health["path"] == path, (service_id, health)
        assert _service(cp, by_runner["service_id"])["health"]["interval_seconds"] == 1
        assert place_services(cp.ctx) == 4
        sent = {spec["service_id"]: spec["health"]["path"] for spec in _desired(cp, node)}
        assert sent == expected
