"""Entry names and types of an images tar, resolved the way `docker image load` resolves them.

The engine unpacks the tar after cleaning each name with Go's `filepath.Clean` (`./x` → `x`,
`x/../y` → `y`, `a//b` → `a/b`, a trailing `/` dropped) and joining it under its scratch
directory, where a later entry of the same cleaned name replaces an earlier one. So a name is
cleaned here by the same rules, and the verifier refuses what could make the engine load
something other than what was checked: a name that is absolute or climbs out of the root, two
entries that clean to the same name (a shadow `manifest.json` under `./manifest.json` or
`x/../manifest.json`), an entry below a file, and any entry that is neither a regular file nor a
directory (hard or symbolic links, devices, fifos, sparse or contiguous files).

The end of the archive is checked as well: everything after the last entry must be zero bytes,
so no header that this reader stopped at (and the engine's reader might not) hides more entries.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterable
from pathlib import Path

from release._tar import CHUNK

_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)
_KINDS = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a fifo",
    tarfile.CONTTYPE: "a contiguous file",
    tarfile.GNUTYPE_SPARSE: "a sparse file",
}


class EntryError(Exception):
    """An entry the verifier refuses; the message names the entry and what is wrong with it."""


def clean(name: str) -> str:
    """Go's `path.Clean`: the shortest name equivalent to `name` by purely lexical processing."""
    if not name:
        return "."
    rooted = name.startswith("/")
    parts: list[str] = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts and parts[-1] != "..":
                parts.pop()
            elif not rooted:
                parts.append("..")
            # `/..` is `/`: nothing to climb above the root of a rooted name
        else:
            parts.append(part)
    joined = "/".join(parts)
    if rooted:
        return "/" + joined
    return joined or "."


def resolve(name: str, *, what: str) -> str:
    """The name an entry (or a reference to one) has once the engine cleans it; refuses names
    that are absolute, climb out of the archive's root, or hold a NUL byte."""
    if "\x00" in name:
        raise EntryError(f"{what} {name!r}: a NUL byte in the name")
    if name.startswith("/"):
        raise EntryError(f"{what} {name!r}: an absolute name; expected a name inside the archive")
    cleaned = clean(name)
    if cleaned == ".." or cleaned.startswith("../"):
        raise EntryError(f"{what} {name!r}: climbs out of the archive's root (as {cleaned!r})")
    return cleaned


class EntryIndex:
    """The entries of one images tar by cleaned name, refusing what `add` explains."""

    def __init__(self, archive: str) -> None:
        self.archive = archive
        self.files: dict[str, tarfile.TarInfo] = {}
        self.directories: dict[str, tarfile.TarInfo] = {}
        self._raw: dict[str, str] = {}

    def add(self, member: tarfile.TarInfo) -> str:
        """Index one entry; return its cleaned name. Raises `EntryError` for a refused one."""
        where = f"{self.archive}: entry"
        name = resolve(member.name, what=where)
        if member.sparse is not None or (
            member.type not in _FILE_TYPES and member.type != tarfile.DIRTYPE
        ):
            kind = _KINDS.get(member.type, f"of tar type {member.type!r}")
            if member.sparse is not None:
                kind = "a sparse file"
            target = f" to {member.linkname!r}" if member.issym() or member.islnk() else ""
            raise EntryError(
                f"{where} {member.name!r} is {kind}{target}; an images tar holds only regular "
                "files and directories"
            )
        if name == "." and member.type != tarfile.DIRTYPE:
            raise EntryError(f"{where} {member.name!r}: a file cannot be the archive's root")
        if name in self._raw:
            raise EntryError(
                f"{where} {member.name!r} is a second entry named {name!r} (the first is "
                f"{self._raw[name]!r}); docker image load would use the last one, so the tar "
                "is refused"
            )
        self._raw[name] = member.name
        if member.type == tarfile.DIRTYPE:
            self.directories[name] = member
        else:
            self.files[name] = member
        return name

    def add_all(self, members: Iterable[tarfile.TarInfo]) -> None:
        for member in members:
            self.add(member)
        for name in self.files:
            parent = name.rpartition("/")[0]
            while parent:
                if parent in self.files:
                    raise EntryError(
                        f"{self.archive}: entry {self._raw[name]!r} lies below the file "
                        f"{self._raw[parent]!r}"
                    )
                parent = parent.rpartition("/")[0]

    def unreferenced(self, referenced: Iterable[str]) -> list[str]:
        """The entries that are neither referenced nor a directory above a referenced file."""
        used = set(referenced)
        above = {parent for name in used for parent in _parents(name)}
        return sorted(
            self._raw[name]
            for name in (*self.files, *self.directories)
            if name not in used and name not in above and name != "."
        )


def _parents(name: str) -> list[str]:
    parts = name.split("/")
    return ["/".join(parts[:index]) for index in range(1, len(parts))]


def check_end(path: Path, offset: int, archive: str) -> None:
    """Everything from `offset` (just after the last entry) to the end of the file is zeros."""
    with path.open("rb") as handle:
        handle.seek(offset)
        position = offset
        while chunk := handle.read(CHUNK):
            stripped = chunk.lstrip(b"\x00")
            if stripped:
                at = position + len(chunk) - len(stripped)
                raise EntryError(
                    f"{archive}: data after the end of the archive at byte {at} (expected only "
                    "zero padding); an entry there would be invisible to the verifier"
                )
            position += len(chunk)
