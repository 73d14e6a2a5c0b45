"""The images tar: the docker-archive format `docker image load` reads, written and checked here.

Layout: `manifest.json` ([{"Config", "RepoTags", "Layers"}]), one `<sha256 hex>.json` config per
image, and one `<diff_id hex>/layer.tar` per distinct layer, so a layer shared by several images
is stored once. The bytes are deterministic: fixed entry order, mtime and owners.

Reading never needs Docker and never trusts a name: names are resolved as the engine resolves
them (`release._entries`), every referenced layer entry is hashed again (streaming, constant
memory) and compared with the config's rootfs.diff_ids, and an entry manifest.json does not
reference refuses the tar. This module must never extract an entry to disk or load a layer or
an oversized JSON entry into memory.
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

from modelforge_contracts.release_manifest import ManifestError, parse_json
from release._entries import EntryError, EntryIndex, check_end, clean, resolve
from release._tar import CHUNK, add_bytes, add_stream, canonical_json, open_writer, sha256_stream

if TYPE_CHECKING:
    from release.images import BuiltImage

MANIFEST = "manifest.json"
_MAX_JSON_BYTES = 4 << 20


class ArchiveError(Exception):
    """The images tar does not hold what it claims; the message names image, entry and field."""


@dataclass(frozen=True)
class ArchivedImage:
    repo_tags: tuple[str, ...]
    config_digest: str
    diff_ids: tuple[str, ...]
    architecture: str
    os: str
    labels: dict[str, str]

    @property
    def tag(self) -> str:
        """The first of RepoTags: the name `docker image load` gives the image first."""
        return self.repo_tags[0]


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

    Names are resolved as `docker image load` resolves them (`release._entries`); an entry the
    engine could read but this check would not (a duplicate after cleaning, a link, a device,
    anything manifest.json does not reference, data after the end) refuses the whole tar.
    `entry_digests` (cleaned entry name -> digest, from `scan_tar`) saves the second read of the
    layers when the caller already streamed the whole file once.
    """
    try:
        with tarfile.open(path, mode="r:") as tar:
            index = EntryIndex(path.name)
            index.add_all(tar.getmembers())  # headers only: the data stays in the file
            check_end(path, tar.offset, path.name)
            return _check_archive(tar, index, progress, entry_digests or {})
    except EntryError as exc:
        raise ArchiveError(str(exc)) from None
    except (OSError, EOFError, tarfile.TarError) as exc:
        raise ArchiveError(f"{path.name}: not a readable tar archive ({exc})") from None


def _check_archive(
    tar: tarfile.TarFile,
    index: EntryIndex,
    progress: Callable[[str], None] | None,
    entry_digests: Mapping[str, str],
) -> list[ArchivedImage]:
    archive = index.archive
    reader = _EntryReader(tar, index, entry_digests)
    manifest = reader.json(MANIFEST, what="manifest.json")
    if not isinstance(manifest, list) or not manifest:
        raise ArchiveError(f"{archive}: manifest.json is not a non-empty list of images")
    layer_digests: dict[str, str] = {}
    images = [
        _check_image(reader, entry, position, layer_digests, progress)
        for position, entry in enumerate(manifest, start=1)
    ]
    if extra := index.unreferenced(reader.referenced):
        raise ArchiveError(
            f"{archive}: entries not referenced by manifest.json: {extra}; an images tar holds "
            "only manifest.json, the configs and the layers it names"
        )
    return images


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
    named = clean(config_name).removeprefix("blobs/sha256/").removesuffix(".json")
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
    for number, (name, expected) in enumerate(zip(layer_names, diff_ids, strict=True), start=1):
        what = f"image {tag}: layer {number}"
        resolved = reader.resolve(name, what=what)
        if resolved not in layer_digests:
            if progress is not None:
                progress(f"{tag}: hashing layer {number}/{len(diff_ids)} ({name})")
            layer_digests[resolved] = reader.digest(name, what=what)
        if layer_digests[resolved] != expected:
            raise ArchiveError(
                f"image {tag}: layer {number}/{len(diff_ids)} ({name}): diff_id expected "
                f"{expected}, found {layer_digests[resolved]}"
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
        repo_tags=tuple(tags),
        config_digest=config_digest,
        diff_ids=tuple(diff_ids),
        architecture=str(fields["architecture"]),
        os=str(fields["os"]),
        labels=dict(labels),
    )


class _EntryReader:
    """Reads the entries manifest.json names, by cleaned name, and remembers which it named."""

    def __init__(
        self, tar: tarfile.TarFile, index: EntryIndex, known_digests: Mapping[str, str]
    ) -> None:
        self.tar, self.index, self.known_digests = tar, index, known_digests
        self.referenced: set[str] = set()

    def resolve(self, name: str, *, what: str) -> str:
        try:
            resolved = resolve(name, what=f"{what}: entry")
        except EntryError as exc:
            raise ArchiveError(str(exc)) from None
        self.referenced.add(resolved)
        return resolved

    def _member(self, name: str, what: str) -> tarfile.TarInfo:
        member = self.index.files.get(self.resolve(name, what=what))
        if member is None:
            raise ArchiveError(f"{what}: entry {name} is missing from {self.index.archive}")
        return member

    def _open(self, member: tarfile.TarInfo, name: str, what: str) -> IO[bytes]:
        stream = self.tar.extractfile(member)
        if stream is None:
            raise ArchiveError(f"{what}: entry {name} cannot be read from {self.index.archive}")
        return stream

    def read(self, name: str, *, what: str) -> bytes:
        member = self._member(name, what)
        if member.size > _MAX_JSON_BYTES:
            raise ArchiveError(
                f"{what}: entry {name} is {member.size} bytes; a JSON entry of an images tar "
                f"is at most {_MAX_JSON_BYTES} bytes"
            )
        with self._open(member, name, what) as stream:
            return stream.read()

    def json(self, name: str, *, what: str) -> Any:
        return _parse(self.read(name, what=what), f"{self.index.archive}: {what}")

    def digest(self, name: str, *, what: str) -> str:
        member = self._member(name, what)
        known = self.known_digests.get(clean(name))
        if known is not None:
            return known
        with self._open(member, name, what) as stream:
            return "sha256:" + sha256_stream(stream)


def scan_tar(
    path: Path, progress: Callable[[int, int], None] | None = None
) -> tuple[str, dict[str, str]]:
    """One streaming pass, constant memory: the SHA-256 of the whole file and of every entry.

    This is what lets `verify` check the bundle's checksum and every layer's diff_id while
    reading the (large) images tar only once. Entries are keyed by their cleaned names; an entry
    `release._entries` refuses stops the pass with ArchiveError before its data is read.
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
    index = EntryIndex(path.name)
    with path.open("rb") as handle:
        try:
            with tarfile.open(fileobj=_Tee(), mode="r|", bufsize=CHUNK) as tar:  # type: ignore[call-overload]
                for member in tar:
                    name = index.add(member)
                    stream = tar.extractfile(member) if member.isfile() else None
                    if stream is not None:
                        entries[name] = "sha256:" + sha256_stream(stream)
        except EntryError as exc:
            raise ArchiveError(str(exc)) from None
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
        return parse_json(raw, what)
    except ManifestError as exc:
        raise ArchiveError(str(exc)) from None


def _layer_name(diff_id: str) -> str:
    return f"{diff_id.removeprefix('sha256:')}/layer.tar"


def _created(config: bytes) -> int:
    try:
        created = json.loads(config)["created"]
        return int(datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp())
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0
