"""An artifact host (`modelforge-control-plane --artifacts-only`, issue 42): a second process on
the control plane's PostgreSQL database, on another port, serving the agents' artifact routes
alone; an agent given `MODELFORGE_AGENT_ARTIFACT_URL` moves its artifacts through it.

So that the test can tell where the bytes went, the host here keeps its own artifact store (a
deployment shares one between both, docs/artifacts.md): an input uploaded through the host is
on the host's disk only, so a job that reads it can only have fetched it there, and its output
lands there too.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx

from tests.e2e.node import Node, wait_until
from tests.e2e.server import FAST, LiveServer

#: Reads its input and saves a copy of it, reversed, as its output `out`.
WORK = """
import pathlib
from runtime_worker.job import inputs, load_artifact, save_artifact

def work():
    data = load_artifact(inputs()["data"]).read_bytes()
    out = pathlib.Path("out.bin")
    out.write_bytes(data[::-1])
    return {"size": len(data), "digest": save_artifact(out, name="out")}
"""


def _stored(data_dir: Path, digest: str) -> bool:
    hex_digest = digest.removeprefix("sha256:")
    return (data_dir / "artifacts" / "sha256" / hex_digest[:2] / hex_digest).is_file()


def test_an_agent_moves_its_artifacts_through_the_artifact_host(
    tmp_path: Path, pg_database_url: str
) -> None:
    with (
        LiveServer(tmp_path / "cp", pg_database_url, FAST) as server,
        LiveServer(tmp_path / "host", pg_database_url, args=["--artifacts-only"]) as host,
        httpx.Client(timeout=30) as host_client,
    ):
        # The agents' artifact routes, health and version: nothing else is there.
        assert host_client.get(f"{host.url}/api/v1/version").status_code == 200
        for path in ("/api/v1/jobs", "/api/v1/admin/nodes", "/", "/docs", "/v2/models/m"):
            answer = host_client.get(f"{host.url}{path}", headers=server.admin)
            assert answer.status_code == 404, (path, answer.status_code)
        for heartbeat in ("/api/v1/agent/heartbeat", "/api/v1/agent/work/claim"):
            assert host_client.post(f"{host.url}{heartbeat}", json={}).status_code == 404
        assert not (tmp_path / "host" / "admin-token").exists()  # it takes none, makes none

        data = bytes(range(256)) * 4096
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        upload = f"{host.url}/api/v1/agent/artifacts/{digest}"
        assert host_client.put(upload, content=data).status_code == 401  # no credential
        credential = server.enroll("uploader")["credential"]
        refused = host_client.put(
            upload, content=data[:-1], headers={"Authorization": f"Bearer {credential}"}
        )
        assert refused.status_code == 422, refused.text  # not what the digest names
        assert refused.json()["error"]["code"] == "ARTIFACT_DIGEST_MISMATCH"
        stored = host_client.put(
            upload, content=data, headers={"Authorization": f"Bearer {credential}"}
        )
        assert stored.status_code == 201, stored.text
        assert _stored(tmp_path / "host", digest) and not _stored(tmp_path / "cp", digest)
        # One database: the control plane knows the artifact the host stored.
        listed = {a["digest"]: a["size_bytes"] for a in server.get("/api/v1/artifacts")}
        assert listed[digest] == len(data)

        job_id = server.submit_python(WORK, "work", job_fields={"inputs": {"data": digest}})
        with Node(
            tmp_path / "node",
            server.url,
            token=server.mint()["token"],
            extra_env={"MODELFORGE_AGENT_ARTIFACT_URL": host.url},
        ) as node:
            node.start_worker().start_agent()
            wait_until(
                lambda: server.get(f"/api/v1/jobs/{job_id}")["state"] in ("succeeded", "failed"),
                60,
                "the job to end",
            )
            done = server.get(f"/api/v1/jobs/{job_id}")
            assert done["state"] == "succeeded", (done, node.log())
            assert f"artifacts are uploaded to and downloaded from {host.url}" in node.log()
        # The input came from the host (only it had the bytes); the output went there.
        out = done["outputs"]["out"]
        assert done["result"] == {"size": len(data), "digest": out}
        assert _stored(tmp_path / "host", out) and not _stored(tmp_path / "cp", out)
        reversed_digest = "sha256:" + hashlib.sha256(data[::-1]).hexdigest()
        assert out == reversed_digest


def test_an_artifact_host_refuses_a_database_the_control_plane_has_not_migrated(
    tmp_path: Path, pg_database_url: str
) -> None:
    import subprocess

    from sqlalchemy import create_engine, text

    engine = create_engine(pg_database_url)
    with engine.begin() as connection:
        head = connection.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
        connection.execute(text("UPDATE alembic_version SET version_num = '0018'"))
    engine.dispose()
    try:
        host = LiveServer(tmp_path / "host", pg_database_url, args=["--artifacts-only"])
        result = subprocess.run(
            [*_command(host)], env=host.env(), capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 1, result.stderr
        assert "start (or upgrade) the control plane on this database first" in result.stderr
    finally:
        engine = create_engine(pg_database_url)
        with engine.begin() as connection:
            connection.execute(
                text("UPDATE alembic_version SET version_num = :head"), {"head": head}
            )
        engine.dispose()


def _command(server: LiveServer) -> list[str]:
    from tests.e2e.server import control_plane_executable

    return [control_plane_executable(), *server.args]
