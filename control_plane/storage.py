"""The control plane's own storage: how much room its data dir has left (for `/api/v1/health`),
and whether an error is a write refused for want of room (answered `507 STORAGE_FULL`).

It measures and classifies; it never deletes anything to make room (the artifact sweep does,
by its own rules) and never names a path in what it reports.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

#: File system errors of a write that found no room: the device, or the user's quota, is full.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: PostgreSQL's `disk_full`: the database server's storage, not this host's.
_POSTGRES_DISK_FULL = "53100"


def is_storage_full(error: BaseException) -> bool:
    """Whether `error` (or what it was raised from, a few links deep) is a write refused for want
    of room: ENOSPC or EDQUOT from the file system, SQLite's SQLITE_FULL ("database or disk is
    full"), or PostgreSQL's disk_full.

    Only `raise ... from` links count (`__cause__`, as `db._outage_reason` follows them), never
    the error that was being handled when `error` was raised (`__context__`): another failure
    while handling a full disk (a bug in the cleanup) is that failure, a 500, not a 507."""
    seen: BaseException | None = error
    for _ in range(5):
        if seen is None:
            return False
        if _is_full(seen) or _is_full(getattr(seen, "orig", None)):  # SQLAlchemy's wrapper
            return True
        seen = seen.__cause__
    return False


def _is_full(error: BaseException | None) -> bool:
    if isinstance(error, OSError):
        return error.errno in _FULL_ERRNOS
    if isinstance(error, sqlite3.Error):
        return getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or (
            "database or disk is full" in str(error).lower()
        )
    return getattr(error, "sqlstate", None) == _POSTGRES_DISK_FULL


StorageStatus = Literal["ok", "low"]


@dataclass(frozen=True)
class StorageRoom:
    """The room left where the control plane writes: the least of its data dir's file systems
    (the artifacts may live on a volume of their own)."""

    free_bytes: int
    total_bytes: int
    low_below_bytes: int

    @property
    def status(self) -> StorageStatus:
        return "low" if self.free_bytes < self.low_below_bytes else "ok"


def measure_room(directories: list[Path], *, low_below_bytes: int) -> StorageRoom:
    """The file system with the least room among those holding `directories` (one that does
    not exist yet is measured at its nearest existing parent)."""
    rooms = []
    for directory in directories:
        existing = directory
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        stats = os.statvfs(existing)
        # f_bavail: what an unprivileged writer may still use (root's reserve left out).
        rooms.append((stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize))
    free, total = min(rooms)
    return StorageRoom(free_bytes=free, total_bytes=total, low_below_bytes=low_below_bytes)
