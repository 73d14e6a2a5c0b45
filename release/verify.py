"""`modelforge-release verify` (RL-3): offline, without Docker, in this order —
the signatures of SHA256SUMS with the pinned public key, the bundle's files against SHA256SUMS
(nothing listed missing, nothing unlisted present), every checksum (streaming, constant memory,
with progress), then the images tar: plain ustar headers only (nothing two tar readers could
read differently), entry names resolved as `docker image load` resolves them, the images it
holds, their tags, configs, layers, architecture and labels against the release manifest. The
first failure stops it with a message naming file/image/field, expected and found; nothing is
loaded or started.

Every file read into memory has a size limit and every JSON document a nesting limit.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from modelforge_contracts.release_manifest import (
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    check_images,
    parse_json,
    parse_manifest,
    read_limited,
)
from release import archive, checksums, signing
from release.errors import ReleaseError

SUMS_FILE = "SHA256SUMS"
SIGNATURE_FILE = "SHA256SUMS.sig"
SIGSTORE_BUNDLE_FILE = "SHA256SUMS.sigstore.json"
#: The signatures of SHA256SUMS every release carries beside it (`modelforge-release sign`).
SIGNATURE_FILES = (SIGNATURE_FILE, SIGSTORE_BUNDLE_FILE)
TEMPLATE = Path(__file__).resolve().parent.parent / "SHA256SUMS.template"
_MAX_SUMS_BYTES = 1 << 20
_MAX_SIGNATURE_BYTES = 64 << 10
_MAX_SIGSTORE_BYTES = 1 << 20
_MAX_KEY_BYTES = 64 << 10


class VerificationError(ReleaseError):
    """The bundle must not be used; the message says what failed."""


@dataclass(frozen=True)
class VerifiedBundle:
    directory: Path
    manifest: Manifest
    images_tar: Path
    manifest_sha256: str
    #: The images as verify found them in the images tar (entries, config digests, layers):
    #: what `load` writes again for Docker.
    images: tuple[archive.ArchivedImage, ...]


@dataclass(frozen=True)
class BundleLayout:
    """What a release bundle carries: the files SHA256SUMS lists, and its signature files."""

    listed: tuple[str, ...]
    signatures: tuple[str, ...]


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


def bundle_layout(version: str) -> BundleLayout:
    """The release layout for `version`: the template's files, and the signature files."""
    return BundleLayout(listed=tuple(required_files(version)), signatures=SIGNATURE_FILES)


def read_manifest_listed(directory: Path, sums: str) -> tuple[Manifest, str]:
    """The manifest and its SHA-256, parsed from the very bytes whose checksum matched."""
    entry = next((e for e in checksums.parse_sha256sums(sums) if e.name == MANIFEST_FILE), None)
    if entry is None:
        raise VerificationError(f"{SUMS_FILE} does not list {MANIFEST_FILE}")
    raw = _read(directory, MANIFEST_FILE, MAX_MANIFEST_BYTES)
    found = hashlib.sha256(raw).hexdigest()
    if found != entry.sha256:
        raise VerificationError(
            f"{MANIFEST_FILE}: SHA-256 expected {entry.sha256} (from {SUMS_FILE}), found {found}"
        )
    return parse_manifest(raw, MANIFEST_FILE), found


