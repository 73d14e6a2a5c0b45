"""Artifact lifetime (AR-3, AR-3a): who names each artifact, and the sweep that deletes the ones
nobody names once they are older than the grace period. It must never delete a digest that a
model, a deployed service (any state but `stopped`) or a queued or running job names — whoever
produced it, and whether or not the job that produced it still exists.

How the sweep never races a new reference
    Every writer that names a digest (job submission, model create, service deploy) locks its
    artifact rows `FOR SHARE` (`reference_artifacts`) in the transaction that writes the naming
    row. The sweep, in one transaction, first locks its candidates (rows older than the grace
    period) `FOR UPDATE SKIP LOCKED` in digest order, and only then reads the references, in a
    later statement (so, under READ COMMITTED, with a later snapshot). For each candidate: a
    writer that committed before the sweep's lock is seen by that read, and the digest is kept;
    a writer still holding its `FOR SHARE` lock makes the sweep skip the row, kept as "being named
    by a request in progress"; a writer that comes after the sweep's lock waits for the sweep to
    commit and then finds no row, so it refuses (`ARTIFACT_NOT_FOUND`) instead of naming a deleted
    digest. The sweep never waits on a writer, so it can never deadlock with one. On SQLite every
    transaction begins `IMMEDIATE`: the sweep and the writers run one after the other, with the
    same outcomes. Sweeps run one at a time (a PostgreSQL transaction-level advisory lock).

How the sweep never races an upload of the same digest
    An upload streams to `tmp/` and renames the verified file onto `sha256/xx/<hex>`, then
    records the row. The sweep removes a file by renaming it to `trash/<hex>.<random>` inside the
    artifact root (one file system: the rename is atomic) and only then reads the renamed file's
    modification time: an upload that landed before the rename left a fresh file there, which is
    put back and kept ("uploaded again … ago"). After the commit the trash is unlinked; if the
    transaction rolls back, the trash is put back (never over a file that is there again). An
    upload that lands after the rename creates a new file at the digest's path, which the sweep
    never touches again; its row is inserted by the upload if it records after the sweep
    commits, and otherwise (it saw the old row and inserted nothing) by the sweep, which after
    its commit records again every deleted digest whose file is back. Trash left by a crash is
    resolved by the next sweep: put back if the row still exists, unlinked if not. The trash
    itself (moving aside, putting back, unlinking, leftovers) is control_plane.artifacts._trash.

Files without a row older than the grace period (an upload that crashed between its rename and
its insert, or one killed while streaming to `tmp/`) are removed too, the same way. A dry run
decides the same way without locking, moving or deleting anything.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import and_, delete, or_, select, text
from sqlalchemy.orm import Session

from control_plane.artifacts._trash import Trash, modified_at, resolve_leftover_trash
from control_plane.artifacts.store import DIGEST_PREFIX, ArtifactStore
from control_plane.clock import Clock
from control_plane.errors import NotFound
from control_plane.models import Artifact, ArtifactUpload, Job, Model, Service

log = logging.getLogger(__name__)

#: Arbitrary but fixed key of the advisory lock that lets one sweep run at a time.
_SWEEP_LOCK_KEY = 0x4D46_0002
_ACTIVE_JOB_STATES = ("queued", "running")
_HEX = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 500
_IN_PROGRESS = "being named by a request in progress"


@dataclass(frozen=True)
class Reference:
    """One setting that names a digest: a model, a deployed service, a queued or running job."""

    kind: str
    id: str
    name: str | None = None
    state: str | None = None

    @property
    def reason(self) -> str:
        if self.kind == "model":
            return f"named by model {self.name}"
        if self.kind == "service":
            return f"named by service {self.name} ({self.id})"
        return f"named by {self.state} job {self.id}"


@dataclass(frozen=True)
class DeletedArtifact:
    digest: str
    size_bytes: int
    created_at: datetime


@dataclass(frozen=True)
class KeptArtifact:
    digest: str
    size_bytes: int
    reasons: list[str]


@dataclass(frozen=True)
class RemovedFile:
    """A file in the store without a row: `path` is relative to the artifact root."""

    path: str
    size_bytes: int
    modified_at: datetime


@dataclass
class SweepReport:
    dry_run: bool
    swept_at: datetime
    grace_seconds: float
    deleted: list[DeletedArtifact] = field(default_factory=list)
    kept: list[KeptArtifact] = field(default_factory=list)
    removed_files: list[RemovedFile] = field(default_factory=list)
    bytes_freed: int = 0


@dataclass(frozen=True)
class ListedArtifact:
    digest: str
    size_bytes: int
    created_at: datetime
    references: list[Reference]


def references(
    session: Session, *, among: Collection[str] | None = None
) -> dict[str, list[Reference]]:
    """Who names each digest (of `among`, or of all): three queries, whatever the store's size."""
    wanted = None if among is None else set(among)
    found: dict[str, list[Reference]] = defaultdict(list)

    def add(digest: Any, reference: Reference) -> None:
        if not isinstance(digest, str) or not digest.startswith(DIGEST_PREFIX):
            return
        if (wanted is None or digest in wanted) and reference not in found[digest]:
            found[digest].append(reference)

    models = select(Model.id, Model.name, Model.version, Model.weights).order_by(
        Model.name, Model.version
    )
    services = (
        select(Service.id, Service.name, Service.state, Service.weights)
        .where(Service.state != "stopped", Service.weights.is_not(None))
        .order_by(Service.name, Service.id)
    )
    if wanted is not None:
        models = models.where(Model.weights.in_(wanted))
        services = services.where(Service.weights.in_(wanted))
    for model_id, name, version, weights in session.execute(models):
        add(weights, Reference("model", model_id, f"{name}@{version}"))
    for service_id, service_name, state, service_weights in session.execute(services):
        add(service_weights, Reference("service", service_id, service_name, state))
    jobs = (
        select(Job.id, Job.state, Job.inputs, Job.entrypoint)
        .where(Job.state.in_(_ACTIVE_JOB_STATES))
        .order_by(Job.created_at, Job.id)
    )
    for job_id, state, inputs, entrypoint in session.execute(jobs):
        reference = Reference("job", job_id, None, state)
        for digest in (inputs or {}).values():
            add(digest, reference)
        if isinstance(entrypoint, dict):
            add(entrypoint.get("model"), reference)
    return dict(found)


