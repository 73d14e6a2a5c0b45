"""The artifact cache on the node with the agent's client, against a real control plane over
HTTP: downloads verified by digest and resumed with HTTP ranges; uploads verified by the control
plane; the cache bounded by size, least recently used evicted first; its directories 0700 and
its files 0600 (0750/0640 for a group given), tightened at the agent's start."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from node_agent.artifact_cache import ArtifactCache, ArtifactError
from node_agent.digests import InvalidDigest
from node_agent.retry import ControlPlaneError
from tests.e2e.server import LiveServer
from tests.node_agent.conftest import control_plane_client


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_fetch_resume_upload_and_evict(tmp_path: Path) -> None:
    with (
        LiveServer(tmp_path / "cp", f"sqlite:///{tmp_path / 'cp.db'}") as server,
        server.client() as http,
        control_plane_client(server.url) as control_plane,
    ):
        control_plane.use_credential(server.enroll()["credential"])
        download = control_plane.download_artifact

        def upload(data: bytes) -> str:
            """Uploaded by this node, so that it may download it (a node fetches only what its
            jobs name or what it uploaded)."""
            source = tmp_path / "upload"
            source.write_bytes(data)
            control_plane.upload_artifact(_digest(data), source)
            return _digest(data)

        payload = os.urandom(300_000)
        digest = upload(payload)
        cache = ArtifactCache(tmp_path / "cache", max_bytes=700_000)

        # A download interrupted after 100 kB resumes from there (Range), then is verified.
        partial = tmp_path / "cache" / ".partial" / digest.removeprefix("sha256:")
        partial.parent.mkdir(parents=True)
        partial.write_bytes(payload[:100_000])
        path = cache.fetch(digest, download)
        assert path.read_bytes() == payload and not partial.exists()

        # A corrupt partial file is caught by the digest check and never becomes visible.
        other_digest = upload(os.urandom(50_000))
        partial.with_name(other_digest.removeprefix("sha256:")).write_bytes(b"garbage!" * 10)
        with pytest.raises(ArtifactError, match="hashes to"):
            cache.fetch(other_digest, download)
        assert not cache.path(other_digest).exists()

        # Produced on the node: stored by digest, uploaded, verified by the control plane.
        made = os.urandom(250_000)
        made_digest, made_path = cache.store([made[:1000], made[1000:]])
        assert made_digest == _digest(made)
        control_plane.upload_artifact(made_digest, made_path)
        assert http.get(f"/api/v1/artifacts/{made_digest}", headers=server.admin).content == made

        # Over the bound (700 kB): the least recently used file goes first.
        os.utime(cache.path(made_digest), (time.time() - 100, time.time() - 100))
        third, _ = cache.store([os.urandom(200_000)])
        assert not cache.path(made_digest).exists()
        assert cache.path(digest).exists() and cache.path(third).exists()

        # Unknown to the control plane: its refusal, naming method and path, reaches the caller.
        unknown = _digest(b"never uploaded")
        with pytest.raises(
            ControlPlaneError, match=f"HTTP 404 .* on GET /api/v1/agent/artifacts/{unknown}"
        ):
            cache.fetch(unknown, download)
        assert not cache.path(unknown).exists()


@pytest.mark.parametrize(
    "digest",
    [
        "md5:abc",
        "sha256:" + "../" * 21 + "x",  # the right length, but a path
        "sha256:" + "a" * 60 + "/../",
        "sha256:" + "A" * 64,  # hex, not lowercase
        "sha256:" + "a" * 63 + "\n",
        "sha256:" + "a" * 65,
        "sha256:" + "g" * 64,
    ],
)
def test_anything_but_a_sha256_digest_is_refused(tmp_path: Path, digest: str) -> None:
    cache = ArtifactCache(tmp_path / "cache", max_bytes=10)
    victim = tmp_path / "victim"
    victim.write_text("x")
    asked: list[str] = []
    with pytest.raises(InvalidDigest, match="64 lowercase hex"):
        cache.path(digest)
    with pytest.raises(InvalidDigest):
        cache.fetch(digest, lambda d, _partial: asked.append(d))
    assert asked == []
    assert not (tmp_path / "cache").exists()  # nothing created, nothing touched


# -- modes -------------------------------------------------------------------------------------


def _modes(root: Path) -> dict[str, int]:
    """Each path under `root` (itself included, as `.`) and its permission bits."""
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return found


@contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def test_the_cache_is_private_whatever_the_umask(tmp_path: Path) -> None:
    with (
        _umask(0o022),
        LiveServer(tmp_path / "cp", f"sqlite:///{tmp_path / 'cp.db'}") as server,
        control_plane_client(server.url) as control_plane,
    ):
        control_plane.use_credential(server.enroll()["credential"])
        weights = os.urandom(100_000)
        source = tmp_path / "weights"
        source.write_bytes(weights)
        control_plane.upload_artifact(_digest(weights), source)
        cache = ArtifactCache(tmp_path / "cache", max_bytes=10_000_000)
        cache.prepare()
        fetched = cache.fetch(_digest(weights), control_plane.download_artifact)
        _, stored = cache.store([b"a result"])
        assert fetched.read_bytes() == weights and stored.read_bytes() == b"a result"
        assert _modes(tmp_path / "cache") == {
            ".": 0o700,
            ".partial": 0o700,
            fetched.name: 0o600,
            stored.name: 0o600,
        }


def test_a_cache_left_readable_is_tightened_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "cache"
    with _umask(0o022):  # as an older agent left it: 0755 and 0644
        (root / ".partial").mkdir(parents=True)
        (root / ("a" * 64)).write_bytes(b"weights")
        (root / ".partial" / ("b" * 64)).write_bytes(b"half a download")
    assert _modes(root)["a" * 64] == 0o644
    cache = ArtifactCache(root, max_bytes=10_000_000)
    with caplog.at_level(logging.WARNING, logger="node_agent.artifact_cache"):
        cache.prepare()
    assert set(_modes(root).values()) == {0o700, 0o600}
    assert _modes(root)["."] == 0o700 and _modes(root)["a" * 64] == 0o600
    assert [r.getMessage() for r in caplog.records] == [
        f"artifact cache {root}: 4 files and directories were not private; "
        "tightened to 700 (directories) and 600 (files)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="node_agent.artifact_cache"):
        cache.prepare()  # already private: nothing to say
    assert caplog.records == []


def _read_as(uid: int, groups: list[int], path: Path) -> int:
    """The exit status of `cat path` run as `uid` with `groups`: 0 when it could read it."""
    return subprocess.run(
        ["cat", str(path)],
        user=uid,
        group=groups[0] if groups else uid,
        extra_groups=groups,
        capture_output=True,
        check=False,
    ).returncode


def test_with_a_group_the_worker_of_another_user_reads_it_and_nobody_else(
    tmp_path: Path,
) -> None:
    """Bare metal with full separation (docs/nodes.md): the worker runs as a user of its own in
    the group the agent is given; any other user is kept out. Run as root, the test reads as
    two unprivileged users (65533 in the group, 65532 not)."""
    group = 65531
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is root's alone
    try:
        base.chmod(0o711)
        with _umask(0o077):  # narrower than the group's modes: they are set anyway
            cache = ArtifactCache(base / "cache", max_bytes=10_000_000, group=group)
            cache.prepare()
            _, stored = cache.store([b"model weights"])
        assert _modes(base / "cache") == {".": 0o750, ".partial": 0o750, stored.name: 0o640}
        assert stored.stat().st_gid == group and (base / "cache").stat().st_gid == group
        assert _read_as(65533, [group], stored) == 0
        assert _read_as(65532, [65532], stored) != 0
    finally:
        shutil.rmtree(base)
