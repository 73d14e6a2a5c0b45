"""Content-addressed artifact store in `<data dir>/artifacts`: files named by their
SHA-256, written through a temporary file and renamed only after the digest was verified."""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.errors import InvalidRequest, NotFound, StorageFull
from control_plane.models import Artifact, ArtifactUpload, Job, Service, ServiceReplica
from control_plane.storage import is_storage_full

log = logging.getLogger(__name__)
DIGEST_PREFIX = "sha256:"
#: A node may still fetch the inputs of a job that finished this recently (a download resumed
#: after the job ended, a job being wound down).
RECENT_JOB_WINDOW = timedelta(hours=1)
_DIR_MODE = 0o700
_FILE_MODE = 0o600


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
        _private_dirs(self._tmp)
        tmp = self._tmp / f"upload-{secrets.token_hex(8)}"
        hasher, size = hashlib.sha256(), 0
        try:
            # Owner-only whatever the umask: job inputs and results are nobody else's to read.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
            with os.fdopen(fd, "wb") as handle:
                async for chunk in chunks:
                    hasher.update(chunk)
                    handle.write(chunk)
                    size += len(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            digest = DIGEST_PREFIX + hasher.hexdigest()
            if expected is not None and digest != expected:
                raise InvalidRequest(
                    "The uploaded content does not hash to the digest it was sent for.",
                    "Upload the file again; it was corrupted or truncated on the way.",
                    code="ARTIFACT_DIGEST_MISMATCH",
                )
            target = self.path_for(digest)
            _private_dirs(target.parent)
            os.replace(tmp, target)
            return digest, size
        except OSError as exc:
            if not is_storage_full(exc):
                raise
            log.warning("artifact upload refused: the artifact store is full (%s)", exc.strerror)
            raise StorageFull() from None
        finally:
            tmp.unlink(missing_ok=True)  # nothing partial is left behind


def _private_dirs(directory: Path) -> None:
    """`directory` and any missing parents, each created 0700 (`mkdir(parents=True)` would give
    the parents the umask's default mode)."""
    if directory.is_dir():
        return
    _private_dirs(directory.parent)
    directory.mkdir(mode=_DIR_MODE, exist_ok=True)


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
            "No artifact with this digest.",
            "Upload it first (POST /api/v1/artifacts).",
            code="ARTIFACT_NOT_FOUND",
        )
    return artifact


def record_upload(
    *, session: Session, clock: Clock, digest: str, size: int, node_id: str
) -> Artifact:
    """An artifact a node uploaded: recorded, and remembered as that node's to download."""
    artifact = record_artifact(session=session, clock=clock, digest=digest, size=size)
    if session.get(ArtifactUpload, (digest, node_id)) is None:
        try:
            with session.begin_nested():  # the same node uploading it twice at once
                session.add(ArtifactUpload(digest=digest, node_id=node_id, uploaded_at=clock.now()))
        except IntegrityError:
            pass
    return artifact


def get_artifact_for_node(
    *, session: Session, store: ArtifactStore, clock: Clock, digest: str, node_id: str
) -> Artifact:
    """An artifact this node may download: one it uploaded itself, or one named as an input
    (or model) by a job assigned to it that is running or finished within RECENT_JOB_WINDOW.
    Anything else is answered exactly like a digest that does not exist, so that a node
    learns nothing about other nodes' artifacts."""
    artifact = session.get(Artifact, digest)
    if (
        artifact is None
        or not store.exists(digest)
        or not (
            session.get(ArtifactUpload, (digest, node_id)) is not None
            or _named_by_jobs_of(session, clock=clock, digest=digest, node_id=node_id)
        )
    ):
        raise NotFound(
            "No artifact with this digest for this node.",
            "A node fetches only artifacts that its own jobs name as inputs, or that it uploaded; "
            "check the job's inputs, and that the artifact was uploaded (POST /api/v1/artifacts).",
            code="ARTIFACT_NOT_FOUND",
        )
    return artifact


def _named_by_jobs_of(session: Session, *, clock: Clock, digest: str, node_id: str) -> bool:
    since = clock.now() - RECENT_JOB_WINDOW
    rows = session.execute(
        select(Job.inputs, Job.entrypoint).where(
            Job.node_id == node_id,
            or_(Job.state == "running", Job.finished_at >= since),
        )
    )
    for inputs, entrypoint in rows:
        if digest in (inputs or {}).values() or (entrypoint or {}).get("model") == digest:
            return True
    # The weights of a service with a replica placed on it (WL-5a, issue 27).
    service = session.execute(
        select(Service.id)
        .join(ServiceReplica, ServiceReplica.service_id == Service.id)
        .where(
            ServiceReplica.node_id == node_id,
            ServiceReplica.state != "stopped",
            Service.weights == digest,
        )
        .limit(1)
    ).first()
    return service is not None


def reference_artifacts(
    session: Session, digests: list[str], *, required: bool, named_by: str
) -> None:
    """Name `digests` from a row this transaction is about to write (a job's inputs, a model's
    or a service's weights): their artifact rows are locked `FOR SHARE` until the transaction
    ends, so the sweep (which locks `FOR UPDATE` the rows it would delete and only then reads
    the references) either sees the new reference or finished deleting first — then `required`
    digests are refused here as missing, and the rest are no longer there to be named.
    On SQLite, whose writers take turns, the write lock of the transaction does the same."""
    wanted = sorted({digest for digest in digests if digest})
    if not wanted:
        return
    found = set(
        session.scalars(
            select(Artifact.digest)
            .where(Artifact.digest.in_(wanted))
            .order_by(Artifact.digest)
            .with_for_update(read=True)
        )
    )
    missing = [digest for digest in wanted if digest not in found]
    if required and missing:
        raise NotFound(
            f"{named_by} names an artifact that does not exist: {missing[0]}.",
            "Upload it first (POST /api/v1/artifacts), or name a digest that "
            "GET /api/v1/artifacts lists.",
            code="ARTIFACT_NOT_FOUND",
        )