def list_artifacts(*, session: Session, limit: int, before: str | None) -> list[ListedArtifact]:
    """Newest first, with their references; `before` (the last digest of the previous page)
    pages back."""
    query = (
        select(Artifact).order_by(Artifact.created_at.desc(), Artifact.digest.desc()).limit(limit)
    )
    if before is not None:
        cursor = session.get(Artifact, before)
        if cursor is None:
            raise NotFound(
                "The artifact named by `before` does not exist (any more).",
                "List again from the first page, without `before`.",
                code="ARTIFACT_NOT_FOUND",
            )
        query = query.where(
            or_(
                Artifact.created_at < cursor.created_at,
                and_(Artifact.created_at == cursor.created_at, Artifact.digest < cursor.digest),
            )
        )
    rows = list(session.scalars(query))
    named = references(session, among=[row.digest for row in rows])
    return [
        ListedArtifact(row.digest, row.size_bytes, row.created_at, named.get(row.digest, []))
        for row in rows
    ]


def sweep(
    *, session: Session, store: ArtifactStore, clock: Clock, grace: timedelta, dry_run: bool
) -> SweepReport:
    """Delete, in `session`'s transaction, every artifact older than `grace` that nothing names,
    and every file without a row older than `grace`; files go for good only once the
    transaction commits (see the module docstring). A dry run reports the same and changes
    nothing."""
    now = clock.now()
    cutoff = now - grace
    report = SweepReport(dry_run=dry_run, swept_at=now, grace_seconds=grace.total_seconds())
    trash = Trash(store, dry_run=dry_run)
    candidates = (
        select(Artifact.digest).where(Artifact.created_at < cutoff).order_by(Artifact.digest)
    )
    doomed: list[str] = []
    if not dry_run:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SWEEP_LOCK_KEY})
        resolve_leftover_trash(session, store, chunk_size=_CHUNK)
        # Before any file moves: whatever happens next, the transaction's end settles them.
        trash.settle_with(session, clock=clock, deleted=doomed)
        candidates = candidates.with_for_update(skip_locked=True)
    deletable = set(session.scalars(candidates))
    # Only now, after the lock: a reference committed by a writer that held a row is seen.
    named = references(session)
    rows = session.execute(
        select(Artifact.digest, Artifact.size_bytes, Artifact.created_at).order_by(
            Artifact.created_at.desc(), Artifact.digest
        )
    ).all()
    for digest, size, created_at in rows:
        reasons = [reference.reason for reference in named.get(digest, [])]
        if created_at >= cutoff:
            reasons.append(f"younger than the grace period ({_duration(created_at - cutoff)} left)")
        elif digest not in deletable:
            reasons.append(_IN_PROGRESS)
        if not reasons:
            modified, existed = trash.take(store.path_for(digest))
            if modified is not None and modified >= cutoff:
                trash.put_back(digest)
                reasons.append(
                    f"uploaded again {_duration(now - modified)} ago: within the grace period "
                    f"({_duration(modified - cutoff)} left)"
                )
            else:
                doomed.append(digest)
                report.deleted.append(DeletedArtifact(digest, size, created_at))
                report.bytes_freed += size if existed else 0
                continue
        report.kept.append(KeptArtifact(digest, size, reasons))
    known = {row.digest for row in rows}
    for removed in _stray_files(store, trash, known=known, cutoff=cutoff):
        report.removed_files.append(removed)
        report.bytes_freed += removed.size_bytes
    if dry_run:
        return report
    for start in range(0, len(doomed), _CHUNK):
        chunk = doomed[start : start + _CHUNK]
        session.execute(delete(ArtifactUpload).where(ArtifactUpload.digest.in_(chunk)))
        session.execute(delete(Artifact).where(Artifact.digest.in_(chunk)))
    return report


