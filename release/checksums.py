"""SHA256SUMS for a release bundle: render it from `SHA256SUMS.template`, and verify it.

Job: hash the bundle's files as streams (1 MiB at a time, so memory stays constant however large
the image tar is), write the `sha256sum` format (`<64 lowercase hex>  <relative path>`, which
`sha256sum -c` reads), and check a bundle directory against such a file, reporting progress.

Template format (`SHA256SUMS.template` at the repository root): one `@SHA256@  <path>` line per
file the bundle must carry, where `<path>` may contain `@VERSION@`; blank lines and lines starting
with `#` are ignored. Rendering replaces `@VERSION@` with the release version and `@SHA256@` with
the file's digest, keeping the template's order.

Never: read a whole file into memory, accept a listed path that could leave the bundle directory
(absolute, `..`, empty or odd components), hash anything but a regular file, or accept a
malformed or ambiguous SHA256SUMS line instead of stopping on it.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from release.errors import ReleaseError

CHUNK_SIZE = 1024 * 1024
SHA256_PLACEHOLDER = "@SHA256@"
VERSION_PLACEHOLDER = "@VERSION@"

Progress = Callable[[str, int, int], None]
"""Called as `progress(name, bytes_done, bytes_total)` while a listed file is hashed."""

_SUMS_LINE = re.compile(r"(?P<digest>[0-9a-f]{64})  (?P<name>.+)")
_TEMPLATE_LINE = re.compile(re.escape(SHA256_PLACEHOLDER) + r"  (?P<name>.+)")
_PATH_COMPONENT = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]*")
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z._+-]*")


class ChecksumError(ReleaseError):
    """A bundle file is missing or its SHA-256 differs from SHA256SUMS; names the file."""

    def __init__(self, message: str, *, file_name: str) -> None:
        super().__init__(message)
        self.file_name = file_name


class SumsFormatError(ReleaseError):
    """SHA256SUMS or SHA256SUMS.template is malformed; names the line."""


@dataclass(frozen=True)
class ChecksumEntry:
    """One SHA256SUMS line: a bundle-relative POSIX path and its lowercase hex SHA-256."""

    name: str
    sha256: str

    def line(self) -> str:
        return f"{self.sha256}  {self.name}"


def sha256_file(path: Path, progress: Callable[[int, int], None] | None = None) -> str:
    """Lowercase hex SHA-256 of a regular file, read in 1 MiB chunks.

    `progress(bytes_done, bytes_total)` is called once before reading and after every chunk.
    Raises `FileNotFoundError` if the file is missing and `IsADirectoryError`/`OSError` if it is
    not a regular file (a FIFO is refused without blocking).
    """
    # O_NONBLOCK so that opening a FIFO cannot hang; it changes nothing for a regular file.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as stream:
        info = os.fstat(stream.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        total = info.st_size
        digest = hashlib.sha256()
        done = 0
        if progress is not None:
            progress(done, total)
        while chunk := stream.read(CHUNK_SIZE):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return digest.hexdigest()


def render_sha256sums(
    template_path: Path, directory: Path, version: str, progress: Progress | None = None
) -> str:
    """Render SHA256SUMS for the bundle in `directory` from the template, for `version`.

    Raises `SumsFormatError` for a malformed template or version and `ChecksumError` when a file
    the template lists is not in `directory`.
    """
    if not _VERSION.fullmatch(version):
        raise SumsFormatError(f"release version {version!r} is not a plain version string")
    template_name = template_path.name
    entries: list[ChecksumEntry] = []
    seen: set[str] = set()
    for number, line in _lines(template_path.read_text(encoding="utf-8"), template_name):
        if not line or line.startswith("#"):
            continue
        match = _TEMPLATE_LINE.fullmatch(line)
        if match is None:
            raise SumsFormatError(
                f"{template_name} line {number}: expected '{SHA256_PLACEHOLDER}  <path>', "
                f"found {line!r}"
            )
        name = match["name"].replace(VERSION_PLACEHOLDER, version)
        _check_name(name, where=f"{template_name} line {number}")
        if name in seen:
            raise SumsFormatError(f"{template_name} line {number}: {name} is listed twice")
        seen.add(name)
        digest = _hash_listed(directory, name, progress, listed_in=template_name)
        entries.append(ChecksumEntry(name=name, sha256=digest))
    if not entries:
        raise SumsFormatError(f"{template_name} lists no files")
    return "".join(entry.line() + "\n" for entry in entries)


def parse_sha256sums(sums_text: str) -> list[ChecksumEntry]:
    """Parse SHA256SUMS strictly: every line `<64 lowercase hex>  <safe relative path>`.

    Raises `SumsFormatError` naming the first bad line: malformed, absolute or `..` paths,
    duplicates, blank lines, CR line ends, or a file listing nothing.
    """
    entries: list[ChecksumEntry] = []
    seen: set[str] = set()
    for number, line in _lines(sums_text, "SHA256SUMS"):
        match = _SUMS_LINE.fullmatch(line)
        if match is None:
            raise SumsFormatError(
                f"SHA256SUMS line {number}: expected '<64 lowercase hex digits>  <path>', "
                f"found {line!r}"
            )
        name = match["name"]
        _check_name(name, where=f"SHA256SUMS line {number}")
        if name in seen:
            raise SumsFormatError(f"SHA256SUMS line {number}: {name} is listed twice")
        seen.add(name)
        entries.append(ChecksumEntry(name=name, sha256=match["digest"]))
    if not entries:
        raise SumsFormatError("SHA256SUMS lists no files")
    return entries


def verify_sha256sums(
    sums_text: str, directory: Path, progress: Progress | None = None
) -> list[ChecksumEntry]:
    """Check every file SHA256SUMS lists in `directory`; stop at the first mismatch.

    The whole file is parsed and every listed file looked up before any hashing, so a bad line
    or a missing file fails at once rather than after hashing gigabytes. Raises
    `SumsFormatError` or `ChecksumError`; returns the verified entries.
    """
    entries = parse_sha256sums(sums_text)
    for entry in entries:
        if not (directory / entry.name).exists():
            raise ChecksumError(
                f"listed in SHA256SUMS but missing: {entry.name}", file_name=entry.name
            )
    for entry in entries:
        found = _hash_listed(directory, entry.name, progress, listed_in="SHA256SUMS")
        if found != entry.sha256:
            raise ChecksumError(
                f"{entry.name}: SHA-256 expected {entry.sha256} (from SHA256SUMS), found {found}",
                file_name=entry.name,
            )
    return entries


def _hash_listed(directory: Path, name: str, progress: Progress | None, *, listed_in: str) -> str:
    try:
        return sha256_file(directory / name, None if progress is None else partial(progress, name))
    except FileNotFoundError:
        raise ChecksumError(f"listed in {listed_in} but missing: {name}", file_name=name) from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ChecksumError(
            f"listed in {listed_in} but not a readable regular file: {name} ({reason})",
            file_name=name,
        ) from None


def _lines(text: str, source: str) -> list[tuple[int, str]]:
    if "\r" in text:
        raise SumsFormatError(f"{source} has CR line ends; only LF is accepted")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    return list(enumerate(lines, start=1))


def _check_name(name: str, *, where: str) -> None:
    """Allow only plain relative POSIX paths whose components cannot climb or hide."""
    if name.startswith("/"):
        raise SumsFormatError(f"{where}: absolute path {name!r} is not allowed")
    for component in name.split("/"):
        if component in ("", ".", ".."):
            raise SumsFormatError(
                f"{where}: path {name!r} has an empty, '.' or '..' component; "
                "only plain relative paths are allowed"
            )
        if not _PATH_COMPONENT.fullmatch(component):
            raise SumsFormatError(
                f"{where}: path {name!r} has characters outside [A-Za-z0-9._+-/] "
                "or a component starting with '.'"
            )
