"""The release manifest: per image the exact tag, RootFS layers, architecture, OS, labels and
config digest — the contract between the release tool, `verify`/`load`, and the console wizard.

`config_digest` is the SHA-256 of the image config in the images tar: `verify` requires the tar's
config to hash to it, and a release manifest without it is refused. An engine may rewrite the
image ID on load, so it is never compared on a node (`mismatches` ignores it, and a pasted wizard
entry may leave it out). Comparison results name image, field, expected and found.

Every JSON document is read with a size limit and a nesting limit, so a hostile file ends in a
`ManifestError` that names it, never in a traceback.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from modelforge_contracts.digests import is_digest
from modelforge_contracts.json_trees import tree_problem

MANIFEST_FILE = "release-manifest.json"
#: The largest release manifest read into memory (a real one is a few KiB).
MAX_MANIFEST_BYTES = 1 << 20
#: The deepest nesting of arrays and objects accepted in any JSON document of a bundle.
MAX_JSON_DEPTH = 32
#: What an image name in the manifest must look like, and the component it names.
IMAGE_PREFIX = "modelforge-"
COMPONENT_LABEL = "io.modelforge.component"


class ManifestError(Exception):
    """The manifest is malformed, or an image does not match it."""


class ImageFacts(Protocol):
    """What can be compared: from a built image, an image tar, or `docker image inspect`."""

    @property
    def tag(self) -> str: ...
    @property
    def diff_ids(self) -> Sequence[str]: ...
    @property
    def architecture(self) -> str: ...
    @property
    def os(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, str]: ...


@dataclass(frozen=True)
class ImageEntry:
    name: str
    tag: str
    architecture: str
    os: str
    rootfs_layers: tuple[str, ...]
    labels: dict[str, str]
    config_digest: str | None

    @property
    def diff_ids(self) -> tuple[str, ...]:
        """The layers under the name `ImageFacts` uses: an entry can be compared to another."""
        return self.rootfs_layers

    def as_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "tag": self.tag,
            "architecture": self.architecture,
            "os": self.os,
            "rootfs_layers": list(self.rootfs_layers),
            "labels": dict(sorted(self.labels.items())),
        }
        if self.config_digest:
            entry["config_digest"] = self.config_digest
        return entry


@dataclass(frozen=True)
class Manifest:
    version: str
    protocol: int
    images: dict[str, ImageEntry]

    def as_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "protocol": self.protocol,
            "images": {name: self.images[name].as_json() for name in sorted(self.images)},
        }

    def dumps(self) -> str:
        return json.dumps(self.as_json(), indent=2, sort_keys=True) + "\n"


def parse_json(raw: bytes, what: str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a JSON document; raise `ManifestError` naming `what` if it is not JSON, is not
    UTF-8, or nests arrays and objects deeper than `max_depth`."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ManifestError(
            f"{what}: nested more than {max_depth} levels deep; not a document this tool writes"
        ) from None
    except ValueError as exc:  # also UnicodeDecodeError
        raise ManifestError(f"{what} is not valid JSON ({exc})") from None
    if tree_problem(value, max_depth=max_depth, finite=False) is not None:
        raise ManifestError(
            f"{what}: nested more than {max_depth} levels deep; not a document this tool writes"
        )
    return value


def read_limited(path: Path, *, limit: int, what: str | None = None) -> bytes:
    """The bytes of a file of at most `limit` bytes; `OSError` if it cannot be read, and
    `ManifestError` naming it if it is larger (nothing larger is ever read into memory)."""
    name = what or path.name
    with path.open("rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ManifestError(f"{name} is larger than {limit} bytes; not a file this tool writes")
    return data


def manifest_for(images: Sequence[Any], *, version: str, protocol: int) -> Manifest:
    """Build the manifest from built images (`release.images.BuiltImage`)."""
    return Manifest(
        version=version,
        protocol=protocol,
        images={
            image.name: ImageEntry(
                name=image.name,
                tag=image.tag,
                architecture=image.architecture,
                os=image.os,
                rootfs_layers=tuple(image.diff_ids),
                labels=dict(image.labels),
                config_digest=image.config_digest,
            )
            for image in images
        },
    )


def parse_image_entry(name: str, data: Any) -> ImageEntry:
    """One manifest entry, validated field by field (also used for a pasted wizard entry)."""
    if not isinstance(data, dict):
        raise ManifestError(f"{name}: the entry must be a JSON object")
    problems = []
    tag = data.get("tag")
    if not isinstance(tag, str) or ":" not in tag or tag.endswith((":latest", ":local")):
        problems.append(f"{name}: field tag must be an exact release tag like '{name}:1.2.3'")
    for field_name in ("architecture", "os"):
        if not isinstance(data.get(field_name), str) or not data.get(field_name):
            problems.append(f"{name}: field {field_name} must be a non-empty string")
    layers = data.get("rootfs_layers")
    if (
        not isinstance(layers, list)
        or not layers
        or not all(
            isinstance(layer, str) and layer.startswith("sha256:") and len(layer) == 71
            for layer in layers
        )
    ):
        problems.append(f"{name}: field rootfs_layers must be a non-empty list of sha256: digests")
    labels = data.get("labels")
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        problems.append(f"{name}: field labels must be an object of strings")
    if problems:
        raise ManifestError("; ".join(problems))
    digest = data.get("config_digest")
    return ImageEntry(
        name=name,
        tag=str(tag),
        architecture=str(data["architecture"]),
        os=str(data["os"]),
        rootfs_layers=tuple(layers),  # type: ignore[arg-type]
        labels=dict(labels),  # type: ignore[arg-type]
        config_digest=digest if isinstance(digest, str) else None,
    )


def load_manifest(path: Path) -> Manifest:
    """Read and check a release manifest: every entry complete, its `config_digest` a sha256
    digest, and its name, tag and component label in agreement (see `check_entry_names`)."""
    try:
        raw = read_limited(path, limit=MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise ManifestError(f"cannot read {path.name}: {exc.strerror or exc}") from None
    return parse_manifest(raw, path.name)


def parse_manifest(raw: bytes, name: str = MANIFEST_FILE) -> Manifest:
    """`load_manifest` for bytes already read (and, by `verify`, already checksummed)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{name} is larger than {MAX_MANIFEST_BYTES} bytes")
    data = parse_json(raw, name)
    if not isinstance(data, dict) or not isinstance(data.get("images"), dict):
        raise ManifestError(f"{name}: expected an object with 'version' and 'images'")
    version, protocol = data.get("version"), data.get("protocol")
    if not isinstance(version, str) or not isinstance(protocol, int) or isinstance(protocol, bool):
        raise ManifestError(f"{name}: 'version' must be a string and 'protocol' an integer")
    if not data["images"]:
        raise ManifestError(f"{name}: 'images' lists no image")
    images = {image: parse_image_entry(image, entry) for image, entry in data["images"].items()}
    problems = []
    for entry in images.values():
        if not is_digest(entry.config_digest):
            found = data["images"][entry.name].get("config_digest")
            problems.append(
                f"{entry.name}: field config_digest expected a digest 'sha256:<64 hex>' (the "
                f"SHA-256 of the image config in the images tar), found {found!r}"
            )
    manifest = Manifest(version=version, protocol=protocol, images=images)
    problems += check_entry_names(manifest)
    if problems:
        raise ManifestError(f"{name}: " + "; ".join(problems))
    return manifest


