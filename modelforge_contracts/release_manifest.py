"""The release manifest: per image the exact tag, RootFS layers, architecture, OS and
labels — the contract between the release tool, `verify`/`load`, and the console wizard.

`config_digest` is informational (the build host's image ID): an engine may rewrite it on load,
so it is never compared on a node. Comparison results name image, field, expected and found.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

MANIFEST_FILE = "release-manifest.json"


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
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"cannot read {path.name}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), dict):
        raise ManifestError(f"{path.name}: expected an object with 'version' and 'images'")
    version, protocol = data.get("version"), data.get("protocol")
    if not isinstance(version, str) or not isinstance(protocol, int):
        raise ManifestError(f"{path.name}: 'version' must be a string and 'protocol' an integer")
    images = {name: parse_image_entry(name, entry) for name, entry in data["images"].items()}
    return Manifest(version=version, protocol=protocol, images=images)


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
    problems = []
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
