"""The audit log (AU-1): every admin action leaves one entry — actor, action, target, outcome —
and no secret value. Each admin route that changes something is driven once here through the
real app; a new such route without an entry in `AUDITED` (or `NOT_ADMIN_ACTIONS`) fails
`test_every_changing_admin_route_is_listed`, so it cannot ship unaudited by omission."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.control_plane.test_jobs import _node, _submit
from tests.control_plane.test_workloads import SECRET_VALUE, _deploy, _put_secret, _upload
from tests.factories import control_plane

#: Each changing admin route and the audit action it records.
AUDITED = {
    "POST /api/v1/admin/node-enrollments": "enrollment.mint",
    "POST /api/v1/admin/node-enrollments/{enrollment_id}/revoke": "enrollment.revoke",
    "DELETE /api/v1/admin/nodes/{node_id}": "node.delete",
    "POST /api/v1/admin/nodes/{node_id}/credential/revoke": "node.credential.revoke",
    "POST /api/v1/admin/nodes/{node_id}/gpus/{uuid}/quarantine": "gpu.quarantine",
    "POST /api/v1/admin/nodes/{node_id}/gpus/{uuid}/readmit": "gpu.readmit",
    "POST /api/v1/admin/credentials/{jti}/revoke": "credential.revoke",
    "POST /api/v1/admin/signing-key/rotate": "signing_key.rotate",
    "POST /api/v1/jobs": "job.submit",
    "POST /api/v1/jobs:batch": "job.submit",
    "DELETE /api/v1/jobs/{job_id}": "job.delete",
    "POST /api/v1/jobs/{job_id}/cancel": "job.cancel",
    "POST /api/v1/artifacts": "artifact.upload",
    "POST /api/v1/admin/artifacts/sweep": "artifact.sweep",
    "POST /api/v1/models": "model.create",
    "PUT /api/v1/admin/secrets/{name}": "secret.set",
    "DELETE /api/v1/admin/secrets/{name}": "secret.delete",
    "POST /api/v1/admin/secrets/rotate-key": "secret.rotate_key",
    "POST /api/v1/services": "service.deploy",
    "DELETE /api/v1/services/{service_id}": "service.undeploy",
    "POST /api/v1/services/{service_id}/restart": "service.restart",
    "PATCH /api/v1/services/{service_id}": "service.update",
    "POST /api/v1/services/{service_id}/access-tokens": "service_token.create",
    "DELETE /api/v1/services/{service_id}/access-tokens/{token_id}": "service_token.revoke",
    "POST /api/v1/access-tokens": "access_token.create",
    "DELETE /api/v1/access-tokens/{token_id}": "access_token.revoke",
    "POST /api/v1/users": "user.create",
    "PATCH /api/v1/users/{name}": "user.update",
    "DELETE /api/v1/users/{name}": "user.delete",
    "POST /api/v1/me/keys": "api_key.create",
    "DELETE /api/v1/me/keys/{key_id}": "api_key.revoke",
    "DELETE /api/v1/users/{name}/keys/{key_id}": "api_key.revoke",
}
#: Routes that change nothing an operator administers: a check that only reads the release
#: manifest, the start command (its token was minted, and audited, already), and signing in or
#: out of the console.
NOT_ADMIN_ACTIONS = {
    "POST /api/v1/admin/node-images/check",
    "POST /api/v1/admin/node-enrollments/{enrollment_id}/node-setup",
    "POST /api/v1/console/session",
    "DELETE /api/v1/console/session",
}


def test_every_changing_admin_route_is_listed(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        paths = cp.client.get("/openapi.json").json()["paths"]
    changing = {
        f"{method.upper()} {path}"
        for path, operations in paths.items()
        for method in operations
        if method not in ("get", "head") and not path.startswith("/api/v1/agent/")
    }
    assert changing == set(AUDITED) | NOT_ADMIN_ACTIONS


def _ok(response: Any, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json() if response.content else None


def test_each_admin_action_is_audited_with_its_target_and_no_secret(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        done: list[tuple[str, str]] = []  # (action, target) in the order performed
        admin, client = cp.admin, cp.client

        minted = cp.mint()
        done.append(("enrollment.mint", minted["enrollment_id"]))
        spare = cp.mint()
        done.append(("enrollment.mint", spare["enrollment_id"]))
        _ok(
            client.post(
                f"/api/v1/admin/node-enrollments/{spare['enrollment_id']}/revoke", headers=admin
            )
        )
        done.append(("enrollment.revoke", spare["enrollment_id"]))

        node = _node(cp, labels={"site": "a"})
        credentials = _ok(
            client.get(f"/api/v1/admin/credentials?node_id={node['node_id']}", headers=admin)
        )
        jti = credentials[0]["jti"]
        _ok(client.post(f"/api/v1/admin/credentials/{jti}/revoke", headers=admin))
        done.append(("credential.revoke", jti))
        other = _node(cp)
        _ok(client.post(f"/api/v1/admin/nodes/{other['node_id']}/credential/revoke", headers=admin))
        done.append(("node.credential.revoke", other["node_id"]))
        _ok(client.delete(f"/api/v1/admin/nodes/{other['node_id']}", headers=admin), 204)
        done.append(("node.delete", other["node_id"]))
        gpu_node = _node(cp, gpus=1)
        gpu = f"/api/v1/admin/nodes/{gpu_node['node_id']}/gpus/GPU-{gpu_node['node_id']}-0"
        _ok(client.post(f"{gpu}/quarantine", headers=admin, json={"reason": "maintenance"}))
        done.append(("gpu.quarantine", f"{gpu_node['node_id']}/GPU-{gpu_node['node_id']}-0"))
        _ok(client.post(f"{gpu}/readmit", headers=admin))
        done.append(("gpu.readmit", f"{gpu_node['node_id']}/GPU-{gpu_node['node_id']}-0"))
        _ok(client.post("/api/v1/admin/signing-key/rotate", headers=admin))

        assert _put_secret(cp, "HF_TOKEN", {"site": "a"}).status_code == 200
        done.append(("secret.set", "HF_TOKEN"))
        job = _submit(cp, secrets=["HF_TOKEN"])
        done.append(("job.submit", job["job_id"]))
        batch = _ok(client.post("/api/v1/jobs:batch", headers=admin, json={"jobs": [_job()]}), 201)
        _ok(client.post(f"/api/v1/jobs/{job['job_id']}/cancel", headers=admin))
        done.append(("job.cancel", job["job_id"]))
        _ok(client.delete(f"/api/v1/jobs/{job['job_id']}", headers=admin), 204)
        done.append(("job.delete", job["job_id"]))

        digest = _upload(cp, b"weights")
        done.append(("artifact.upload", digest))
        _ok(
            client.post(
                "/api/v1/models",
                headers=admin,
                json={"name": "m", "version": "1", "runner": "onnx", "weights": digest},
            ),
            201,
        )
        done.append(("model.create", "m@1"))
        _ok(client.post("/api/v1/admin/artifacts/sweep", headers=admin, json={"dry_run": True}))
        service = _deploy(cp, secrets=["HF_TOKEN"])
        tokens = f"/api/v1/services/{service['service_id']}/access-tokens"
        access = _ok(client.post(tokens, headers=admin, json={"name": "app"}), 201)
        done.append(("service_token.create", f"{service['service_id']}/{access['id']}"))
        _ok(client.delete(f"{tokens}/{access['id']}", headers=admin))
        done.append(("service_token.revoke", f"{service['service_id']}/{access['id']}"))
        key = {"name": "team", "services": [service["service_id"]]}
        access = _ok(client.post("/api/v1/access-tokens", headers=admin, json=key), 201)
        done.append(("access_token.create", access["id"]))
        _ok(client.delete(f"/api/v1/access-tokens/{access['id']}", headers=admin))
        done.append(("access_token.revoke", access["id"]))
        _ok(client.post(f"/api/v1/services/{service['service_id']}/restart", headers=admin))
        done.append(("service.restart", service["service_id"]))
        patch = {"replicas": 2}
        _ok(client.patch(f"/api/v1/services/{service['service_id']}", headers=admin, json=patch))
        done.append(("service.update", service["service_id"]))
        _ok(client.delete(f"/api/v1/services/{service['service_id']}", headers=admin))
        done.append(("service.undeploy", service["service_id"]))
        _ok(client.post("/api/v1/admin/secrets/rotate-key", headers=admin))
        _ok(client.delete("/api/v1/admin/secrets/HF_TOKEN", headers=admin), 204)
        done.append(("secret.delete", "HF_TOKEN"))

        password = "a passphrase of ada's"  # noqa: S105
        person = {"name": "ada", "role": "admin", "password": password}
        _ok(client.post("/api/v1/users", headers=admin, json=person), 201)
        done.append(("user.create", "ada"))
        csrf = _ok(
            client.post("/api/v1/console/session", json={"name": "ada", "password": password}),
            201,
        )["csrf_token"]
        as_ada = {"X-ModelForge-CSRF": csrf}
        mine = {"name": "laptop", "scopes": ["read"]}
        first = _ok(client.post("/api/v1/me/keys", headers=as_ada, json=mine), 201)
        done.append(("api_key.create", "laptop"))
        _ok(client.delete(f"/api/v1/me/keys/{first['id']}", headers=as_ada), 204)
        done.append(("api_key.revoke", first["id"]))
        second = _ok(client.post("/api/v1/me/keys", headers=as_ada, json=mine), 201)
        client.cookies.clear()
        _ok(client.delete(f"/api/v1/users/ada/keys/{second['id']}", headers=admin), 204)
        done.append(("api_key.revoke", second["id"]))
        _ok(client.patch("/api/v1/users/ada", headers=admin, json={"role": "viewer"}))
        done.append(("user.update", "ada"))
        _ok(client.delete("/api/v1/users/ada", headers=admin), 204)
        done.append(("user.delete", "ada"))

        entries = _ok(client.get("/api/v1/admin/audit?limit=1000", headers=admin))
        recorded = [(e["action"], e["target"]) for e in reversed(entries) if e["outcome"] == "ok"]
        for expected in done:
            assert expected in recorded, (expected, recorded)
        actions = {action for action, _ in recorded}
        assert set(AUDITED.values()) <= actions, set(AUDITED.values()) - actions
        (batched,) = [e for e in entries if e["target"] == "batch of 1"]
        assert batched["detail"]["first"] == batch["jobs"][0]["job_id"]
        by_ada = {e["action"] for e in entries if e["actor"] == "user:ada"}
        assert by_ada == {"api_key.create", "api_key.revoke"}  # the person, not the token
        assert all(e["actor"] in ("admin-token", "user:ada") for e in entries)
        text = str(entries)
        assert password not in text and first["key"] not in text and second["key"] not in text
        assert SECRET_VALUE not in text and minted["token"] not in text
        assert access["token"] not in text
        assert cp.admin["X-ModelForge-Admin-Token"] not in text


def _job() -> dict[str, Any]:
    return {"entrypoint": {"kind": "python", "module": "m", "function": "f", "source": {}}}
