"""Entry names of an images tar, resolved the way `docker image load` resolves them.

The engine unpacks the tar after cleaning each name with Go's `filepath.Clean` (`./x` → `x`,
`x/../y` → `y`, `a//b` → `a/b`, a trailing `/` dropped) and joining it under its scratch
directory, where a later entry of the same cleaned name replaces an earlier one. So a name is
cleaned here by the same rules, and the verifier refuses what could make the engine load
something other than what was checked: a name that is absolute or climbs out of the root, two
entries that clean to the same name (a shadow `manifest.json` under `./manifest.json` or
`x/../manifest.json`), and an entry below a file. The headers themselves (only regular files
and directories, in plain ustar) are `release._ustar`'s.
"""

from __future__ import annotations

from collections.abc import Iterable

from release._ustar import UstarEntry
from release.errors import ReleaseError


class EntryError(ReleaseError):
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
        self.files: dict[str, UstarEntry] = {}
        self.directories: dict[str, UstarEntry] = {}
        self._raw: dict[str, str] = {}

    def add(self, entry: UstarEntry) -> str:
        """Index one entry; return its cleaned name. Raises `EntryError` for a refused one."""
        where = f"{self.archive}: entry"
        name = resolve(entry.name, what=where)
        if name == "." and not entry.is_directory:
            raise EntryError(f"{where} {entry.name!r}: a file cannot be the archive's root")
        if name in self._raw:
            raise EntryError(
                f"{where} {entry.name!r} is a second entry named {name!r} (the first is "
                f"{self._raw[name]!r}); docker image load would use the last one, so the tar "
                "is refused"
            )
        self._raw[name] = entry.name
        if entry.is_directory:
            self.directories[name] = entry
        else:
            self.files[name] = entry
        return name

    def add_all(self, entries: Iterable[UstarEntry]) -> None:
        for entry in entries:
            self.add(entry)
        self.check_nesting()

    def check_nesting(self) -> None:
        """No entry lies below a file (the engine could not unpack it as checked)."""
        for name in (*self.files, *self.directories):
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
