"""Content-addressed artifact store in `<data dir>/artifacts`: files named by their
SHA-256, written through a temporary file and renamed only after the digest was verified."""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.errors import InvalidRequest, NotFound
from control_plane.models import Artifact

DIGEST_PREFIX = "sha256:"


class ArtifactStore:
    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir / "artifacts"
        self._tmp = self.root / "tmp"

    def path_for(self, digest: str) -> Path:
        hex_digest = digest.removeprefix(DIGEST_PREFIX)
        return self.root / "sha256" / hex_digest[:2] / hex_digest

    def exists(self, digest: str) -> bool:
        return self.path_for(digest).is_file()

    async def receive(
        self, chunks: AsyncIterator[bytes], *, expected: str | None
    ) -> tuple[str, int]:
        """Stream a body to disk; verify `expected` (if given) before it becomes visible."""
        self._tmp.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp / f"upload-{secrets.token_hex(8)}"
        hasher, size = hashlib.sha256(), 0
        try:
            with tmp.open("wb") as handle:
                async for chunk in chunks:
                    hasher.update(chunk)
                    handle.write(chunk)
                    size += len(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            digest = DIGEST_PREFIX + hasher.hexdigest()
            if expected is not None and digest != expected:
                raise InvalidRequest(
                    f"The uploaded content has digest {digest}, not {expected}.",
                    "Upload the file again; it was corrupted or truncated on the way.",
                    code="ARTIFACT_DIGEST_MISMATCH",
                )
            target = self.path_for(digest)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, target)
            return digest, size
        finally:
            tmp.unlink(missing_ok=True)


def record_artifact(*, session: Session, clock: Clock, digest: str, size: int) -> Artifact:
    artifact = session.get(Artifact, digest)
    if artifact is None:
        artifact = Artifact(digest=digest, size_bytes=size, created_at=clock.now())
        session.add(artifact)
        session.flush()
    return artifact


def get_artifact(*, session: Session, store: ArtifactStore, digest: str) -> Artifact:
    artifact = session.get(Artifact, digest)
    if artifact is None or not store.exists(digest):
        raise NotFound(
            f"No artifact {digest}.",
            "Upload it first (POST /api/v1/artifacts).",
            code="ARTIFACT_NOT_FOUND",
        )
    return artifact
