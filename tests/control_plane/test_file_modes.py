"""The data dir is owner-only whatever the umask: the directory and every directory in it 0700,
every file (the SQLite database and its -wal/-shm, the signing key, the generated admin token,
artifacts, the migration lock) 0600. Checked after a real run: enroll, an artifact upload and a
console session, against the real `modelforge-control-plane` (Granian) and in-process."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import LiveServer
from tests.factories import ADMIN_TOKEN, control_plane

_EXPECTED = {"dir": 0o700, "file": 0o600}


@contextmanager
def _umask(mask: int) -> Iterator[None]:
    """The process umask while the block runs; a child process started inside inherits it."""
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def _modes(data_dir: Path) -> dict[str, str]:
    """Everything under `data_dir` (itself included) whose mode is not the owner-only one."""
    wrong: dict[str, str] = {}
    entries = [data_dir]
    for root, dirs, files in os.walk(data_dir):
        entries += [Path(root, name) for name in dirs + files]
    for path in entries:
        info = path.lstat()
        kind = "dir" if stat.S_ISDIR(info.st_mode) else "file"
        mode = stat.S_IMODE(info.st_mode)
        if mode != _EXPECTED[kind]:
            wrong[str(path.relative_to(data_dir.parent))] = f"{kind} {mode:o}"
    return wrong


def _names(data_dir: Path) -> set[str]:
    return {p.name for p in data_dir.rglob("*")}


def _exercise(client: httpx.Client, admin_token: str) -> None:
    """Enroll a node, upload an artifact, sign in to the console and act in it."""
    admin = {"X-ModelForge-Admin-Token": admin_token}
    minted = client.post(
        "/api/v1/admin/node-enrollments",
        headers=admin,
        json={"display_name": "modes", "expires_in_seconds": 900},
    )
    assert minted.status_code == 201, minted.text
    enrolled = client.post(
        "/api/v1/agent/enroll",
        json={
            "token": minted.json()["token"],
            "claim_nonce": secrets.token_hex(16),
            "hostname": "modes-host",
            "protocol_version": 1,
            "agent_version": "0.1.0",
        },
    )
    assert enrolled.status_code == 200, enrolled.text
    uploaded = client.post("/api/v1/artifacts", headers=admin, content=os.urandom(4096))
    assert uploaded.status_code == 201, uploaded.text
    signed_in = client.post("/api/v1/console/session", json={"admin_token": admin_token})
    assert signed_in.status_code == 201, signed_in.text
    nodes = client.get("/api/v1/admin/nodes")  # with the session cookie only
    assert nodes.status_code == 200, nodes.text


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("umask", "existing_mode"),
    [(0o022, None), (0o002, 0o775)],
    ids=["umask-022-new-dir", "umask-002-existing-0775-dir"],
)
def test_served_data_dir_is_owner_only(
    tmp_path: Path, umask: int, existing_mode: int | None
) -> None:
    data_dir = tmp_path / "data"
    if existing_mode is not None:
        data_dir.mkdir()
        data_dir.chmod(existing_mode)
    # The default database (SQLite in the data dir) and a generated admin token file: empty
    # settings count as unset.
    server = LiveServer(data_dir, "", env_overrides={"MODELFORGE_ADMIN_TOKEN": ""})
    with _umask(umask):
        server.start()
    try:
        admin_token = (data_dir / "admin-token").read_text().strip()
        with server.client() as client:
            _exercise(client, admin_token)
        names = _names(data_dir)
        assert {"modelforge.db", "modelforge.db-wal", "modelforge.db-shm"} <= names
        assert {"signing-key.pem", "admin-token", "migrate.lock"} <= names
        assert any(len(name) == 64 for name in names), names  # the artifact
        assert _modes(data_dir) == {}
    finally:
        server.stop()
    assert _modes(data_dir) == {}
    tightened = [line for line in server.log().splitlines() if "tightened to 0700" in line]
    assert len(tightened) == (0 if existing_mode is None else 1), tightened


def test_in_process_data_dir_is_owner_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    data_dir.chmod(0o777)
    # No umask at all: every mode below is the control plane's own choice.
    with _umask(0o000), control_plane(data_dir, f"sqlite:///{data_dir / 'cp.db'}") as cp:
        _exercise(cp.client, ADMIN_TOKEN)
        assert {"cp.db", "cp.db-wal", "cp.db-shm", "signing-key.pem"} <= _names(data_dir)
        assert _modes(data_dir) == {}
    tightened = [r for r in caplog.records if "tightened to 0700" in r.getMessage()]
    assert len(tightened) == 1
