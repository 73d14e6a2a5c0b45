"""A full disk: a write that finds no room is refused with `507 STORAGE_FULL` (a message and a
next step, nothing partial left behind, reads still working), and `/api/v1/health` reports the
room left and turns `degraded` below `MODELFORGE_STORAGE_LOW_FREE_BYTES`.

The disk is real: a small tmpfs mounted over the artifact store, or over the whole data dir
(the SQLite database included), unmounted at the end. Mounting needs root (CAP_SYS_ADMIN), as
the CI runs."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from control_plane.artifacts.store import DIGEST_PREFIX
from tests.control_plane.test_jobs import _node
from tests.factories import ControlPlane, control_plane

KIB = 1024
MIB = 1024 * KIB


@contextmanager
def small_disk(directory: Path, size: int) -> Iterator[Path]:
    """`directory`, created 0700, as the mount point of a tmpfs of `size` bytes."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert mounted.returncode == 0, (
        f"these tests mount a small tmpfs and need root (CAP_SYS_ADMIN): {mounted.stderr}"
    )
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def _storage_full(response: httpx.Response) -> None:
    assert response.status_code == 507, response.text
    error = response.json()["error"]
    assert error["code"] == "STORAGE_FULL", error
    assert "full" in error["message"] and "/api/v1/health" in error["next_step"], error


def _health(cp: ControlPlane) -> dict[str, Any]:
    response = cp.client.get("/api/v1/health")
    assert response.status_code == 200, response.text
    return dict(response.json())


def _leftovers(artifacts: Path) -> list[str]:
    tmp = artifacts / "tmp"
    return sorted(path.name for path in tmp.iterdir()) if tmp.is_dir() else []


def test_an_upload_to_a_full_artifact_store_is_refused(tmp_path: Path, database_url: str) -> None:
    data_dir = tmp_path / "data"
    with (
        small_disk(data_dir / "artifacts", 2 * MIB) as artifacts,
        control_plane(data_dir, database_url, storage_low_free_bytes=1536 * KIB) as cp,
    ):
        fresh = _health(cp)
        assert fresh["status"] == "ok" and fresh["storage"]["status"] == "ok", fresh
        assert fresh["storage"]["total_bytes"] == 2 * MIB  # the least roomy: the tmpfs
        assert fresh["storage"]["low_below_bytes"] == 1536 * KIB

        first = cp.client.post("/api/v1/artifacts", headers=cp.admin, content=b"a" * MIB)
        assert first.status_code == 201, first.text
        too_big = b"b" * (1536 * KIB)
        _storage_full(cp.client.post("/api/v1/artifacts", headers=cp.admin, content=too_big))
        assert _leftovers(artifacts) == []  # the partial upload is gone

        node = _node(cp)
        digest = DIGEST_PREFIX + "0" * 64
        agent = {"Authorization": node["Authorization"]}
        put = cp.client.put(f"/api/v1/agent/artifacts/{digest}", headers=agent, content=too_big)
        _storage_full(put)
        assert _leftovers(artifacts) == []

        listed = cp.client.get("/api/v1/artifacts", headers=cp.admin)
        assert listed.status_code == 200, listed.text
        assert [row["digest"] for row in listed.json()] == [first.json()["digest"]]
        low = _health(cp)
        assert low["status"] == "degraded" and low["storage"]["status"] == "low", low
        assert low["storage"]["free_bytes"] < 1536 * KIB

        # The refusals took nothing: what fits is still stored.
        small = cp.client.post("/api/v1/artifacts", headers=cp.admin, content=b"c" * (64 * KIB))
        assert small.status_code == 201, small.text


def _fill(directory: Path) -> Path:
    """Fill the file system of `directory` to the last byte; returns the filler file."""
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as handle:
        block = b"\0" * (64 * KIB)
        for size in (len(block), 4 * KIB, 512, 1):
            try:
                while True:
                    handle.write(block[:size])
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    return filler


def test_a_write_to_a_full_sqlite_database_is_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with small_disk(data_dir, 8 * MIB):
        url = f"sqlite:///{data_dir / 'modelforge.db'}"
        with control_plane(data_dir, url, storage_low_free_bytes=MIB) as cp:
            node = _node(cp)
            secret = {"value": "x" * 60_000, "labels": {}}
            first = cp.client.put("/api/v1/admin/secrets/FIRST", headers=cp.admin, json=secret)
            assert first.status_code == 200, first.text  # the vault's key is written
            filler = _fill(data_dir)
            answers = [
                cp.client.put(f"/api/v1/admin/secrets/S{i}", headers=cp.admin, json=secret)
                for i in range(40)  # until the database's own spare pages are used up
            ]
            refused = [answer for answer in answers if answer.status_code != 200]
            assert refused, "every write fitted: the disk was not full"
            for answer in refused:
                _storage_full(answer)
            stored = cp.client.get("/api/v1/admin/secrets", headers=cp.admin)
            assert stored.status_code == 200, stored.text  # reads still work
            assert len(stored.json()) == 1 + len(answers) - len(refused)  # nothing half-written
            health = _health(cp)
            assert health["status"] == "degraded" and health["storage"]["free_bytes"] < MIB
            assert cp.node(node["node_id"])["node_id"] == node["node_id"]

            os.unlink(filler)  # room again: writes work again, without a restart
            again = cp.client.put("/api/v1/admin/secrets/AGAIN", headers=cp.admin, json=secret)
            assert again.status_code == 200, again.text
            assert _health(cp)["status"] == "ok"
