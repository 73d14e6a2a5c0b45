"""The node's artifact cache: files named by digest, size-bounded, least recently used evicted
first. Storage only — it never talks to the network: a download streams into the partial file
the cache hands out (resuming where it stopped), and is verified against its digest before it
becomes visible. Content produced on the node is hashed as it is stored.

A file name comes only from a checked digest (node_agent.digests): a value with slashes or `..`
is refused with `InvalidDigest` before any path is built, so nothing outside the cache is ever
resolved, touched or written.

Model weights and job data are nobody else's to read: the cache's directories are 0700 and its
files 0600, whatever the umask, and a cache left wider by an older agent is tightened when the
agent starts. The runtime worker reads them as the same user (Compose runs both as 10001). Where
it runs as a user of its own (bare metal, full separation: docs/nodes.md), the agent is given
the group they share (`MODELFORGE_AGENT_SOCKET_GROUP`), and the cache is 0750/0640 for that
group instead: readable by the worker, by no other user."""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from node_agent.digests import digest_hex

log = logging.getLogger(__name__)
_CHUNK = 1024 * 1024


class ArtifactError(Exception):
    """An artifact could not be fetched or stored; the message names the digest."""


class ArtifactCache:
    def __init__(self, root: Path, max_bytes: int, *, group: int | None = None) -> None:
        """`group`: the group (an id) that may read the cache besides its owner; None: nobody."""
        self.root = root
        self.max_bytes = max_bytes
        self.group = group
        self.dir_mode = 0o700 if group is None else 0o750
        self.file_mode = 0o600 if group is None else 0o640
        self._partial = root / ".partial"
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def prepare(self) -> None:
        """At the agent's start: the cache's directories and files at its modes (and group),
        created so, or narrowed (one WARNING line) where an older agent or the umask left them
        wider; `ArtifactError` if they are not the agent's to change."""
        changed = 0
        try:
            for directory in (self.root, self._partial):
                directory.mkdir(mode=self.dir_mode, parents=True, exist_ok=True)
                changed += self._own(directory, self.dir_mode)
                for path in directory.iterdir():
                    if path.is_file() and not path.is_symlink():
                        changed += self._own(path, self.file_mode)
        except PermissionError as exc:
            raise ArtifactError(
                f"artifact cache {self.root}: cannot set the mode of {exc.filename} "
                f"({exc.strerror}); the cache must belong to the agent's user"
            ) from None
        if changed:
            log.warning(
                "artifact cache %s: %d files and directories were not private; "
                "tightened to %o (directories) and %o (files)%s",
                self.root,
                changed,
                self.dir_mode,
                self.file_mode,
                "" if self.group is None else f" for group {self.group}",
            )

    def _own(self, path: Path, mode: int) -> int:
        """Give `path` the cache's group and `mode`; 1 if that changed anything, else 0."""
        info = path.lstat()
        changed = 0
        if self.group is not None and info.st_gid != self.group:
            os.chown(path, -1, self.group, follow_symlinks=False)
            changed = 1
        if stat.S_IMODE(info.st_mode) != mode:
            path.chmod(mode)
            changed = 1
        return changed

    def _private_dirs(self) -> None:
        for directory in (self.root, self._partial):
            if not directory.is_dir():
                directory.mkdir(mode=self.dir_mode, parents=True, exist_ok=True)
                self._own(directory, self.dir_mode)  # the umask may have narrowed the group's

    def _private_file(self, path: Path) -> None:
        """`path` exists with the cache's file mode before anything is written into it (an
        existing one, a download to resume, keeps its content)."""
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, self.file_mode))
        self._own(path, self.file_mode)

    def _lock(self, digest: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(digest, threading.Lock())

    def path(self, digest: str) -> Path:
        """Where `digest` lives in the cache; `InvalidDigest` unless it is one."""
        return self.root / digest_hex(digest)

    def fetch(self, digest: str, download: Callable[[str, Path], None]) -> Path:
        """The local path of `digest`; on a miss `download(digest, partial)` fills `partial`,
        appending to what an interrupted download left there."""
        target = self.path(digest)  # checks the digest before anything else
        with self._lock(digest):
            if target.is_file():
                os.utime(target)  # most recently used
                return target
            self._private_dirs()
            partial = self._partial / target.name
            self._private_file(partial)
            download(digest, partial)
            found = _sha256(partial)
            if found != digest:
                partial.unlink(missing_ok=True)
                raise ArtifactError(f"downloaded {digest} but the content hashes to {found}")
            os.replace(partial, target)
        self.evict(keep=target)
        return target

    def store(self, chunks: Iterable[bytes]) -> tuple[str, Path]:
        """Put content produced on this node into the cache; returns (digest, path)."""
        self._private_dirs()
        tmp = self._partial / f"upload-{secrets.token_hex(8)}"
        hasher = hashlib.sha256()
        try:
            self._private_file(tmp)
            with tmp.open("wb") as handle:
                for chunk in chunks:
                    hasher.update(chunk)
                    handle.write(chunk)
            digest = "sha256:" + hasher.hexdigest()
            target = self.path(digest)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        self.evict(keep=target)
        return digest, target

    def evict(self, keep: Path | None = None) -> None:
        """Remove least recently used files until the cache fits its bound."""
        files = [p for p in self.root.iterdir() if p.is_file()] if self.root.exists() else []
        total = sum(p.stat().st_size for p in files)
        for path in sorted(files, key=lambda p: p.stat().st_mtime):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            total -= path.stat().st_size
            path.unlink(missing_ok=True)
            log.info("artifact cache over %d bytes: evicted %s", self.max_bytes, path.name)


def _sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    return "sha256:" + hasher.hexdigest()
