"""The node's artifact cache: files named by digest, size-bounded, least recently used evicted
first. Storage only — it never talks to the network: a download streams into the partial file
the cache hands out (resuming where it stopped), and is verified against its digest before it
becomes visible. Content produced on the node is hashed as it is stored.

A file name comes only from a checked digest (node_agent.digests): a value with slashes or `..`
is refused with `InvalidDigest` before any path is built, so nothing outside the cache is ever
resolved, touched or written."""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from node_agent.digests import digest_hex

log = logging.getLogger(__name__)
_CHUNK = 1024 * 1024


class ArtifactError(Exception):
    """An artifact could not be fetched or stored; the message names the digest."""


class ArtifactCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._partial = root / ".partial"
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

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
            self._partial.mkdir(parents=True, exist_ok=True)
            partial = self._partial / target.name
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
        self._partial.mkdir(parents=True, exist_ok=True)
        tmp = self._partial / f"upload-{secrets.token_hex(8)}"
        hasher = hashlib.sha256()
        try:
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
