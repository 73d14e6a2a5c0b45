"""The images tar: the docker-archive format `docker image load` reads, written and checked here.

Layout: `manifest.json` ([{"Config", "RepoTags", "Layers"}]), one `<sha256 hex>.json` config per
image, and one `<diff_id hex>/layer.tar` per distinct layer, so a layer shared by several images
is stored once. The bytes are deterministic: fixed entry order, mtime and owners.

Reading never needs Docker and never trusts a name: every referenced layer entry is hashed again
(streaming, constant memory) and compared with the config's rootfs.diff_ids. This module must never
extract an entry to disk or load a layer into memory.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from release._tar import CHUNK, add_bytes, add_stream, canonical_json, open_writer, sha256_stream

if TYPE_CHECKING:
    from release.images import BuiltImage

MANIFEST = "manifest.json"
_MAX_JSON_BYTES = 16 << 20


class ArchiveError(Exception):
    """The images tar does not hold what it claims; the message names image, entry and field."""


@dataclass(frozen=True)
class ArchivedImage:
    tag: str
    config_digest: str
    diff_ids: tuple[str, ...]
    architecture: str
    os: str
    labels: dict[str, str]


def write_images_tar(images: Sequence[BuiltImage], path: Path) -> None:
    """Write all `images` into one docker-archive at `path` (atomically, via a `.partial` file).

    Each layer file is hashed while it is copied; one that no longer matches its diff_id stops
    the write with ArchiveError.
    """
    tags = Counter(image.tag for image in images)
    if duplicated := sorted(tag for tag, count in tags.items() if count > 1):
        raise ArchiveError(f"the same tag is given for several images: {duplicated}")
    mtime = max((_created(image.config_bytes) for image in images), default=0)
    layers: dict[str, Path] = {}
    configs: dict[str, bytes] = {}
    manifest = []
    for image in images:
        if len(image.layers) != len(image.diff_ids):
            raise ArchiveError(
                f"{image.tag}: {len(image.layers)} layer files for {len(image.diff_ids)} diff_ids"
            )
        config_name = image.config_digest.removeprefix("sha256:") + ".json"
        configs[config_name] = image.config_bytes
        for diff_id, layer in zip(image.diff_ids, image.layers, strict=True):
            layers.setdefault(diff_id, layer)
        manifest.append(
            {
                "Config": config_name,
                "RepoTags": [image.tag],
                "Layers": [_layer_name(diff_id) for diff_id in image.diff_ids],
            }
        )
    partial = path.with_name(path.name + ".partial")
    try:
        with open_writer(partial) as tar:
            add_bytes(tar, MANIFEST, canonical_json(manifest), mtime=mtime)
            for name, data in sorted(configs.items()):
                add_bytes(tar, name, data, mtime=mtime)
            for diff_id, layer in layers.items():
                with layer.open("rb") as stream:
                    reader = _HashingReader(stream)
                    add_stream(tar, _layer_name(diff_id), reader, layer.stat().st_size, mtime=mtime)
                if (found := "sha256:" + reader.digest.hexdigest()) != diff_id:
                    raise ArchiveError(
                        f"layer file {layer}: expected {diff_id}, found {found} (changed since "
                        "the build; build the images again)"
                    )
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def read_images_tar(
    path: Path,
    *,
    progress: Callable[[str], None] | None = None,
    entry_digests: Mapping[str, str] | None = None,
) -> list[ArchivedImage]:
    """Parse and check a docker-archive without Docker; every referenced layer is re-hashed.

    `entry_digests` (entry name -> digest, from `scan_tar`) saves that second read when the
    caller already streamed the whole file once.
    """
    try:
        with tarfile.open(path, mode="r:") as tar:
            return _check_archive(tar, path.name, progress, entry_digests or {})
    except (OSError, EOFError, tarfile.TarError) as exc:
        raise ArchiveError(f"{path.name}: not a readable tar archive ({exc})") from None


def _check_archive(
    tar: tarfile.TarFile,
    archive: str,
    progress: Callable[[str], None] | None,
    entry_digests: Mapping[str, str],
) -> list[ArchivedImage]:
    entries = tar.getmembers()  # headers only: the data stays in the file
    members = {member.name.removeprefix("./"): member for member in entries}
    counts = Counter(member.name.removeprefix("./") for member in entries)
    reader = _EntryReader(tar, members, counts, archive, entry_digests)
    manifest = reader.json(MANIFEST, what="manifest.json")
    if not isinstance(manifest, list) or not manifest:
        raise ArchiveError(f"{archive}: manifest.json is not a non-empty list of images")
    layer_digests: dict[str, str] = {}
    return [
        _check_image(reader, entry, position, layer_digests, progress)
        for position, entry in enumerate(manifest, start=1)
    ]


def _check_image(
    reader: _EntryReader,
    entry: Any,
    position: int,
    layer_digests: dict[str, str],
    progress: Callable[[str], None] | None,
) -> ArchivedImage:
    where = f"manifest.json image {position}"
    if not isinstance(entry, dict):
        raise ArchiveError(f"{where}: not an object")
    tags = entry.get("RepoTags")
    if not isinstance(tags, list) or not tags or not all(isinstance(t, str) for t in tags):
        raise ArchiveError(
            f"{where}: RepoTags expected a list with the image's tag, found {tags!r}"
        )
    tag = tags[0]
    config_name, layer_names = entry.get("Config"), entry.get("Layers")
    if not isinstance(config_name, str):
        raise ArchiveError(f"image {tag}: Config expected an entry name, found {config_name!r}")
    if not isinstance(layer_names, list) or not all(isinstance(n, str) for n in layer_names):
        raise ArchiveError(f"image {tag}: Layers expected a list of entries, found {layer_names!r}")
    raw = reader.read(config_name, what=f"image {tag}: config")
    config_digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    named = config_name.removeprefix("blobs/sha256/").removesuffix(".json")
    if len(named) == 64 and "sha256:" + named != config_digest:
        raise ArchiveError(
            f"image {tag}: config {config_name}: expected sha256:{named}, found {config_digest}"
        )
    config = _parse(raw, f"image {tag}: config {config_name}")
    rootfs = config.get("rootfs") if isinstance(config, dict) else None
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or not all(isinstance(d, str) for d in diff_ids):
        raise ArchiveError(f"image {tag}: config rootfs.diff_ids is missing or not a list")
    if len(layer_names) != len(diff_ids):
        raise ArchiveError(
            f"image {tag}: number of layers: config rootfs.diff_ids has {len(diff_ids)}, "
            f"manifest.json Layers lists {len(layer_names)}"
        )
    for index, (name, expected) in enumerate(zip(layer_names, diff_ids, strict=True), start=1):
        if name not in layer_digests:
            if progress is not None:
                progress(f"{tag}: hashing layer {index}/{len(diff_ids)} ({name})")
            layer_digests[name] = reader.digest(name, what=f"image {tag}: layer {index}")
        if layer_digests[name] != expected:
            raise ArchiveError(
                f"image {tag}: layer {index}/{len(diff_ids)} ({name}): diff_id expected "
                f"{expected}, found {layer_digests[name]}"
            )
    settings = config.get("config") or {}
    labels = (settings.get("Labels") or {}) if isinstance(settings, dict) else None
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise ArchiveError(f"image {tag}: config Labels is not a map of strings")
    fields = {key: config.get(key) for key in ("architecture", "os")}
    for key, value in fields.items():
        if not isinstance(value, str):
            raise ArchiveError(f"image {tag}: config {key} expected a string, found {value!r}")
    return ArchivedImage(
        tag=tag,
        config_digest=config_digest,
        diff_ids=tuple(diff_ids),
        architecture=str(fields["architecture"]),
        os=str(fields["os"]),
        labels=dict(labels),
    )


class _EntryReader:
    def __init__(
        self,
        tar: tarfile.TarFile,
        members: dict[str, tarfile.TarInfo],
        counts: Counter[str],
        archive: str,
        known_digests: Mapping[str, str],
    ) -> None:
        self.tar, self.members, self.counts, self.archive = tar, members, counts, archive
        self.known_digests = known_digests

    def _open(self, name: str, what: str) -> IO[bytes]:
        member = self.members.get(name.removeprefix("./"))
        if member is None or not member.isfile():
            raise ArchiveError(f"{what}: entry {name} is missing from {self.archive}")
        if self.counts[member.name.removeprefix("./")] > 1:
            raise ArchiveError(f"{what}: entry {name} appears more than once in {self.archive}")
        stream = self.tar.extractfile(member)
        if stream is None:
            raise ArchiveError(f"{what}: entry {name} cannot be read from {self.archive}")
        return stream

    def read(self, name: str, *, what: str) -> bytes:
        member = self.members.get(name.removeprefix("./"))
        if member is not None and member.size > _MAX_JSON_BYTES:
            raise ArchiveError(f"{what}: entry {name} is {member.size} bytes, too large for JSON")
        with self._open(name, what) as stream:
            return stream.read()

    def json(self, name: str, *, what: str) -> Any:
        return _parse(self.read(name, what=what), f"{self.archive}: {what}")

    def digest(self, name: str, *, what: str) -> str:
        with self._open(name, what) as stream:
            known = self.known_digests.get(name.removeprefix("./"))
            return known if known is not None else "sha256:" + sha256_stream(stream)


def scan_tar(
    path: Path, progress: Callable[[int, int], None] | None = None
) -> tuple[str, dict[str, str]]:
    """One streaming pass, constant memory: the SHA-256 of the whole file and of every entry.

    This is what lets `verify` check the bundle's checksum and every layer's diff_id while
    reading the (large) images tar only once.
    """
    total = path.stat().st_size
    whole = hashlib.sha256()
    done = 0

    class _Tee:
        def read(self, size: int = CHUNK) -> bytes:
            nonlocal done
            data = handle.read(size)
            whole.update(data)
            done += len(data)
            if progress is not None and data:
                progress(done, total)
            return data

    entries: dict[str, str] = {}
    with path.open("rb") as handle:
        try:
            with tarfile.open(fileobj=_Tee(), mode="r|", bufsize=CHUNK) as tar:  # type: ignore[call-overload]
                for member in tar:
                    stream = tar.extractfile(member) if member.isfile() else None
                    if stream is not None:
                        entries[member.name.removeprefix("./")] = "sha256:" + sha256_stream(stream)
        except (EOFError, tarfile.TarError) as exc:
            raise ArchiveError(f"{path.name}: not a readable tar archive ({exc})") from None
        tee = _Tee()
        while tee.read(CHUNK):  # end-of-archive padding counts for the file's checksum
            pass
    if progress is not None:
        progress(total, total)
    return "sha256:" + whole.hexdigest(), entries


class _HashingReader:
    """Passes reads through and hashes them, so a layer is hashed while it is copied."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream, self.digest = stream, hashlib.sha256()

    def read(self, size: int = CHUNK) -> bytes:
        data = self.stream.read(size)
        self.digest.update(data)
        return data


def _parse(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ArchiveError(f"{what} is not valid JSON ({exc})") from None


def _layer_name(diff_id: str) -> str:
    return f"{diff_id.removeprefix('sha256:')}/layer.tar"


def _created(config: bytes) -> int:
    try:
        created = json.loads(config)["created"]
        return int(datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp())
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0