def verify_bundle(
    directory: Path,
    public_key: Path,
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> VerifiedBundle:
    """Everything: signatures, the bundle's files and checksums, the images tar."""
    with _as_verification_error():
        return _verify(directory, public_key, progress)


def verify_release_manifest(directory: Path, public_key: Path) -> tuple[Manifest, str]:
    """The signatures of SHA256SUMS, then the release manifest's own checksum: what `up` needs
    to trust the manifest it reads without re-reading the (large) images tar. Returns the
    manifest and its SHA-256."""
    with _as_verification_error():
        sums = _verified_sums(directory, public_key)
        return read_manifest_listed(directory, sums.decode())


@contextmanager
def _as_verification_error() -> Iterator[None]:
    """Any refusal of the modules verify uses becomes a VerificationError with its message."""
    try:
        yield
    except (
        signing.SignatureError,
        signing.SigningKeyError,
        checksums.ChecksumError,
        checksums.SumsFormatError,
        archive.ArchiveError,
        ManifestError,
    ) as exc:
        raise VerificationError(str(exc)) from None


def _read(directory: Path, name: str, limit: int) -> bytes:
    path = directory / name
    if path.is_symlink():
        raise VerificationError(f"{name} is a symbolic link; a bundle holds only regular files")
    try:
        return read_limited(path, limit=limit, what=name)
    except FileNotFoundError:
        if name in SIGNATURE_FILES:
            raise VerificationError(
                f"{name} is missing: a release carries it (`modelforge-release sign` writes it)"
            ) from None
        raise VerificationError(f"{name} is missing from {directory}") from None
    except OSError as exc:
        raise VerificationError(f"cannot read {name}: {exc.strerror or exc}") from None


def _verified_sums(directory: Path, public_key: Path) -> bytes:
    """SHA256SUMS, once both of its signatures verified with the pinned key."""
    try:
        key_pem = read_limited(public_key, limit=_MAX_KEY_BYTES)
    except OSError as exc:
        raise VerificationError(
            f"cannot read the public key {public_key}: {exc.strerror or exc}"
        ) from None
    sums = _read(directory, SUMS_FILE, _MAX_SUMS_BYTES)
    signature = _read(directory, SIGNATURE_FILE, _MAX_SIGNATURE_BYTES)
    signing.verify_blob(sums, signature, key_pem, signature_name=SIGNATURE_FILE)
    bundle_raw = _read(directory, SIGSTORE_BUNDLE_FILE, _MAX_SIGSTORE_BYTES)
    bundle = parse_json(bundle_raw, SIGSTORE_BUNDLE_FILE)
    signing.verify_bundle(sums, bundle, key_pem, bundle_name=SIGSTORE_BUNDLE_FILE)
    try:
        sums.decode("utf-8")
    except UnicodeDecodeError:
        raise VerificationError(f"{SUMS_FILE} is not UTF-8 text") from None
    return sums


def check_bundle_files(directory: Path, listed: Sequence[str], signatures: Sequence[str]) -> None:
    """Nothing in the bundle directory but SHA256SUMS, its signatures, the files it lists and
    the directories holding them; no symbolic links."""
    allowed = {SUMS_FILE, *signatures, *listed}
    folders = {
        "/".join(name.split("/")[:depth])
        for name in allowed
        for depth in range(1, name.count("/") + 1)
    }
    found = []
    for parent, dirs, files in os.walk(directory):
        for name in (*dirs, *files):
            found.append(Path(parent, name))
    for path in sorted(found):
        relative = path.relative_to(directory).as_posix()
        if path.is_symlink():
            raise VerificationError(
                f"{relative} is a symbolic link; a bundle holds only regular files"
            )
        if path.is_dir():
            if relative not in folders:
                raise VerificationError(
                    f"unexpected directory {relative}: no file {SUMS_FILE} lists is in it"
                )
        elif relative not in allowed:
            raise VerificationError(
                f"unlisted file {relative}: not in {SUMS_FILE}; a bundle holds only the files "
                f"{SUMS_FILE} lists and its signatures"
            )


def check_archived_images(manifest: Manifest, found: Sequence[archive.ArchivedImage]) -> None:
    """The images tar holds exactly the manifest's images, each under its tag alone, with the
    config the manifest's `config_digest` names and the manifest's layers, architecture, OS
    and labels."""
    tags = {entry.tag for entry in manifest.images.values()}
    problems = []
    for position, image in enumerate(found, start=1):
        if len(image.repo_tags) != 1:
            want = [image.tag] if image.tag in tags else "one release tag"
            problems.append(
                f"manifest.json image {position}: RepoTags expected {want!r}, found "
                f"{list(image.repo_tags)!r}; an images tar must not give an image other names"
            )
    try:
        check_images(manifest, found)
    except ManifestError as exc:
        problems.append(str(exc))
    by_tag = {image.tag: image for image in found}
    for entry in manifest.images.values():
        archived = by_tag.get(entry.tag)
        if archived is not None and archived.config_digest != entry.config_digest:
            problems.append(
                f"{entry.name}: config_digest expected {entry.config_digest}, found "
                f"{archived.config_digest} (the SHA-256 of its config in the images tar)"
            )
    if problems:
        raise VerificationError("\n".join(problems))


def _verify(
    directory: Path, public_key: Path, progress: Callable[[str, int, int], None] | None
) -> VerifiedBundle:
    sums = _verified_sums(directory, public_key)
    manifest, manifest_sha256 = read_manifest_listed(directory, sums.decode())
    if not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z._+-]*", manifest.version):
        raise VerificationError(f"{MANIFEST_FILE}: version {manifest.version!r} is not valid")
    listed = checksums.parse_sha256sums(sums.decode())
    names = [entry.name for entry in listed]
    layout = bundle_layout(manifest.version)
    for name in layout.listed:
        if name not in names:
            raise VerificationError(f"{SUMS_FILE} does not list {name}, which a release carries")
    for name in names:
        if not (directory / name).exists() and not (directory / name).is_symlink():
            raise VerificationError(f"listed in {SUMS_FILE} but missing: {name}")
    check_bundle_files(directory, names, layout.signatures)
    tar_name = images_tar_name(manifest.version)
    images_tar = directory / tar_name
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
    archived = archive.read_images_tar(images_tar, entry_digests=entry_digests)
    check_archived_images(manifest, archived)
    return VerifiedBundle(
        directory=directory,
        manifest=manifest,
        images_tar=images_tar,
        manifest_sha256=manifest_sha256,
        images=tuple(archived),
    )
