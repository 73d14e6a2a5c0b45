"""Models (WL-5c), secrets (WL-6a), services (WL-5a) and the audit log (AU-1) in the control plane:
the real app over HTTP on SQLite and PostgreSQL; the agents' side is driven by its HTTP calls."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from sqlalchemy import select

from control_plane.background.service_placement import place_services
from control_plane.models import Secret
from tests.control_plane.test_jobs import _claim, _node, _submit
from tests.control_plane.test_scheduler import _wait_reason
from tests.factories import ControlPlane, control_plane

SECRET_VALUE = "s3cr3t-value-" + hashlib.sha256(b"workloads").hexdigest()[:16]


def _upload(cp: ControlPlane, content: bytes) -> str:
    response = cp.client.post("/api/v1/artifacts", headers=cp.admin, content=content)
    assert response.status_code == 201, response.text
    return str(response.json()["digest"])


def _put_secret(cp: ControlPlane, name: str, labels: dict[str, str]) -> Any:
    return cp.client.put(
        f"/api/v1/admin/secrets/{name}",
        headers=cp.admin,
        json={"value": SECRET_VALUE, "labels": labels},
    )


def _deploy(cp: ControlPlane, **body: Any) -> dict[str, Any]:
    payload = {"name": "web", "command": ["python3", "-m", "http.server", "{port}"], **body}
    response = cp.client.post("/api/v1/services", headers=cp.admin, json=payload)
    assert response.status_code == 201, response.text
    return dict(response.json())


def _service(cp: ControlPlane, service_id: str) -> dict[str, Any]:
    response = cp.client.get(f"/api/v1/services/{service_id}", headers=cp.admin)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _sync(cp: ControlPlane, node: dict[str, str], **body: Any) -> dict[str, Any]:
    headers = {"Authorization": node["Authorization"]}
    response = cp.client.post("/api/v1/agent/services/sync", headers=headers, json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_models_are_immutable_and_jobs_run_them(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        weights = _upload(cp, b"onnx weights")
        body = {"name": "tiny", "version": "1", "weights": weights, "params": {"outputs": ["y"]}}
        created = cp.client.post("/api/v1/models", headers=cp.admin, json=body)
        assert created.status_code == 201, created.text
        assert created.json()["ref"] == "tiny@1"
        again = cp.client.post("/api/v1/models", headers=cp.admin, json=body)
        assert again.status_code == 409 and again.json()["error"]["code"] == "MODEL_EXISTS"
        missing = dict(body, version="2", weights="sha256:" + "0" * 64)
        refused = cp.client.post("/api/v1/models", headers=cp.admin, json=missing)
        assert refused.status_code == 404
        assert refused.json()["error"]["code"] == "ARTIFACT_NOT_FOUND"

        node = _node(cp)
        job = cp.client.post(
            "/api/v1/jobs", headers=cp.admin, json={"model": "tiny@1", "inputs": {"t": weights}}
        )
        assert job.status_code == 201, job.text
        assert job.json()["model"] == "tiny@1"
        assignment = _claim(cp, node)
        assert assignment is not None
        assert assignment["entrypoint"] == {"kind": "onnx", "model": weights}
        assert assignment["params"] == {"outputs": ["y"]}

        unknown = cp.client.post("/api/v1/jobs", headers=cp.admin, json={"model": "nope@1"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "MODEL_NOT_FOUND"


def test_secrets_are_write_only_encrypted_and_placed_by_signed_labels(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        assert _put_secret(cp, "HF_TOKEN", {"site": "a"}).status_code == 200
        listed = cp.client.get("/api/v1/admin/secrets", headers=cp.admin)
        assert listed.json()[0]["name"] == "HF_TOKEN" and SECRET_VALUE not in listed.text
        with cp.ctx.session_factory() as session:
            row = session.scalars(select(Secret)).one()
            assert SECRET_VALUE.encode() not in bytes(row.ciphertext)
            assert SECRET_VALUE not in repr(row)
        key_dir = tmp_path / "secret-keys"
        assert all((path.stat().st_mode & 0o777) == 0o600 for path in key_dir.iterdir())

        elsewhere = _node(cp, labels={"site": "b"})
        job = _submit(cp, secrets=["HF_TOKEN"])
        assert job["secrets"] == ["HF_TOKEN"] and SECRET_VALUE not in str(job)
        assert _claim(cp, elsewhere) is None  # never placed on a node without site=a
        reason = _wait_reason(cp, job["job_id"], "NO_MATCHING_NODE", "site=a")
        assert SECRET_VALUE not in str(reason)

        site_a = _node(cp, labels={"site": "a"})
        assignment = _claim(cp, site_a)
        assert assignment is not None and assignment["secrets"] == {"HF_TOKEN": SECRET_VALUE}
        view = cp.client.get(f"/api/v1/jobs/{job['job_id']}", headers=cp.admin)
        events = cp.client.get(f"/api/v1/jobs/{job['job_id']}/events", headers=cp.admin)
        assert SECRET_VALUE not in view.text + events.text

        rotated = cp.client.post("/api/v1/admin/secrets/rotate-key", headers=cp.admin)
        assert rotated.status_code == 200 and rotated.json()["reencrypted"] == 1
        again = _submit(cp, secrets=["HF_TOKEN"])
        second = _claim(cp, site_a)
        assert second is not None and second["job_id"] == again["job_id"]
        assert second["secrets"] == {"HF_TOKEN": SECRET_VALUE}

        unknown = cp.client.post(
            "/api/v1/jobs", headers=cp.admin, json=dict(_job_body(), secrets=["NOPE"])
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "SECRET_NOT_FOUND"
        bad = cp.client.put(
            "/api/v1/admin/secrets/lower-case", headers=cp.admin, json={"value": "x"}
        )
        assert bad.status_code == 422

        audit = cp.client.get("/api/v1/admin/audit", headers=cp.admin).json()
        actions = [entry["action"] for entry in audit]
        assert "secret.set" in actions and "secret.rotate_key" in actions
        assert "job.submit" in actions
        refused = [e for e in audit if e["action"] == "job.submit" and e["outcome"] != "ok"]
        assert refused and refused[0]["outcome"] == "SECRET_NOT_FOUND"
        assert SECRET_VALUE not in str(audit)
        assert all(entry["actor"] == "admin-token" for entry in audit)


def test_a_secret_relabelled_after_submission_is_not_delivered(
    tmp_path: Path, database_url: str
) -> None:
    """WL-6a, checked again at delivery: the job was queued while HF_TOKEN allowed `site=a`;
    before any node claims it, the secret is narrowed to `site=b`. The `site=a` node's claim
    gets nothing, the job fails SECRET_NOT_PERMITTED, and the value is in no answer."""
    with control_plane(tmp_path, database_url) as cp:
        assert _put_secret(cp, "HF_TOKEN", {"site": "a"}).status_code == 200
        site_a = _node(cp, labels={"site": "a"})
        job = _submit(cp, secrets=["HF_TOKEN"])
        assert _put_secret(cp, "HF_TOKEN", {"site": "b"}).status_code == 200
        response = cp.client.post(
            "/api/v1/agent/work/claim",
            headers={"Authorization": site_a["Authorization"]},
            json={"hold_seconds": 0},
        )
        assert response.status_code == 204, response.text  # nothing handed over
        view = cp.client.get(f"/api/v1/jobs/{job['job_id']}", headers=cp.admin)
        events = cp.client.get(f"/api/v1/jobs/{job['job_id']}/events", headers=cp.admin)
        assert SECRET_VALUE not in response.text + view.text + events.text
        assert view.json()["state"] == "failed", view.text
        assert view.json()["error"]["code"] == "SECRET_NOT_PERMITTED", view.text


def _job_body() -> dict[str, Any]:
    return {"entrypoint": {"kind": "python", "module": "m", "function": "f", "source": {}}}


def test_a_service_holds_its_gpu_and_is_synced_to_its_node(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        assert _put_secret(cp, "API_KEY", {"site": "a"}).status_code == 200
        service = _deploy(
            cp,
            labels={"site": "a"},
            resources={"cpus": 1, "gpus": 1},
            secrets=["API_KEY"],
            env={"MODE": "fast"},
        )
        assert service["state"] == "pending"
        assert service["waiting_reason"]["code"] == "NO_MATCHING_NODE"

        node = _node(cp, labels={"site": "a"}, gpus=1)
        assert place_services(cp.ctx) == 1
        placed = _service(cp, service["service_id"])
        assert placed["state"] == "starting" and placed["node_id"] == node["node_id"]
        assert [gpu["index"] for gpu in placed["gpus"]] == [0]
        scrape = cp.client.get("/metrics", headers=cp.admin)
        assert 'modelforge_services{state="starting"} 1.0' in scrape.text, scrape.text[-500:]

        # The GPU is held: a 1-GPU job waits, and its reason names the service.
        job = _submit(cp, labels={"site": "a"}, resources={"gpus": 1})
        assert _claim(cp, node) is None
        reason = _wait_reason(cp, job["job_id"], "NO_ROOM", "needs 1 GPU")
        assert "web" in reason["message"]

        desired = _sync(cp, node, service_host="10.1.2.3")
        (spec,) = desired["services"]
        assert spec["service_id"] == service["service_id"] and spec["generation"] == 1
        assert spec["secrets"] == {"API_KEY": SECRET_VALUE} and spec["env"] == {"MODE": "fast"}
        status = {
            "service_id": service["service_id"],
            "generation": 1,
            "state": "healthy",
            "port": 8123,
            "restarts": 1,
            "last_exit": {"code": None, "signal": 9},
            "events": [{"kind": "exit", "data": {"signal": 9}}],
            "log_tail": ["Serving HTTP on 0.0.0.0 port 8123"],
        }
        _sync(cp, node, service_host="10.1.2.3", services=[status])
        healthy = _service(cp, service["service_id"])
        assert healthy["state"] == "healthy" and healthy["url"] == "http://10.1.2.3:8123"
        assert healthy["restarts"] == 1 and healthy["log_tail"] == status["log_tail"]
        assert SECRET_VALUE not in str(healthy)
        # The metrics carry each service's state (1 for its state, 0 for the others) and restarts.
        scraped = cp.client.get("/metrics", headers=cp.admin).text
        ident = f'name="web",service="{service["service_id"]}"'
        assert f'modelforge_service_state{{{ident},state="healthy"}} 1.0' in scraped, scraped
        assert f'modelforge_service_state{{{ident},state="starting"}} 0.0' in scraped
        assert f"modelforge_service_restarts{{{ident}}} 1.0" in scraped
        events = cp.client.get(
            f"/api/v1/services/{service['service_id']}/events", headers=cp.admin
        ).json()
        assert {"signal": 9} in [event["data"] for event in events]

        restarted = cp.client.post(
            f"/api/v1/services/{service['service_id']}/restart", headers=cp.admin
        )
        assert restarted.json()["generation"] == 2
        assert _sync(cp, node)["services"][0]["generation"] == 2

        other = _node(cp, labels={"site": "b"})
        assert _sync(cp, other)["services"] == []  # another node is never told about it

        undeployed = cp.client.delete(f"/api/v1/services/{service['service_id']}", headers=cp.admin)
        assert undeployed.json()["state"] == "stopped"
        assert ident not in cp.client.get("/metrics", headers=cp.admin).text  # undeployed: gone
        assert _sync(cp, node)["services"] == []  # the agent stops it
        got = _claim(cp, node)  # and the GPU is free for the job
        assert got is not None and got["job_id"] == job["job_id"]

        actions = [
            e["action"] for e in cp.client.get("/api/v1/admin/audit", headers=cp.admin).json()
        ]
        for action in ("service.deploy", "service.restart", "service.undeploy", "secret.set"):
            assert action in actions


def test_a_service_whose_node_goes_offline_is_placed_again(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        first = _node(cp)
        service = _deploy(cp)
        assert place_services(cp.ctx) == 1
        assert _service(cp, service["service_id"])["node_id"] == first["node_id"]

        cp.clock.advance(cp.ctx.settings.node_offline_after_seconds + 1)
        second = _node(cp)
        assert place_services(cp.ctx) == 1
        moved = _service(cp, service["service_id"])
        assert moved["node_id"] == second["node_id"] and moved["state"] == "starting"
        # The first node comes back: its sync no longer lists the service (it stops it).
        assert _sync(cp, first)["services"] == []
        assert [s["service_id"] for s in _sync(cp, second)["services"]] == [service["service_id"]]


def test_bad_service_bodies_are_refused_and_change_nothing(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        for body in (
            {"name": "x"},  # nothing to run
            {"name": "x", "command": ["a"], "runner": "onnx", "weights": "sha256:" + "1" * 64},
            {"name": "x", "command": ["serve", "{weights}"]},  # {weights} without weights
            {"name": "x", "runner": "onnx"},  # onnx without weights
            {
                "name": "x",
                "command": ["a"],
                "restart": {"initial_backoff_seconds": 5, "max_backoff_seconds": 1},
            },
        ):
            response = cp.client.post("/api/v1/services", headers=cp.admin, json=body)
            assert response.status_code == 422, (body, response.text)
        missing = cp.client.post(
            "/api/v1/services",
            headers=cp.admin,
            json={"name": "x", "runner": "onnx", "weights": "sha256:" + "2" * 64},
        )
        assert missing.status_code == 404
        assert cp.client.get("/api/v1/services", headers=cp.admin).json() == []
