"""The artifact cache on the node with the agent's client, against a real control plane over
HTTP: downloads verified by digest and resumed with HTTP ranges; uploads verified by the control
plane; the cache bounded by size, least recently used evicted first."""

from __future__ import annotations

import hashlib
import os
import time
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
