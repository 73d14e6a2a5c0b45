"""The build's check that every dynamically linked ELF file in an image can be loaded there.

For each image, the layer tars are merged the way a container runtime unpacks them (a later
layer replaces a path, `.wh.` whiteouts delete one), and every executable and shared object in
the result is read with the standard library: its program interpreter (PT_INTERP) and each
DT_NEEDED must resolve to an ELF file of the same class and machine inside the image, searched
as glibc's loader searches:

1. the object's DT_RPATH (only when it has no DT_RUNPATH);
2. LD_LIBRARY_PATH from the image config's environment;
3. the object's DT_RUNPATH;
4. the image's `/etc/ld.so.cache`;
5. the system directories of Debian's x86-64 glibc.

`$ORIGIN` is the directory of the object; symbolic links (the usrmerge aliases, `libx.so.1 ->
libx.so.1.2`) are followed inside the image, never on the build host. A library the image
may need but must not carry (the NVIDIA driver's, which the NVIDIA Container Toolkit injects at
run time) is accepted only when its recipe names it, with the reason.

What it cannot see: libraries loaded with `dlopen` by name at run time (they are not DT_NEEDED);
the loader's RPATH inheritance from the object that loaded this one (each object is checked on
its own, which is stricter). It reads the layers only: nothing from an image is ever run.
"""

from __future__ import annotations

import posixpath
import struct
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from release.errors import ReleaseError

#: glibc's system search path on Debian bookworm x86-64 (`ld.so --help`), after ld.so.cache.
SYSTEM_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib", "/usr/lib")
LD_SO_CACHE = "/etc/ld.so.cache"
_MAX_SYMLINKS = 40
_ET_EXEC, _ET_DYN = 2, 3
_PT_LOAD, _PT_DYNAMIC, _PT_INTERP = 1, 2, 3
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_STRSZ, _DT_SONAME = 0, 1, 5, 10, 14
_DT_RPATH, _DT_RUNPATH = 15, 29
_CACHE_MAGIC = b"glibc-ld.so.cache1.1"
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"


class ElfFormatError(ReleaseError):
    """A file that starts like an ELF file but whose headers cannot be read."""


@dataclass(frozen=True)
class ElfObject:
    """What the loader reads from one dynamically linked ELF file."""

    elf_class: int  # 1: 32-bit, 2: 64-bit
    machine: int
    interpreter: str | None
    needed: tuple[str, ...]
    rpath: tuple[str, ...]
    runpath: tuple[str, ...]
    soname: str | None


