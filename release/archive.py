"""The images tar: the docker-archive format `docker image load` reads, written and checked here.

Layout: `manifest.json` ([{"Config", "RepoTags", "Layers"}]), one `<sha256 hex>.json` config per
image, and one `<diff_id hex>/layer.tar` per distinct layer, so a layer shared by several images
is stored once. The bytes are deterministic: fixed entry order, mtime and owners.

Reading never needs Docker and never trusts a name: every header must be plain ustar
(`release._ustar`: nothing Python's and Go's tar readers could read differently), names are
resolved as the engine resolves them (`release._entries`), every referenced layer entry is hashed
again (streaming, constant memory) and compared with the config's rootfs.diff_ids, and an entry
manifest.json does not reference refuses the tar.

`load` never hands Docker the bundle's tar: `write_verified_images_tar` writes a new one, in the
layout `write_images_tar` writes, from the entries verify checked, each compared again with the
digest verify found while it is copied; for a bundle this tool wrote, the bytes are the same.
This module must never extract an entry to disk or load a layer or an oversized JSON entry into
memory.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from modelforge_contracts.release_manifest import ManifestError, parse_json
from release._entries import EntryError, EntryIndex, clean, resolve
from release._tar import CHUNK, canonical_json
from release._ustar import UstarEntry, UstarError, UstarReader, UstarWriter, Writable, read_index
from release.errors import ReleaseError

if TYPE_CHECKING:
    from release.images import BuiltImage

MANIFEST = "manifest.json"
_MAX_JSON_BYTES = 4 << 20


class ArchiveError(ReleaseError):
    """The images tar does not hold what it claims; the message names image, entry and field."""


@dataclass(frozen=True)
class ArchivedImage:
    repo_tags: tuple[str, ...]
    config_digest: str
    diff_ids: tuple[str, ...]
    architecture: str
    os: str
    labels: dict[str, str]
    #: The cleaned names of the entries holding the config and each layer, as verify found them.
    config_entry: str
    layer_entries: tuple[str, ...]

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
    layers: dict[str, Path] = {}
    for image in images:
        if len(image.layers) != len(image.diff_ids):
            raise ArchiveError(
                f"{image.tag}: {len(image.layers)} layer files for {len(image.diff_ids)} diff_ids"
            )
        for diff_id, layer in zip(image.diff_ids, image.layers, strict=True):
            layers.setdefault(diff_id, layer)

    def copy(diff_id: str) -> tuple[int, Iterator[bytes]]:
        layer = layers[diff_id]

        def pieces() -> Iterator[bytes]:
            with layer.open("rb") as stream:
                while piece := stream.read(CHUNK):
                    yield piece

        return layer.stat().st_size, pieces()

    def changed(diff_id: str, found: str) -> ArchiveError:
        return ArchiveError(
            f"layer file {layers[diff_id]}: expected {diff_id}, found {found} (changed since "
            "the build; build the images again)"
        )

    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("wb") as out:
            facts = [(i.tag, i.config_digest, i.config_bytes, i.diff_ids) for i in images]
            _write_archive(out, facts, copy, changed)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def write_verified_images_tar(path: Path, images: Sequence[ArchivedImage], out: Writable) -> None:
    """Write to `out` the images tar `load` hands Docker: `images` (as `read_images_tar` found
    them in `path` and verify checked them) in `write_images_tar`'s layout, every config and
    layer read again from `path` and compared with the digest verify found. A config that
    differs stops the stream before it is written; a layer is hashed while it is copied and its
    last bytes are held back until the hash matches, so a tar changed since verify leaves
    `out` ending inside an entry, which Docker refuses."""
    try:
        with path.open("rb") as handle:
            index = EntryIndex(path.name)
            index.add_all(read_index(handle, path.name))
            reader = _EntryReader(handle, index, {})
            configs = []
            for image in images:
                raw = reader.read(image.config_entry, what=f"image {image.tag}: config")
                if (found := "sha256:" + hashlib.sha256(raw).hexdigest()) != image.config_digest:
                    raise ArchiveError(
                        f"image {image.tag}: config {image.config_entry}: expected "
                        f"{image.config_digest} (as verified), found {found}; the images tar "
                        "changed since it was verified"
                    )
                configs.append((image.tag, image.config_digest, raw, image.diff_ids))
            sources = {
                diff_id: entry
                for image in images
                for diff_id, entry in zip(image.diff_ids, image.layer_entries, strict=True)
            }

            def copy(diff_id: str) -> tuple[int, Iterator[bytes]]:
                member = reader.member(sources[diff_id], what=f"layer {diff_id}")
                return member.size, reader.pieces(member)

            def changed(diff_id: str, found: str) -> ArchiveError:
                return ArchiveError(
                    f"layer {sources[diff_id]}: expected {diff_id} (as verified), found "
                    f"{found}; the images tar changed since it was verified"
                )

            _write_archive(out, configs, copy, changed)
    except (EntryError, UstarError) as exc:
        raise ArchiveError(f"{exc}; the images tar changed since it was verified") from None


def _write_archive(
    out: Writable,
    images: Sequence[tuple[str, str, bytes, Sequence[str]]],
    copy: Callable[[str], tuple[int, Iterator[bytes]]],
    changed: Callable[[str, str], ArchiveError],
) -> None:
    """manifest.json, the configs by name, then each layer once (in order of first use); each
    image is (tag, config_digest, config bytes, diff_ids), `copy(diff_id)` gives a layer's size
    and bytes, and `changed(diff_id, found)` the error for a layer whose bytes hash otherwise."""
    mtime = max((_created(config) for _, _, config, _ in images), default=0)
    configs: dict[str, bytes] = {}
    layers: list[str] = []
    manifest = []
    for tag, config_digest, config_bytes, diff_ids in images:
        config_name = config_digest.removeprefix("sha256:") + ".json"
        configs[config_name] = config_bytes
        layers.extend(diff_id for diff_id in diff_ids if diff_id not in layers)
        manifest.append(
            {
                "Config": config_name,
                "RepoTags": [tag],
                "Layers": [_layer_name(diff_id) for diff_id in diff_ids],
            }
        )
    writer = UstarWriter(out, mtime=mtime)
    try:
        writer.add(MANIFEST, canonical_json(manifest))
        for name, data in sorted(configs.items()):
            writer.add(name, data)
        for diff_id in layers:
            _copy_layer(writer, diff_id, copy, changed)
        writer.close()
    except UstarError as exc:
        raise ArchiveError(str(exc)) from None


def _copy_layer(
    writer: UstarWriter,
    diff_id: str,
    copy: Callable[[str], tuple[int, Iterator[bytes]]],
    changed: Callable[[str, str], ArchiveError],
) -> None:
    """One layer, hashed while it is copied; its last bytes only once the hash is its diff_id."""
    size, pieces = copy(diff_id)
    digest = hashlib.sha256()

    def hashed() -> Iterator[bytes]:
        for piece in pieces:
            digest.update(piece)
            yield piece

    def check() -> None:
        if (found := "sha256:" + digest.hexdigest()) != diff_id:
            raise changed(diff_id, found)

    writer.add_stream(_layer_name(diff_id), size, hashed(), check=check)


def read_images_tar(
    path: Path,
    *,
    progress: Callable[[str], None] | None = None,
    entry_digests: Mapping[str, str] | None = None,
) -> list[ArchivedImage]:
    """Parse and check a docker-archive without Docker; every referenced layer is re-hashed.

    Headers must be plain ustar (`release._ustar`) and names are resolved as `docker image load`
    resolves them (`release._entries`); an entry the engine could read but this check would not
    (another header form, a duplicate after cleaning, a link, a device, anything manifest.json
    does not reference, data after the end) refuses the whole tar. `entry_digests` (cleaned
    entry name -> digest, from `scan_tar`) saves the second read of the layers when the caller
    already streamed the whole file once.
    """
    try:
        with path.open("rb") as handle:
            index = EntryIndex(path.name)
            index.add_all(read_index(handle, path.name))  # headers only: the data stays put
            return _check_archive(_EntryReader(handle, index, entry_digests or {}), progress)
    except (EntryError, UstarError) as exc:
        raise ArchiveError(str(exc)) from None
    except OSError as exc:
        raise ArchiveError(f"{path.name}: cannot be read ({exc.strerror or exc})") from None


def _check_archive(
    reader: _EntryReader, progress: Callable[[str], None] | None
) -> list[ArchivedImage]:
    index = reader.index
    archive = index.archive
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
    config_entry = reader.resolve(config_name, what=f"image {tag}: config")
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
    layer_entries = []
    for number, (name, expected) in enumerate(zip(layer_names, diff_ids, strict=True), start=1):
        what = f"image {tag}: layer {number}"
        resolved = reader.resolve(name, what=what)
        layer_entries.append(resolved)
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
        config_entry=config_entry,
        layer_entries=tuple(layer_entries),
    )


class _EntryReader:
    """Reads the entries manifest.json names, by cleaned name, and remembers which it named."""

    def __init__(
        self, handle: IO[bytes], index: EntryIndex, known_digests: Mapping[str, str]
    ) -> None:
        self.handle, self.index, self.known_digests = handle, index, known_digests
        self.referenced: set[str] = set()

    def resolve(self, name: str, *, what: str) -> str:
        try:
            resolved = resolve(name, what=f"{what}: entry")
        except EntryError as exc:
            raise ArchiveError(str(exc)) from None
        self.referenced.add(resolved)
        return resolved

    def member(self, name: str, *, what: str) -> UstarEntry:
        member = self.index.files.get(self.resolve(name, what=what))
        if member is None:
            raise ArchiveError(f"{what}: entry {name} is missing from {self.index.archive}")
        return member

    def pieces(self, member: UstarEntry) -> Iterator[bytes]:
        """The entry's data, read from its place in the file, in pieces of at most CHUNK."""
        position, left = member.data_offset, member.size
        while left:
            self.handle.seek(position)
            piece = self.handle.read(min(CHUNK, left))
            if not piece:
                raise ArchiveError(
                    f"{self.index.archive}: the file ends inside the data of {member.name!r}"
                )
            position += len(piece)
            left -= len(piece)
            yield piece

    def read(self, name: str, *, what: str) -> bytes:
        member = self.member(name, what=what)
        if member.size > _MAX_JSON_BYTES:
            raise ArchiveError(
                f"{what}: entry {name} is {member.size} bytes; a JSON entry of an images tar "
                f"is at most {_MAX_JSON_BYTES} bytes"
            )
        return b"".join(self.pieces(member))

    def json(self, name: str, *, what: str) -> Any:
        return _parse(self.read(name, what=what), f"{self.index.archive}: {what}")

    def digest(self, name: str, *, what: str) -> str:
        member = self.member(name, what=what)
        known = self.known_digests.get(clean(name))
        if known is not None:
            return known
        digest = hashlib.sha256()
        for piece in self.pieces(member):
            digest.update(piece)
        return "sha256:" + digest.hexdigest()


def scan_tar(
    path: Path, progress: Callable[[int, int], None] | None = None
) -> tuple[str, dict[str, str]]:
    """One streaming pass, constant memory: the SHA-256 of the whole file and of every entry.

    This is what lets `verify` check the bundle's checksum and every layer's diff_id while
    reading the (large) images tar only once. Entries are keyed by their cleaned names; a header
    `release._ustar` or `release._entries` refuses stops the pass with ArchiveError before its
    data is read, and the reader reads to the end of the file (which must be zeros).
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
        reader = UstarReader(_Tee(), path.name)  # no seek: every byte passes through the tee
        try:
            for entry in reader.entries():
                name = index.add(entry)
                if not entry.is_directory:
                    digest = hashlib.sha256()
                    for piece in reader.data(CHUNK):
                        digest.update(piece)
                    entries[name] = "sha256:" + digest.hexdigest()
            index.check_nesting()
        except (EntryError, UstarError) as exc:
            raise ArchiveError(str(exc)) from None
    if progress is not None:
        progress(total, total)
    return "sha256:" + whole.hexdigest(), entries


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
