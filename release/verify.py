"""`modelforge-release verify` (RL-3): offline, without Docker, in this order —
the signature of SHA256SUMS with the pinned public key, every checksum (streaming, constant
memory, with progress), then the image tar's tags, layers, architecture and labels against the
release manifest. The first failure stops it with a message naming file/image/field, expected
and found; nothing is loaded or started.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from modelforge_contracts.release_manifest import (
    MANIFEST_FILE,
    Manifest,
    ManifestError,
    check_images,
    load_manifest,
)
from release import archive, checksums, signing

SUMS_FILE = "SHA256SUMS"
SIGNATURE_FILE = "SHA256SUMS.sig"
SIGSTORE_BUNDLE_FILE = "SHA256SUMS.sigstore.json"
TEMPLATE = Path(__file__).resolve().parent.parent / "SHA256SUMS.template"


class VerificationError(Exception):
    """The bundle must not be used; the message says what failed."""


@dataclass(frozen=True)
class VerifiedBundle:
    directory: Path
    manifest: Manifest
    images_tar: Path


def images_tar_name(version: str) -> str:
    return f"modelforge-{version}-images.tar"


def required_files(version: str) -> list[str]:
    """What SHA256SUMS must list: the template's entries for this version."""
    names = []
    for line in TEMPLATE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.append(line.split(None, 1)[1].replace("@VERSION@", version))
    return names


def load_manifest_listed(directory: Path, sums: str) -> Manifest:
    """The manifest, but only after its own checksum matched (it decides what else to check)."""
    entry = next((e for e in checksums.parse_sha256sums(sums) if e.name == MANIFEST_FILE), None)
    if entry is None:
        raise VerificationError(f"{SUMS_FILE} does not list {MANIFEST_FILE}")
    checksums.verify_sha256sums(f"{entry.sha256}  {entry.name}\n", directory)
    return load_manifest(directory / MANIFEST_FILE)


def verify_bundle(
    directory: Path,
    public_key: Path,
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> VerifiedBundle:
    try:
        return _verify(directory, public_key, progress)
    except (
        signing.SignatureError,
        signing.SigningKeyError,
        checksums.ChecksumError,
        checksums.SumsFormatError,
        archive.ArchiveError,
        ManifestError,
    ) as exc:
        raise VerificationError(str(exc)) from None


def _verify(
    directory: Path, public_key: Path, progress: Callable[[str, int, int], None] | None
) -> VerifiedBundle:
    sums_path = directory / SUMS_FILE
    try:
        sums = sums_path.read_bytes()
        signature = (directory / SIGNATURE_FILE).read_bytes()
        key_pem = public_key.read_bytes()
    except OSError as exc:
        raise VerificationError(f"cannot read {Path(exc.filename).name}: {exc.strerror}") from None
    signing.verify_blob(sums, signature, key_pem, signature_name=SIGNATURE_FILE)
    bundle_path = directory / SIGSTORE_BUNDLE_FILE
    if bundle_path.exists():
        try:
            bundle = json.loads(bundle_path.read_text())
        except ValueError as exc:
            raise VerificationError(f"{SIGSTORE_BUNDLE_FILE} is not JSON: {exc}") from None
        signing.verify_bundle(sums, bundle, key_pem, bundle_name=SIGSTORE_BUNDLE_FILE)

    manifest = load_manifest_listed(directory, sums.decode())
    listed = checksums.parse_sha256sums(sums.decode())
    names = {entry.name for entry in listed}
    for name in required_files(manifest.version):
        if name not in names:
            raise VerificationError(f"{SUMS_FILE} does not list {name}, which a release carries")
    if not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z._+-]*", manifest.version):
        raise VerificationError(f"{MANIFEST_FILE}: version {manifest.version!r} is not valid")
    tar_name = images_tar_name(manifest.version)
    images_tar = directory / tar_name
    if not images_tar.is_file():
        raise VerificationError(f"listed in {SUMS_FILE} but missing: {tar_name}")
    # Everything but the images tar, then the tar in one pass that also hashes each layer.
    others = "".join(f"{e.sha256}  {e.name}\n" for e in listed if e.name != tar_name)
    checksums.verify_sha256sums(others, directory, progress)
    expected = next(e.sha256 for e in listed if e.name == tar_name)

    def tar_progress(done: int, total: int) -> None:
        if progress is not None:
            progress(tar_name, done, total)

    unreadable: archive.ArchiveError | None = None
    entry_digests: dict[str, str] = {}
    try:
        found, entry_digests = archive.scan_tar(images_tar, tar_progress)
    except archive.ArchiveError as exc:  # the checksum decides which error the operator sees
        unreadable = exc
        found = "sha256:" + checksums.sha256_file(images_tar)
    if found != f"sha256:{expected}":
        raise VerificationError(
            f"{tar_name}: SHA-256 expected {expected} (from {SUMS_FILE}), "
            f"found {found.removeprefix('sha256:')}"
        )
    if unreadable is not None:
        raise unreadable
    check_images(manifest, archive.read_images_tar(images_tar, entry_digests=entry_digests))
    return VerifiedBundle(directory=directory, manifest=manifest, images_tar=images_tar)
