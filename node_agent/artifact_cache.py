"""The node's artifact cache (AR-1, AR-2): files named by digest, size-bounded, oldest evicted
first. Downloads resume where they stopped (HTTP range) and are verified against their digest
before they become visible; uploads are hashed on the node and verified again by the control
plane."""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
from collections.abc import Iterable
from pathlib import Path

import httpx

log = logging.getLogger(__name__)
_CHUNK = 1024 * 1024
_ATTEMPTS = 5


class ArtifactError(Exception):
    """An artifact could not be fetched or stored; the message names the digest."""


def _hex(digest: str) -> str:
    if not digest.startswith("sha256:") or len(digest) != 71:
        raise ArtifactError(f"{digest!r} is not a sha256: digest")
    return digest.removeprefix("sha256:")


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
        return self.root / _hex(digest)

    def fetch(self, http: httpx.Client, credential: str, digest: str) -> Path:
        target = self.path(digest)
        with self._lock(digest):
            if target.is_file():
                os.utime(target)  # most recently used
                return target
            self._partial.mkdir(parents=True, exist_ok=True)
            partial = self._partial / _hex(digest)
            for attempt in range(1, _ATTEMPTS + 1):
                try:
                    self._download(http, credential, digest, partial)
                    break
                except httpx.TransportError as exc:
                    log.warning(
                        "%s on GET artifact %s (attempt %d, resuming at %d bytes)",
                        type(exc).__name__,
                        digest,
                        attempt,
                        partial.stat().st_size if partial.exists() else 0,
                    )
                    if attempt == _ATTEMPTS:
                        raise ArtifactError(
                            f"cannot download {digest}: {type(exc).__name__}"
                        ) from None
            found = _sha256(partial)
            if found != digest:
                partial.unlink(missing_ok=True)
                raise ArtifactError(f"downloaded {digest} but the content hashes to {found}")
            os.replace(partial, target)
        self.evict(keep=target)
        return target

    def _download(self, http: httpx.Client, credential: str, digest: str, partial: Path) -> None:
        offset = partial.stat().st_size if partial.exists() else 0
        headers = {"Authorization": f"Bearer {credential}"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        with http.stream(
            "GET",
            f"/api/v1/agent/artifacts/{digest}",
            headers=headers,
            timeout=httpx.Timeout(60.0, connect=10.0),
        ) as response:
            if response.status_code == 416:  # already complete
                return
            if response.status_code not in (200, 206):
                raise ArtifactError(f"HTTP {response.status_code} on GET artifact {digest}")
            mode = "ab" if response.status_code == 206 else "wb"
            with partial.open(mode) as handle:
                for chunk in response.iter_bytes(_CHUNK):
                    handle.write(chunk)

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

    def upload(self, http: httpx.Client, credential: str, digest: str) -> None:
        path = self.path(digest)

        def body() -> Iterable[bytes]:
            with path.open("rb") as handle:
                while chunk := handle.read(_CHUNK):
                    yield chunk

        response = http.put(
            f"/api/v1/agent/artifacts/{digest}",
            content=body(),
            headers={
                "Authorization": f"Bearer {credential}",
                "Content-Length": str(path.stat().st_size),
            },
            timeout=httpx.Timeout(300.0, connect=10.0),
        )
        if response.status_code >= 400:
            raise ArtifactError(f"HTTP {response.status_code} on PUT artifact {digest}")

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