def check_entry_names(manifest: Manifest) -> list[str]:
    """Each entry's name, tag and component label agree: the entry `modelforge-<component>` is
    tagged `modelforge-<component>:<version>` and labelled `io.modelforge.component=<component>`,
    so no entry can stand in for another image."""
    problems = []
    for name, entry in sorted(manifest.images.items()):
        if not name.startswith(IMAGE_PREFIX) or name == IMAGE_PREFIX:
            problems.append(f"image name {name!r} expected 'modelforge-<component>'")
            continue
        component = name.removeprefix(IMAGE_PREFIX)
        if entry.tag != f"{name}:{manifest.version}":
            problems.append(
                f"{name}: tag expected {name + ':' + manifest.version!r}, found {entry.tag!r}"
            )
        label = entry.labels.get(COMPONENT_LABEL)
        if label != component:
            problems.append(
                f"{name}: label {COMPONENT_LABEL} expected {component!r}, found {label!r}"
            )
    return problems


def mismatches(entry: ImageEntry, found: ImageFacts) -> list[str]:
    """Every difference between the manifest entry and what was found, one line each."""
    out = []

    def differ(field_name: str, expected: object, actual: object) -> None:
        out.append(f"{entry.name}: {field_name} expected {expected!r}, found {actual!r}")

    if found.tag != entry.tag:
        differ("tag", entry.tag, found.tag)
    if found.architecture != entry.architecture:
        differ("architecture", entry.architecture, found.architecture)
    if found.os != entry.os:
        differ("os", entry.os, found.os)
    layers = tuple(found.diff_ids)
    if layers != entry.rootfs_layers:
        if len(layers) != len(entry.rootfs_layers):
            differ("rootfs_layers (count)", len(entry.rootfs_layers), len(layers))
        for index, (want, got) in enumerate(zip(entry.rootfs_layers, layers, strict=False)):
            if want != got:
                differ(f"rootfs_layers[{index}]", want, got)
    labels = dict(found.labels)
    for key in sorted(set(entry.labels) | set(labels)):
        if entry.labels.get(key) != labels.get(key):
            differ(f"label {key}", entry.labels.get(key), labels.get(key))
    return out


def check_images(manifest: Manifest, found: Sequence[ImageFacts]) -> None:
    """Raise `ManifestError` unless `found` holds exactly the manifest's images, all matching."""
    by_tag = {image.tag: image for image in found}
    problems = [
        f"image {tag} appears {count} times; expected once"
        for tag, count in sorted(Counter(image.tag for image in found).items())
        if count > 1
    ]
    for entry in manifest.images.values():
        image = by_tag.pop(entry.tag, None)
        if image is None:
            problems.append(f"{entry.name}: image {entry.tag} expected, not found")
            continue
        problems += mismatches(entry, image)
    for tag in sorted(by_tag):
        problems.append(f"unexpected image {tag} (not in {MANIFEST_FILE})")
    if problems:
        raise ManifestError("\n".join(problems))