@dataclass
class ElfReport:
    """The outcome for one image: every unresolved dependency, and what was accepted."""

    image: str
    objects: int = 0
    problems: list[str] = field(default_factory=list)
    #: library -> the image paths that need it and will get it at run time (the recipe's list)
    provided: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line for the build output."""
        line = f"{self.image}: ELF check: {self.objects} ELF files, "
        if self.problems:
            return line + f"{len(self.problems)} unresolved dependencies"
        line += "every DT_NEEDED and interpreter found in the image"
        if self.provided:
            given = ", ".join(f"{lib} ({len(paths)} files)" for lib, paths in self.provided.items())
            line += f"; provided at run time: {given}"
        return line


def read_elf(stream: IO[bytes]) -> ElfObject | None:
    """The dynamic-linking facts of the ELF file open in `stream` (seekable, at any position);
    None when it is not an ELF file, or not one the loader maps with dependencies (relocatable
    objects, core files, static executables)."""
    stream.seek(0)
    ident = stream.read(16)
    if len(ident) < 16 or ident[:4] != b"\x7fELF":
        return None
    elf_class, data = ident[4], ident[5]
    if elf_class not in (1, 2) or data not in (1, 2):
        raise ElfFormatError(f"unknown ELF class {elf_class} or data encoding {data}")
    order = "<" if data == 1 else ">"
    wide = elf_class == 2
    header = _read(stream, 16, 48 if wide else 36)
    if wide:
        e_type, machine, _, _, phoff, _, _, _, phentsize, phnum = struct.unpack(
            order + "HHIQQQIHHH", header[:42]
        )
    else:
        e_type, machine, _, _, phoff, _, _, _, phentsize, phnum = struct.unpack(
            order + "HHIIIIIHHH", header[:30]
        )
    if e_type not in (_ET_EXEC, _ET_DYN):
        return None
    segments = []  # (type, offset, vaddr, filesz)
    for index in range(phnum):
        raw = _read(stream, phoff + index * phentsize, 56 if wide else 32)
        if wide:
            p_type, _, offset, vaddr, _, filesz = struct.unpack(order + "IIQQQQ", raw[:40])
        else:
            p_type, offset, vaddr, _, filesz = struct.unpack(order + "IIIII", raw[:20])
        segments.append((p_type, offset, vaddr, filesz))
    interpreter = None
    for p_type, offset, _, filesz in segments:
        if p_type == _PT_INTERP:
            interpreter = _read(stream, offset, filesz).split(b"\x00", 1)[0].decode()
    dynamic = [s for s in segments if s[0] == _PT_DYNAMIC]
    if not dynamic:
        if interpreter is None:
            return None  # statically linked: nothing to resolve
        return ElfObject(elf_class, machine, interpreter, (), (), (), None)
    _, offset, _, filesz = dynamic[0]
    entry_size = 16 if wide else 8
    table = _read(stream, offset, filesz)
    entries: list[tuple[int, int]] = []
    for start in range(0, len(table) - entry_size + 1, entry_size):
        tag, value = struct.unpack(
            order + ("qQ" if wide else "iI"), table[start : start + entry_size]
        )
        if tag == _DT_NULL:
            break
        entries.append((tag, value))
    values = dict(entries)
    if _DT_STRTAB not in values:
        raise ElfFormatError("a dynamic section without DT_STRTAB")
    strtab = _file_offset(values[_DT_STRTAB], segments)
    strings = _read(stream, strtab, values.get(_DT_STRSZ, 0))

    def text(at: int) -> str:
        end = strings.find(b"\x00", at)
        if at >= len(strings) or end < 0:
            raise ElfFormatError(f"string offset {at} outside the dynamic string table")
        return strings[at:end].decode("utf-8", "surrogateescape")

    def paths(tag: int) -> tuple[str, ...]:
        return tuple(p for t, v in entries if t == tag for p in text(v).split(":") if p)

    soname = text(values[_DT_SONAME]) if _DT_SONAME in values else None
    needed = tuple(text(v) for t, v in entries if t == _DT_NEEDED)
    return ElfObject(
        elf_class, machine, interpreter, needed, paths(_DT_RPATH), paths(_DT_RUNPATH), soname
    )


def _read(stream: IO[bytes], offset: int, size: int) -> bytes:
    stream.seek(offset)
    data = stream.read(size)
    if len(data) != size:
        raise ElfFormatError(f"truncated: {size} bytes at offset {offset} are past the end")
    return data


def _file_offset(address: int, segments: Sequence[tuple[int, int, int, int]]) -> int:
    for p_type, offset, vaddr, filesz in segments:
        if p_type == _PT_LOAD and vaddr <= address < vaddr + filesz:
            return address - vaddr + offset
    raise ElfFormatError(f"address {address:#x} is in no loaded segment")


def read_ld_so_cache(data: bytes) -> dict[str, list[str]]:
    """Library name -> paths, in the cache's order, from an ld.so.cache in glibc's current
    format (`glibc-ld.so.cache1.1`, the only one bookworm's ldconfig writes); {} otherwise."""
    start = data.find(_CACHE_MAGIC)
    if start < 0 or len(data) < start + 48:
        return {}
    nlibs, _ = struct.unpack_from("<II", data, start + 20)
    found: dict[str, list[str]] = {}

    def text(at: int) -> str:
        end = data.find(b"\x00", at)
        return data[at:end].decode("utf-8", "surrogateescape")

    for index in range(nlibs):
        entry = start + 48 + 24 * index
        if entry + 24 > len(data):
            break
        _, key, value = struct.unpack_from("<iII", data, entry)
        found.setdefault(text(start + key), []).append(text(start + value))
    return found


@dataclass(frozen=True)
class _Node:
    kind: str  # "file", "dir" or "symlink"
    layer: int = -1
    member: tarfile.TarInfo | None = None  # the entry holding the data (a hard link's target)
    target: str = ""  # a symlink's target


class _ImageTree:
    """The merged file tree of an image's layers, read from the tars without unpacking."""

    def __init__(self, layers: Sequence[Path]) -> None:
        self.nodes: dict[str, _Node] = {"/": _Node("dir")}
        self.tars: list[tarfile.TarFile] = []
        try:
            for index, layer in enumerate(layers):
                self.tars.append(tarfile.open(layer))  # noqa: SIM115 - closed in close()
                by_name: dict[str, tarfile.TarInfo] = {}
                for member in self.tars[-1]:
                    by_name[member.name] = member
                    self._add(index, member, by_name)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for tar in self.tars:
            tar.close()

    def _add(
        self, layer: int, member: tarfile.TarInfo, by_name: Mapping[str, tarfile.TarInfo]
    ) -> None:
        path = posixpath.normpath("/" + member.name)
        parent, base = posixpath.split(path)
        if base == _OPAQUE:  # the directory hides what the layers below put in it
            prefix = parent.rstrip("/") + "/"
            for name in [n for n, node in self.nodes.items() if n.startswith(prefix)]:
                if self.nodes[name].layer < layer:
                    del self.nodes[name]
            return
        if base.startswith(_WHITEOUT):  # the path is deleted
            gone = posixpath.join(parent, base[len(_WHITEOUT) :])
            for name in [n for n in self.nodes if n == gone or n.startswith(gone + "/")]:
                del self.nodes[name]
            return
        if member.isdir():
            self.nodes[path] = _Node("dir", layer)
        elif member.issym():
            self.nodes[path] = _Node("symlink", layer, target=member.linkname)
        elif member.islnk():
            self.nodes[path] = _Node("file", layer, member=by_name.get(member.linkname))
        elif member.isreg():
            self.nodes[path] = _Node("file", layer, member=member)

    def resolve(self, path: str) -> str | None:
        """The path of the file or directory `path` names inside the image, every symbolic
        link followed within the image; None when it does not exist there."""
        pending = [part for part in path.split("/") if part]
        current = "/"
        hops = 0
        while pending:
            part = pending.pop(0)
            if part == ".":
                continue
            if part == "..":
                current = posixpath.dirname(current)
                continue
            candidate = posixpath.join(current, part)
            node = self.nodes.get(candidate)
            if node is None:
                return None
            if node.kind == "symlink":
                hops += 1
                if hops > _MAX_SYMLINKS:
                    return None
                if node.target.startswith("/"):
                    current = "/"
                pending[:0] = [p for p in node.target.split("/") if p]
                continue
            if node.kind == "file" and pending:
                return None
            current = candidate
        return current

    def is_dir(self, path: str) -> bool:
        resolved = self.resolve(path)
        return resolved is not None and self.nodes[resolved].kind == "dir"

    def open(self, path: str) -> IO[bytes]:
        node = self.nodes[path]
        stream = self.tars[node.layer].extractfile(node.member) if node.member else None
        if stream is None:
            raise ElfFormatError(f"no data for {path} in layer {node.layer}")
        return stream


def check_image(
    image: str,
    layers: Sequence[Path],
    env: Iterable[str],
    provided: Mapping[str, str] | None = None,
) -> ElfReport:
    """Check every ELF file of the image made of `layers` (in order) whose config sets `env`
    ("NAME=value" items); `provided` maps a library the image may need without carrying it to
    the reason it will be there at run time."""
    tree = _ImageTree(layers)
    try:
        return _check(image, tree, env, provided or {})
    finally:
        tree.close()


def _check(
    image: str, tree: _ImageTree, env: Iterable[str], provided: Mapping[str, str]
) -> ElfReport:
    report = ElfReport(image)
    objects: dict[str, ElfObject | None] = {}

    def elf_at(path: str) -> ElfObject | None:
        if path not in objects:
            node = tree.nodes.get(path)
            objects[path] = None
            if node is not None and node.kind == "file":
                try:
                    objects[path] = read_elf(tree.open(path))
                except (ElfFormatError, UnicodeDecodeError, struct.error):
                    objects[path] = None
        return objects[path]

    variables = dict(item.split("=", 1) for item in env if "=" in item)
    library_path = [d for d in variables.get("LD_LIBRARY_PATH", "").split(":") if d]
    for directory in library_path:
        if not directory.startswith("/") or not tree.is_dir(directory):
            report.problems.append(
                f"LD_LIBRARY_PATH names {directory}, which is not a directory in the image"
            )
    cache_path = tree.resolve(LD_SO_CACHE)
    cache = read_ld_so_cache(tree.open(cache_path).read()) if cache_path else {}

    def matching(path: str | None, wanted: ElfObject) -> bool:
        found = elf_at(path) if path else None
        return found is not None and (found.elf_class, found.machine) == (
            wanted.elf_class,
            wanted.machine,
        )

    def locate(name: str, obj: ElfObject, origin: str) -> str | None:
        if "/" in name:
            path = tree.resolve(posixpath.join(origin, name))
            return path if matching(path, obj) else None
        searched = [
            *(_expand(d, origin) for d in (obj.rpath if not obj.runpath else ())),
            *library_path,
            *(_expand(d, origin) for d in obj.runpath),
        ]
        candidates = [posixpath.join(d, name) for d in searched if d.startswith("/")]
        candidates += cache.get(name, [])
        candidates += [posixpath.join(d, name) for d in SYSTEM_DIRS]
        for candidate in candidates:
            path = tree.resolve(candidate)
            if matching(path, obj):
                return path
        return None

    for path in sorted(tree.nodes):
        node = tree.nodes[path]
        if node.kind != "file":
            continue
        try:
            obj = read_elf(tree.open(path))
        except (ElfFormatError, UnicodeDecodeError, struct.error) as exc:
            report.problems.append(f"{path[1:]}: cannot read its ELF headers ({exc})")
            continue
        objects[path] = obj
        if obj is None:
            continue
        report.objects += 1
        origin = posixpath.dirname(path)
        if obj.interpreter is not None:
            interpreter = tree.resolve(obj.interpreter)
            if not matching(interpreter, obj):
                report.problems.append(
                    f"{path[1:]}: its interpreter {obj.interpreter} is not in the image"
                )
        for name in obj.needed:
            if locate(name, obj, origin) is not None:
                continue
            if name in provided:
                report.provided.setdefault(name, []).append(path[1:])
                continue
            where = [
                *(f"DT_RPATH {d}" for d in (obj.rpath if not obj.runpath else ())),
                *(f"DT_RUNPATH {d}" for d in obj.runpath),
            ]
            if library_path:
                where.insert(
                    len(where) - len(obj.runpath), "LD_LIBRARY_PATH " + ":".join(library_path)
                )
            searched = ", ".join([*where, LD_SO_CACHE, *SYSTEM_DIRS])
            report.problems.append(
                f"{path[1:]} needs {name}, which is not in the image (searched {searched})"
            )
    return report


def _expand(directory: str, origin: str) -> str:
    """A DT_RPATH/DT_RUNPATH entry with the loader's dynamic string tokens replaced."""
    for token, value in (
        ("${ORIGIN}", origin),
        ("$ORIGIN", origin),
        ("${LIB}", "lib/x86_64-linux-gnu"),
        ("$LIB", "lib/x86_64-linux-gnu"),
        ("${PLATFORM}", "x86_64"),
        ("$PLATFORM", "x86_64"),
    ):
        directory = directory.replace(token, value)
    return posixpath.normpath(directory) if directory.startswith("/") else directory


def failure_message(report: ElfReport, limit: int = 25) -> str:
    """The build's error for a failed check: each problem on a line of its own."""
    lines = report.problems[:limit]
    more = len(report.problems) - len(lines)
    tail = [f"… and {more} more"] if more > 0 else []
    return (
        f"{report.image}: ELF dependency check failed: {len(report.problems)} problems; add the "
        "Debian package that carries each library to the base, or the wheel to the lock:\n  "
        + "\n  ".join([*lines, *tail])
    )
