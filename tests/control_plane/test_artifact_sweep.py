"""Artifact lifetime (AR-3, AR-3a): what the sweep keeps and why, what it deletes (rows and files),
the dry run, its races with a new reference and with an upload, the list and sweep endpoints,
their audit entry and the settings. SQLite and PostgreSQL; the lock races on PostgreSQL only."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import delete, select

from control_plane.artifacts import sweep
from control_plane.artifacts.store import reference_artifacts
from control_plane.background.loops import start_loops, stop_loops, sweep_artifacts
from control_plane.errors import NotFound
from control_plane.models import Artifact, ArtifactUpload, AuditEntry, Model, Service
from tests.factories import ControlPlane, control_plane, heartbeat_body, inventory_body

GRACE = 86400.0
PAST_GRACE = GRACE + 60


@contextmanager
def _control_plane(tmp_path: Path, database_url: str, **overrides: Any) -> Iterator[ControlPlane]:
    with control_plane(tmp_path, database_url, **overrides) as cp:
        # The shared PostgreSQL test database is truncated per test only for the older tables.
        with cp.ctx.session_factory.begin() as session:
            for table in (Service, Model, AuditEntry):
                session.execute(delete(table))
        yield cp


def _upload(cp: ControlPlane, payload: bytes | None = None) -> str:
    """Upload through the API; the file's modification time is put on the test's clock, which
    the sweep reads it against."""
    payload = payload if payload is not None else secrets.token_bytes(2048)
    response = cp.client.post("/api/v1/artifacts", headers=cp.admin, content=payload)
    assert response.status_code == 201, response.text
    digest = str(response.json()["digest"])
    assert digest == "sha256:" + hashlib.sha256(payload).hexdigest()
    _touch(_path(cp, digest), cp)
    return digest


def _path(cp: ControlPlane, digest: str) -> Path:
    return cp.ctx.artifacts.path_for(digest)


def _touch(path: Path, cp: ControlPlane, seconds_ago: float = 0) -> None:
    when = cp.clock.now().timestamp() - seconds_ago
    os.utime(path, (when, when))


def _row(cp: ControlPlane, digest: str) -> Artifact | None:
    with cp.ctx.session_factory() as session:
        return session.get(Artifact, digest)


def _sweep(cp: ControlPlane, body: Any = None) -> dict[str, Any]:
    response = cp.client.post("/api/v1/admin/artifacts/sweep", headers=cp.admin, json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _deleted(report: dict[str, Any]) -> list[str]:
    return [item["digest"] for item in report["deleted"]]


def _reasons(report: dict[str, Any], digest: str) -> list[str]:
    kept = {item["digest"]: item["reasons"] for item in report["kept"]}
    return list(kept[digest])


def _add_model(cp: ControlPlane, weights: str, name: str = "resnet", version: str = "1") -> str:
    model_id = "mdl_" + secrets.token_hex(6)
    with cp.ctx.session_factory.begin() as session:
        session.add(
            Model(
                id=model_id,
                name=name,
                version=version,
                runner="onnx",
                weights=weights,
                created_at=cp.clock.now(),
            )
        )
    return model_id


def _add_service(cp: ControlPlane, weights: str, name: str, state: str) -> str:
    service_id = "svc_" + secrets.token_hex(6)
    now = cp.clock.now()
    with cp.ctx.session_factory.begin() as session:
        session.add(
            Service(
                id=service_id,
                name=name,
                state=state,
                runner="onnx",
                weights=weights,
                created_at=now,
                updated_at=now,
                stopped_at=now if state == "stopped" else None,
            )
        )
    return service_id


def _node(cp: ControlPlane) -> dict[str, str]:
    minted = cp.mint()
    enrolled = cp.enroll_raw(minted["token"]).json()
    headers = cp.agent(enrolled["credential"])
    cp.client.put("/api/v1/agent/inventory", headers=headers, json=inventory_body())
    cp.client.post("/api/v1/agent/heartbeat", headers=headers, json=heartbeat_body())
    cp.flush()
    return headers


def _submit(cp: ControlPlane, **body: Any) -> str:
    body.setdefault(
        "entrypoint",
        {"kind": "python", "module": "m", "function": "f", "source": {"m.py": "def f(): pass"}},
    )
    response = cp.client.post("/api/v1/jobs", headers=cp.admin, json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["job_id"])


def _claim(cp: ControlPlane, node: dict[str, str]) -> str:
    response = cp.client.post("/api/v1/agent/work/claim", headers=node, json={"hold_seconds": 0})
    assert response.status_code == 200, response.text
    return str(response.json()["job_id"])


def _complete(cp: ControlPlane, node: dict[str, str], job_id: str, **body: Any) -> None:
    response = cp.client.post(
        f"/api/v1/agent/jobs/{job_id}/complete", headers=node, json={"state": "succeeded", **body}
    )
    assert response.status_code == 200, response.text


# -- what is kept, and why ------------------------------------------------------------------------


def test_weights_named_by_a_model_survive_the_job_that_produced_them(
    tmp_path: Path, database_url: str
) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        job_id = _submit(cp)
        assert _claim(cp, node) == job_id
        # The job saves its weights: the node uploads them, and names them as the job's output.
        payload = secrets.token_bytes(4096)
        digest = "sha256:" + hashlib.sha256(payload).hexdigest()
        put = cp.client.put(f"/api/v1/agent/artifacts/{digest}", headers=node, content=payload)
        assert put.status_code == 201, put.text
        _complete(cp, node, job_id, outputs={"weights": digest})
        _add_model(cp, digest, name="resnet", version="1")
        scratch = _upload(cp)  # nobody names it: the sweep deletes it, so it did run
        assert cp.client.delete(f"/api/v1/jobs/{job_id}", headers=cp.admin).status_code == 204
        _touch(_path(cp, digest), cp)
        cp.clock.advance(PAST_GRACE)

        report = _sweep(cp)

        assert _reasons(report, digest) == ["named by model resnet@1"]
        assert _row(cp, digest) is not None and _path(cp, digest).read_bytes() == payload
        assert _deleted(report) == [scratch]


def test_weights_of_a_deployed_service_survive_those_of_a_stopped_one_do_not(
    tmp_path: Path, database_url: str
) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        served, retired = _upload(cp), _upload(cp)
        serving = _add_service(cp, served, "resnet-serve", "unhealthy")
        _add_service(cp, retired, "old-serve", "stopped")
        cp.clock.advance(PAST_GRACE)

        report = _sweep(cp)

        assert _reasons(report, served) == [f"named by service resnet-serve ({serving})"]
        assert _deleted(report) == [retired]
        assert _row(cp, served) is not None and _path(cp, served).is_file()
        assert _row(cp, retired) is None and not _path(cp, retired).exists()


def test_queued_and_running_jobs_keep_their_digests_finished_jobs_do_not(
    tmp_path: Path, database_url: str
) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        finished_input = _upload(cp)
        finished = _submit(cp, inputs={"data": finished_input})
        assert _claim(cp, node) == finished
        _complete(cp, node, finished)
        running_input, queued_input, queued_model = _upload(cp), _upload(cp), _upload(cp)
        running = _submit(cp, inputs={"data": running_input})
        assert _claim(cp, node) == running
        queued = _submit(
            cp, entrypoint={"kind": "onnx", "model": queued_model}, inputs={"x": queued_input}
        )
        cp.clock.advance(PAST_GRACE)

        report = _sweep(cp)

        assert _reasons(report, running_input) == [f"named by running job {running}"]
        assert _reasons(report, queued_input) == [f"named by queued job {queued}"]
        assert _reasons(report, queued_model) == [f"named by queued job {queued}"]
        assert _deleted(report) == [finished_input]
        assert _row(cp, finished_input) is None and not _path(cp, finished_input).exists()


def test_an_artifact_younger_than_the_grace_period_is_kept_with_the_time_left(
    tmp_path: Path, database_url: str
) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        digest = _upload(cp)
        cp.clock.advance(GRACE - 3600 - 120)

        report = _sweep(cp)

        assert _reasons(report, digest) == ["younger than the grace period (1 h 2 min left)"]
        assert report["deleted"] == [] and report["bytes_freed"] == 0
        assert _row(cp, digest) is not None and _path(cp, digest).is_file()


def test_the_dry_run_lists_exactly_what_the_sweep_then_deletes_and_changes_nothing(
    tmp_path: Path, database_url: str
) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        unnamed_payload = secrets.token_bytes(3000)
        unnamed = "sha256:" + hashlib.sha256(unnamed_payload).hexdigest()
        put = cp.client.put(
            f"/api/v1/agent/artifacts/{unnamed}", headers=node, content=unnamed_payload
        )
        assert put.status_code == 201, put.text
        _touch(_path(cp, unnamed), cp)
        named = _upload(cp)
        _add_model(cp, named)
        cp.clock.advance(PAST_GRACE)
        fresh = _upload(cp)

        dry = _sweep(cp, {"dry_run": True})

        assert dry["dry_run"] is True
        assert dry["deleted"] == [
            {
                "digest": unnamed,
                "size_bytes": 3000,
                "created_at": dry["deleted"][0]["created_at"],
            }
        ]
        assert dry["bytes_freed"] == 3000 and dry["removed_files"] == []
        assert {item["digest"] for item in dry["kept"]} == {named, fresh}
        assert _row(cp, unnamed) is not None and _path(cp, unnamed).read_bytes() == unnamed_payload
        assert _sweep(cp, {"dry_run": True})["deleted"] == dry["deleted"]  # nothing changed

        real = _sweep(cp, {"dry_run": False})

        assert real["dry_run"] is False
        assert real["deleted"] == dry["deleted"] and real["kept"] == dry["kept"]
        assert real["bytes_freed"] == 3000
        assert _row(cp, unnamed) is None and not _path(cp, unnamed).exists()
        with cp.ctx.session_factory() as session:
            uploads = session.scalars(
                select(ArtifactUpload).where(ArtifactUpload.digest == unnamed)
            )
            assert list(uploads) == []
        download = cp.client.get(f"/api/v1/artifacts/{unnamed}", headers=cp.admin)
        assert download.status_code == 404
        trash = cp.ctx.artifacts.root / "trash"
        assert not trash.exists() or list(trash.iterdir()) == []
        assert _sweep(cp)["deleted"] == []


def test_files_without_a_row_past_the_grace_period_are_removed_and_listed(
    tmp_path: Path, database_url: str
) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        kept = _upload(cp)
        _add_model(cp, kept)
        store = cp.ctx.artifacts
        stray = store.path_for("sha256:" + "ab" * 32)
        stray.parent.mkdir(mode=0o700, exist_ok=True)
        stray.write_bytes(b"x" * 100)
        crashed = store.root / "tmp" / "upload-0123456789abcdef"
        crashed.write_bytes(b"y" * 10)
        cp.clock.advance(PAST_GRACE)
        _touch(stray, cp, seconds_ago=PAST_GRACE)
        _touch(crashed, cp, seconds_ago=PAST_GRACE)
        young = store.path_for("sha256:" + "cd" * 32)
        young.parent.mkdir(mode=0o700, exist_ok=True)
        young.write_bytes(b"z")
        _touch(young, cp, seconds_ago=60)

        dry = _sweep(cp, {"dry_run": True})
        report = _sweep(cp)

        listed = [(item["path"], item["size_bytes"]) for item in report["removed_files"]]
        assert listed == [(f"sha256/ab/{'ab' * 32}", 100), ("tmp/upload-0123456789abcdef", 10)]
        assert dry["removed_files"] == report["removed_files"]
        assert report["bytes_freed"] == 110 and report["deleted"] == []
        assert not stray.exists() and not crashed.exists()
        assert young.is_file() and _path(cp, kept).is_file()


# -- races with an upload of the same digest ----------------------------------------------------


def test_an_upload_of_the_same_content_just_before_the_sweep_keeps_it(
    tmp_path: Path, database_url: str
) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        payload = secrets.token_bytes(512)
        digest = _upload(cp, payload)
        cp.clock.advance(PAST_GRACE)
        again = cp.client.post("/api/v1/artifacts", headers=cp.admin, content=payload)
        assert again.status_code == 201
        _touch(_path(cp, digest), cp, seconds_ago=300)  # the re-upload renamed a new file there

        report = _sweep(cp)

        assert _reasons(report, digest) == [
            "uploaded again 5 min ago: within the grace period (23 h 55 min left)"
        ]
        assert _row(cp, digest) is not None and _path(cp, digest).read_bytes() == payload


def test_a_rolled_back_sweep_puts_the_files_back(tmp_path: Path, database_url: str) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        payload = secrets.token_bytes(700)
        digest = _upload(cp, payload)
        cp.clock.advance(PAST_GRACE)
        with cp.ctx.session_factory() as session:
            report = sweep.sweep(
                session=session,
                store=cp.ctx.artifacts,
                clock=cp.clock,
                grace=timedelta(seconds=GRACE),
                dry_run=False,
            )
            assert [item.digest for item in report.deleted] == [digest]
            assert not _path(cp, digest).exists()  # moved aside until the transaction ends
            session.rollback()
        assert _path(cp, digest).read_bytes() == payload and _row(cp, digest) is not None
        assert list((cp.ctx.artifacts.root / "trash").iterdir()) == []


def test_an_upload_landing_while_the_sweep_commits_gets_its_row_back(
    tmp_path: Path, database_url: str
) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        payload = secrets.token_bytes(900)
        digest = _upload(cp, payload)
        cp.clock.advance(PAST_GRACE)
        with cp.ctx.session_factory.begin() as session:
            report = sweep.sweep(
                session=session,
                store=cp.ctx.artifacts,
                clock=cp.clock,
                grace=timedelta(seconds=GRACE),
                dry_run=False,
            )
            assert [item.digest for item in report.deleted] == [digest]
            # The upload renames its verified file into place; it saw the old row (not yet
            # deleted), so it inserts none.
            _path(cp, digest).write_bytes(payload)

        row = _row(cp, digest)
        assert row is not None and row.size_bytes == 900 and row.created_at == cp.clock.now()
        assert _path(cp, digest).read_bytes() == payload
        assert list((cp.ctx.artifacts.root / "trash").iterdir()) == []


def test_trash_left_by_a_crashed_sweep_is_put_back_or_removed(
    tmp_path: Path, database_url: str
) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        payload = secrets.token_bytes(300)
        digest = _upload(cp, payload)
        _add_model(cp, digest)
        trash = cp.ctx.artifacts.root / "trash"
        trash.mkdir(mode=0o700)
        hex_digest = digest.removeprefix("sha256:")
        os.replace(_path(cp, digest), trash / f"{hex_digest}.0a1b2c")  # crashed before commit
        gone = trash / f"{'ef' * 32}.3d4e5f"  # crashed after commit, before the unlink
        gone.write_bytes(b"old")

        _sweep(cp)

        assert _path(cp, digest).read_bytes() == payload
        assert list(trash.iterdir()) == []


# -- races with a new reference (PostgreSQL row locks) ------------------------------------------


def _sweep_in_thread(cp: ControlPlane) -> dict[str, Any]:
    result: dict[str, Any] = {}

    def run() -> None:
        result["report"] = _sweep(cp)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the sweep waited on a writer"
    return dict(result["report"])


def test_a_reference_in_progress_is_kept_then_seen_once_committed(
    tmp_path: Path, pg_database_url: str
) -> None:
    with _control_plane(tmp_path, pg_database_url) as cp:
        digest = _upload(cp)
        cp.clock.advance(PAST_GRACE)
        writer = cp.ctx.session_factory()
        try:
            writer.begin()
            reference_artifacts(writer, [digest], required=True, named_by="model resnet@2")
            writer.add(
                Model(
                    id="mdl_race",
                    name="resnet",
                    version="2",
                    runner="onnx",
                    weights=digest,
                    created_at=cp.clock.now(),
                )
            )
            writer.flush()

            during = _sweep_in_thread(cp)  # the writer holds the row FOR SHARE

            assert _reasons(during, digest) == ["being named by a request in progress"]
            writer.commit()
        finally:
            writer.close()

        after = _sweep(cp)

        assert _reasons(after, digest) == ["named by model resnet@2"]
        assert _row(cp, digest) is not None and _path(cp, digest).is_file()


def test_a_writer_after_the_sweeps_lock_waits_for_it_and_is_refused(
    tmp_path: Path, pg_database_url: str
) -> None:
    with _control_plane(tmp_path, pg_database_url) as cp:
        digest = _upload(cp)
        cp.clock.advance(PAST_GRACE)
        outcome: dict[str, BaseException | None] = {}
        locked = threading.Event()

        def name_it() -> None:
            with cp.ctx.session_factory.begin() as writer:
                locked.set()
                try:
                    reference_artifacts(writer, [digest], required=True, named_by="job j")
                    outcome["error"] = None
                except NotFound as exc:
                    outcome["error"] = exc

        with cp.ctx.session_factory.begin() as session:
            sweep.sweep(
                session=session,
                store=cp.ctx.artifacts,
                clock=cp.clock,
                grace=timedelta(seconds=GRACE),
                dry_run=False,
            )
            thread = threading.Thread(target=name_it)
            thread.start()
            locked.wait(10)
            thread.join(timeout=0.5)
            assert thread.is_alive()  # waiting on the sweep's row lock
        thread.join(timeout=10)

        error = outcome["error"]
        assert isinstance(error, NotFound) and error.code == "ARTIFACT_NOT_FOUND"
        assert _row(cp, digest) is None and not _path(cp, digest).exists()


# -- the endpoints ------------------------------------------------------------------------------


def test_the_sweep_is_audited(tmp_path: Path, database_url: str) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        digest = _upload(cp)
        cp.clock.advance(PAST_GRACE)

        _sweep(cp, {"dry_run": True})
        _sweep(cp)

        with cp.ctx.session_factory() as session:
            entries = list(
                session.scalars(
                    select(AuditEntry)
                    .where(AuditEntry.action == "artifact.sweep")
                    .order_by(AuditEntry.id)
                )
            )
        assert [(e.actor, e.target, e.outcome) for e in entries] == [
            ("admin-token", "artifacts", "ok"),
            ("admin-token", "artifacts", "ok"),
        ]
        assert entries[0].detail == {
            "dry_run": True,
            "deleted": 1,
            "removed_files": 0,
            "bytes_freed": 2048,
        }
        assert entries[1].detail["dry_run"] is False and entries[1].detail["deleted"] == 1
        assert _row(cp, digest) is None


@pytest.mark.parametrize(
    "body", [{"dry_run": "yes"}, {"dry_run": 1}, {"dry_run": True, "force": True}, [True]]
)
def test_a_bad_sweep_body_is_refused_and_changes_nothing(
    tmp_path: Path, database_url: str, body: Any
) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        digest = _upload(cp)
        cp.clock.advance(PAST_GRACE)

        response = cp.client.post("/api/v1/admin/artifacts/sweep", headers=cp.admin, json=body)

        assert response.status_code == 422
        error = response.json()["error"]
        assert error["code"] == "INVALID_REQUEST" and error["next_step"]
        assert set(response.json()) == {"error"}
        assert _row(cp, digest) is not None and _path(cp, digest).is_file()
        with cp.ctx.session_factory() as session:
            audited = session.scalars(
                select(AuditEntry).where(AuditEntry.action == "artifact.sweep")
            )
            assert list(audited) == []


def test_the_endpoints_need_the_admin_token(tmp_path: Path, database_url: str) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        digest = _upload(cp)
        cp.clock.advance(PAST_GRACE)
        for response in (
            cp.client.get("/api/v1/artifacts"),
            cp.client.post("/api/v1/admin/artifacts/sweep", json={"dry_run": False}),
        ):
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "ADMIN_TOKEN_MISSING"
        assert _row(cp, digest) is not None


def test_the_list_is_newest_first_with_references_and_pages(
    tmp_path: Path, database_url: str
) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        digests = []
        for _ in range(3):
            digests.append(_upload(cp))
            cp.clock.advance(10)
        model_id = _add_model(cp, digests[0], name="bert", version="3")
        service_id = _add_service(cp, digests[0], "bert-serve", "healthy")
        _add_service(cp, digests[1], "gone", "stopped")

        first = cp.client.get("/api/v1/artifacts?limit=2", headers=cp.admin)
        assert first.status_code == 200, first.text
        page = first.json()
        assert [item["digest"] for item in page] == [digests[2], digests[1]]
        assert page[0]["size_bytes"] == 2048 and page[1]["references"] == []
        rest = cp.client.get(
            f"/api/v1/artifacts?limit=2&before={page[-1]['digest']}", headers=cp.admin
        ).json()
        assert [item["digest"] for item in rest] == [digests[0]]
        assert rest[0]["references"] == [
            {"kind": "model", "id": model_id, "name": "bert@3", "state": None},
            {"kind": "service", "id": service_id, "name": "bert-serve", "state": "healthy"},
        ]
        unknown = cp.client.get(f"/api/v1/artifacts?before=sha256:{'0' * 64}", headers=cp.admin)
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "ARTIFACT_NOT_FOUND"
        bad = cp.client.get("/api/v1/artifacts?before=../etc", headers=cp.admin)
        assert bad.status_code == 422


# -- the periodic sweep and its settings --------------------------------------------------------


def test_the_periodic_sweep_logs_its_counts(
    tmp_path: Path, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with _control_plane(tmp_path, database_url) as cp:
        digest = _upload(cp, b"w" * 1000)
        cp.clock.advance(PAST_GRACE)

        with caplog.at_level(logging.INFO, logger="control_plane.background.loops"):
            report = sweep_artifacts(cp.ctx)

        assert [item.digest for item in report.deleted] == [digest]
        assert "artifact sweep: 1 deleted, 0 kept, 0 stray files removed, 1000 bytes freed" in (
            caplog.text
        )
        assert _row(cp, digest) is None and not _path(cp, digest).exists()


@pytest.mark.parametrize(("interval", "expected"), [(3600.0, True), (0.0, False)])
def test_an_interval_of_zero_turns_the_periodic_sweep_off(
    tmp_path: Path, database_url: str, interval: float, expected: bool
) -> None:
    with _control_plane(tmp_path, database_url, artifact_sweep_interval_seconds=interval) as cp:

        async def names() -> set[str]:
            tasks = start_loops(cp.ctx)
            try:
                return {task.get_name() for task in tasks}
            finally:
                await stop_loops(cp.ctx, tasks)

        assert ("artifact sweep" in asyncio.run(names())) is expected


def test_sweep_settings_are_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from control_plane.settings import Settings

    monkeypatch.setenv("MODELFORGE_DATA_DIR", str(tmp_path))
    defaults = Settings()
    assert defaults.artifact_sweep_interval_seconds == 3600
    assert defaults.artifact_grace_seconds == 86400
    monkeypatch.setenv("MODELFORGE_ARTIFACT_SWEEP_INTERVAL_SECONDS", "30")
    with pytest.raises(ValidationError, match="MODELFORGE_ARTIFACT_SWEEP_INTERVAL_SECONDS"):
        Settings()
    monkeypatch.setenv("MODELFORGE_ARTIFACT_SWEEP_INTERVAL_SECONDS", "0")
    monkeypatch.setenv("MODELFORGE_ARTIFACT_GRACE_SECONDS", "0")
    with pytest.raises(ValidationError, match="artifact_grace_seconds"):
        Settings()
    monkeypatch.setenv("MODELFORGE_ARTIFACT_GRACE_SECONDS", "3600")
    assert Settings().artifact_grace_seconds == 3600
