"""The trash of the artifact sweep (control_plane.artifacts.sweep, whose docstring says why): a
file the sweep deletes is first moved to `trash/<hex>.<random>` inside the artifact root, put
back when the transaction rolls back or the file turns out to be a fresh upload (never over a
file that is there again), unlinked once the transaction commits, and trash left by a sweep that
crashed is put back or unlinked by the next one.

It decides nothing about which artifacts go, and must never unlink trash before the transaction
that deletes its row has committed.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import event, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, SessionTransaction

from control_plane.artifacts.store import DIGEST_PREFIX, ArtifactStore, record_artifact
from control_plane.clock import Clock
from control_plane.models import Artifact

#: The sweep's logger: what settling its trash says is the sweep's news.
log = logging.getLogger("control_plane.artifacts.sweep")

#: `<hex>.<random>`: a file moved aside by a sweep.
_TRASHED = re.compile(r"^([0-9a-f]{64})\.[0-9a-f]+$")


class Trash:
    """Files moved aside by one sweep: unlinked once its transaction commits, put back if it
    rolls back. In a dry run nothing moves: `take` only looks."""

    def __init__(self, store: ArtifactStore, *, dry_run: bool) -> None:
        self.store = store
        self.dry_run = dry_run
        self.directory = store.root / "trash"
        self.moved: dict[str, Path] = {}

    def take(self, path: Path) -> tuple[datetime | None, bool]:
        """Move `path` aside; its modification time read *after* the move (an upload that
        replaced it just before is seen), and whether it existed."""
        if self.dry_run or not path.is_file():
            return modified_at(path), path.is_file()
        self.directory.mkdir(mode=0o700, exist_ok=True)
        aside = self.directory / f"{path.name}.{secrets.token_hex(6)}"
        try:
            os.replace(path, aside)
        except FileNotFoundError:
            return None, False
        self.moved[DIGEST_PREFIX + path.name] = aside
        return modified_at(aside), True

    def put_back(self, digest: str) -> None:
        aside = self.moved.pop(digest, None)
        if aside is not None:
            _restore(aside, self.store.path_for(digest))

    def settle_with(self, session: Session, *, clock: Clock, deleted: list[str]) -> None:
        """Unlink the trash when `session`'s transaction commits, put it back when it does not;
        `deleted` (filled in later) names the rows the transaction deletes."""
        session.connection()  # begins the transaction if nothing did yet: `root` is its end
        root = session.get_transaction()
        bind = session.get_bind()
        state = {"committed": False, "settled": False}

        def committed(_session: Session) -> None:
            state["committed"] = True

        def ended(_session: Session, transaction: SessionTransaction) -> None:
            if transaction is not root or state["settled"]:
                return
            state["settled"] = True
            try:
                if state["committed"]:
                    with Session(bind) as fresh:
                        self._finish(fresh, clock=clock, deleted=deleted)
                else:
                    for digest in list(self.moved):
                        self.put_back(digest)
            except Exception:  # never turn a commit, or a rollback, into a failure
                log.exception("artifact sweep: the trash could not be settled")

        # Left registered: the session lives for one request or one round of the loop.
        event.listen(session, "after_commit", committed)
        event.listen(session, "after_transaction_end", ended)

    def _finish(self, session: Session, *, clock: Clock, deleted: list[str]) -> None:
        for aside in self.moved.values():
            aside.unlink(missing_ok=True)
        self.moved.clear()
        # An upload that landed after the move and recorded before the commit saw the old row
        # and inserted nothing: its file is back, so its row must be too.
        back = [digest for digest in deleted if self.store.exists(digest)]
        for digest in back:
            size = self.store.path_for(digest).stat().st_size
            try:
                with session.begin():
                    record_artifact(session=session, clock=clock, digest=digest, size=size)
            except IntegrityError:
                pass  # the upload recorded it itself
            log.info("artifact sweep: %s was uploaded again while it was swept; kept", digest)


def resolve_leftover_trash(session: Session, store: ArtifactStore, *, chunk_size: int) -> None:
    """Trash left by a sweep that crashed before settling it: put back where the row still
    exists (the transaction did not commit), unlinked where it does not."""
    directory = store.root / "trash"
    if not directory.is_dir():
        return
    leftovers = sorted(path for path in directory.iterdir() if _TRASHED.match(path.name))
    for start in range(0, len(leftovers), chunk_size):
        chunk = leftovers[start : start + chunk_size]
        digests = {DIGEST_PREFIX + path.name[:64] for path in chunk}
        rows = set(session.scalars(select(Artifact.digest).where(Artifact.digest.in_(digests))))
        for path in chunk:
            digest = DIGEST_PREFIX + path.name[:64]
            if digest in rows:
                _restore(path, store.path_for(digest))
            else:
                path.unlink(missing_ok=True)


def _restore(aside: Path, path: Path) -> None:
    """Put `aside` back at `path` unless a file is there again (a newer upload of the same
    content, whose modification time must not be replaced by the older one's)."""
    try:
        os.link(aside, path)
    except FileExistsError:
        pass
    except FileNotFoundError:
        return  # settled already (a concurrent sweep resolving leftovers)
    aside.unlink(missing_ok=True)


def modified_at(path: Path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, UTC)
    except FileNotFoundError:
        return None