def _stray_files(
    store: ArtifactStore, trash: Trash, *, known: set[str], cutoff: datetime
) -> Iterator[RemovedFile]:
    """Files without a row, last written before `cutoff`: in `sha256/` (an upload that crashed
    between its rename and its insert) and in `tmp/` (one killed while streaming)."""
    for directory in sorted((store.root / "sha256").glob("??")):
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            digest = DIGEST_PREFIX + path.name
            misplaced = path.name[:2] != directory.name
            if misplaced or not _HEX.match(path.name) or digest in known or not path.is_file():
                continue
            size = _size(path)
            modified, _ = trash.take(path)
            if modified is None:
                continue
            if modified >= cutoff:
                trash.put_back(digest)
                continue
            if not trash.dry_run:
                trash.moved.pop(digest).unlink(missing_ok=True)  # no row: nothing to roll back
            yield RemovedFile(str(path.relative_to(store.root)), size, modified)
    for path in sorted((store.root / "tmp").glob("upload-*")):
        modified = modified_at(path)
        if modified is None or modified >= cutoff:
            continue
        size = _size(path)
        if not trash.dry_run:
            path.unlink(missing_ok=True)
        yield RemovedFile(str(path.relative_to(store.root)), size, modified)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _duration(span: timedelta) -> str:
    """`2 d 3 h`, `23 h 59 min`, `5 min`, `40 s`: the two largest units."""
    seconds = max(0, int(span.total_seconds()))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "min"), (seconds, "s")]
    while len(parts) > 1 and parts[0][0] == 0:
        parts.pop(0)
    return " ".join(f"{value} {unit}" for value, unit in parts[:2] if value) or "0 s"
