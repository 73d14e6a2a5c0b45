"""The images tar's own format, read and written here: plain POSIX ustar, nothing two readers
could read differently.

`docker image load` reads the tar with Go's `archive/tar`; Python's `tarfile` disagrees with it
on the extensions (a typeflag-NUL entry whose GNU long name or PAX path ends in `/`: a file for
one, a directory without data for the other, whose "data" it then reads as more headers; a
long name or PAX record read past its size; numbers Python cuts at the first NUL). So this
reader accepts only what `write_images_tar` writes, byte for byte the same for both: one
512-byte ustar header per entry (magic `ustar\\0`, version `00`, an unsigned checksum), typeflag
`0` (a file) or `5` (a directory, size 0), a name of `[A-Za-z0-9._+/-]` in the name field only
(no prefix, no link name, no user or group names), numbers in octal digits, data padded with
zeros, then two zero blocks and nothing but zeros. Everything else — GNU `L`/`K` long names,
PAX `x`/`g` headers, typeflag NUL, links, devices, base-256 numbers, a file whose name ends in
`/` — refuses the whole tar, naming the entry and the byte offset of its header.

`UstarWriter` writes exactly that form (the images tar of a build, and the stream `load` hands
Docker); a layer's last bytes are held back until a check of the whole layer passes, so a
stream stopped by a failed check ends inside an entry, which every reader refuses.

This module never extracts, follows or decodes an entry's data.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Protocol

from release.errors import ReleaseError

BLOCK = 512
RECORD = 20 * BLOCK
#: The largest size eleven octal digits hold (8 GiB - 1): a larger entry needs a PAX header.
MAX_ENTRY_SIZE = 8**11 - 1
#: An images tar holds a manifest, a few configs and a few layers; a bound on the index.
MAX_ENTRIES = 4096
FILE, DIRECTORY = b"0", b"5"
USTAR_MAGIC = b"ustar\x0000"
_NAME = re.compile(rb"[A-Za-z0-9._+/-]+")
_OCTAL = re.compile(rb"([0-7]+)[ \x00]*")
_KINDS = {
    b"\x00": "a file of the old form (typeflag NUL, which readers tell from a directory by its "
    "name's last character, some before and some after a long name applies)",
    b"1": "a hard link",
    b"2": "a symbolic link",
    b"3": "a character device",
    b"4": "a block device",
    b"6": "a fifo",
    b"7": "a contiguous file",
    b"S": "a sparse file",
    b"L": "a GNU long name",
    b"K": "a GNU long link name",
    b"x": "a PAX extended header",
    b"g": "a PAX global header",
}
_FIELDS = (  # (what, start, end) of every number field but the checksum
    ("mode", 100, 108),
    ("uid", 108, 116),
    ("gid", 116, 124),
    ("size", 124, 136),
    ("mtime", 136, 148),
)
_EMPTY = (  # (what, start, end) of the fields `write_images_tar` leaves empty
    ("link name", 157, 257),
    ("user name", 265, 297),
    ("group name", 297, 329),
    ("prefix", 345, 500),
    ("reserved bytes", 500, 512),
)


class UstarError(ReleaseError):
    """The tar holds something beyond plain ustar; the message names entry, offset and why."""


class Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


class Writable(Protocol):
    def write(self, data: bytes, /) -> object: ...


@dataclass(frozen=True)
class UstarEntry:
    """One header: the name as stored, whether it is a directory, its data's size and place."""

    name: str
    is_directory: bool
    size: int
    offset: int

    @property
    def data_offset(self) -> int:
        return self.offset + BLOCK


def parse_header(block: bytes, offset: int, archive: str) -> UstarEntry:
    """The entry one 512-byte header describes, or UstarError."""
    raw_name = block[0:100].split(b"\x00", 1)[0]
    shown = repr(raw_name.decode("latin-1"))
    where = f"{archive}: entry {shown} (header at byte {offset})"
    stored = _octal(block[148:156])
    if stored is None or stored != sum(block[:148]) + 8 * 0x20 + sum(block[156:]):
        if offset == 0:
            raise UstarError(f"{archive}: not a tar archive (the first header's checksum is wrong)")
        raise UstarError(
            f"{where}: the header checksum is not the unsigned sum of its bytes; the tar is "
            "damaged or was written for another reader"
        )
    typeflag = block[156:157]
    if typeflag not in (FILE, DIRECTORY):
        kind = _KINDS.get(typeflag, f"of tar type {typeflag!r}")
        link = block[157:257].split(b"\x00", 1)[0]
        target = f" to {link.decode('latin-1')!r}" if typeflag in (b"1", b"2") else ""
        raise UstarError(
            f"{archive}: entry {shown} is {kind}{target}; an images tar holds only regular "
            "files and directories, each in one plain ustar header"
        )
    if block[257:265] != USTAR_MAGIC:
        raise UstarError(
            f"{where}: magic {block[257:265]!r}, expected {USTAR_MAGIC!r} (POSIX ustar); GNU "
            "and old formats are read differently by different readers"
        )
    if not raw_name or block[len(raw_name) : 100].strip(b"\x00") or not _NAME.fullmatch(raw_name):
        raise UstarError(
            f"{where}: the name must be [A-Za-z0-9._+/-] characters followed only by NUL bytes"
        )
    for what, start, end in _EMPTY:
        if block[start:end].strip(b"\x00"):
            raise UstarError(f"{where}: the {what} field is not empty ({block[start:end]!r})")
    for what, start, end in (("devmajor", 329, 337), ("devminor", 337, 345)):
        if block[start:end].strip(b"\x00") and _octal(block[start:end]) != 0:
            raise UstarError(f"{where}: {what} {block[start:end]!r}, expected 0 or empty")
    numbers = {}
    for what, start, end in _FIELDS:
        value = _octal(block[start:end])
        if value is None:
            raise UstarError(
                f"{where}: the {what} field {block[start:end]!r} is not octal digits followed "
                "by NUL or space (base-256 or a NUL inside the digits is read differently by "
                "different readers)"
            )
        numbers[what] = value
    name = raw_name.decode("ascii")
    is_directory = typeflag == DIRECTORY
    if not is_directory and name.endswith("/"):
        raise UstarError(f"{where}: a file whose name ends in '/' (a directory to some readers)")
    if is_directory and numbers["size"]:
        raise UstarError(
            f"{where}: a directory of size {numbers['size']}; readers skip no data after a "
            "directory, so its bytes would be read as headers"
        )
    return UstarEntry(name=name, is_directory=is_directory, size=numbers["size"], offset=offset)


def _octal(field: bytes) -> int | None:
    match = _OCTAL.fullmatch(field)
    return int(match.group(1), 8) if match else None


class UstarReader:
    """Walks an images tar from its first byte, one header at a time, in a single pass.

    `entries()` yields each entry; `data()` streams the current entry's data, and whatever the
    caller left unread is skipped (by `seek` where the stream has one). The zero padding after
    every entry's data and everything after the two zero blocks at the end are checked, so no
    byte of the file escapes this reader.
    """

    def __init__(self, stream: Readable, archive: str) -> None:
        self.stream, self.archive = stream, archive
        self.position = 0
        self._current: UstarEntry | None = None
        self._data_left = 0

    def _read(self, size: int) -> bytes:
        data = self.stream.read(size)
        self.position += len(data)
        return data

    def _exactly(self, size: int, what: str) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self._read(size - len(data))
            if not chunk:
                raise UstarError(f"{self.archive}: the file ends inside {what} (truncated)")
            data += chunk
        return data

    def entries(self) -> Iterator[UstarEntry]:
        count = 0
        while True:
            self._finish_entry()
            offset = self.position
            block = self._read(BLOCK)
            if not block.strip(b"\x00"):
                self._check_end(block, offset)
                return
            if len(block) < BLOCK:
                block += self._exactly(BLOCK - len(block), f"the header at byte {offset}")
            entry = parse_header(block, offset, self.archive)
            count += 1
            if count > MAX_ENTRIES:
                raise UstarError(f"{self.archive}: more than {MAX_ENTRIES} entries")
            self._current, self._data_left = entry, entry.size
            yield entry

    def data(self, chunk: int = 1 << 20) -> Iterator[bytes]:
        """The current entry's data, in pieces of at most `chunk` bytes."""
        while self._data_left:
            piece = self._read(min(chunk, self._data_left))
            if not piece:
                name = self._current.name if self._current else "?"
                raise UstarError(
                    f"{self.archive}: the file ends inside the data of {name!r} (truncated)"
                )
            self._data_left -= len(piece)
            yield piece

    def _finish_entry(self) -> None:
        entry = self._current
        if entry is None:
            return
        seek = getattr(self.stream, "seek", None)
        if seek is not None and self._data_left:
            self.position = seek(self.position + self._data_left)
            self._data_left = 0
        for _ in self.data():
            pass
        padding = self._exactly(-entry.size % BLOCK, f"the padding of {entry.name!r}")
        if padding.strip(b"\x00"):
            raise UstarError(
                f"{self.archive}: entry {entry.name!r} (header at byte {entry.offset}): the "
                "padding after its data is not zeros (bytes past the entry's size)"
            )
        self._current = None

    def _check_end(self, first: bytes, offset: int) -> None:
        """Two zero blocks, then only zeros to the end of the file."""
        second = self._read(BLOCK)
        if len(first) < BLOCK or len(second) < BLOCK:
            raise UstarError(
                f"{self.archive}: the file ends at byte {self.position} without the two zero "
                "blocks that end an archive (truncated)"
            )
        if second.strip(b"\x00"):
            raise UstarError(
                f"{self.archive}: at byte {offset}: expected two zero blocks (the end of the "
                "archive) or a header"
            )
        while chunk := self._read(1 << 20):
            if stripped := chunk.lstrip(b"\x00"):
                at = self.position - len(stripped)
                raise UstarError(
                    f"{self.archive}: data after the end of the archive at byte {at} (expected "
                    "only zero padding); an entry there would be invisible to the verifier"
                )


def read_index(stream: IO[bytes], archive: str) -> list[UstarEntry]:
    """Every entry of a seekable tar, headers only: the data is skipped, its padding checked."""
    return list(UstarReader(stream, archive).entries())


class UstarWriter:
    """Writes entries in the one form `UstarReader` accepts: regular files, mode 0644, owner
    0:0, one fixed mtime, no user or group names; then the end blocks, padded to a record as
    Python's tarfile pads them, so the same entries always give the same bytes."""

    def __init__(self, out: Writable, *, mtime: int) -> None:
        self.out, self.mtime = out, mtime
        self.written = 0

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.written += len(data)

    def header(self, name: str, size: int) -> bytes:
        if not _NAME.fullmatch(name.encode()) or len(name) > 100 or name.endswith("/"):
            raise UstarError(f"entry name {name!r} does not fit a plain ustar header")
        if size > MAX_ENTRY_SIZE:
            raise UstarError(
                f"entry {name}: {size} bytes; a plain ustar entry holds at most "
                f"{MAX_ENTRY_SIZE} bytes (8 GiB - 1)"
            )
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = size, self.mtime, 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info.tobuf(tarfile.USTAR_FORMAT, "ascii", "strict")

    def add(self, name: str, data: bytes) -> None:
        self._write(self.header(name, len(data)))
        self._write(data + b"\x00" * (-len(data) % BLOCK))

    def add_stream(
        self,
        name: str,
        size: int,
        pieces: Iterable[bytes],
        *,
        check: Callable[[], None],
    ) -> None:
        """Header, then `pieces` (exactly `size` bytes); the last piece is written only once
        `check` returned — when it raises, the output stops short of this entry's end."""
        self._write(self.header(name, size))
        held, count = b"", 0
        for piece in pieces:
            if held:
                self._write(held)
            held = piece
            count += len(piece)
        if count != size:
            raise UstarError(f"entry {name}: {count} bytes read, {size} expected")
        check()
        self._write(held + b"\x00" * (-size % BLOCK))

    def close(self) -> None:
        end = 2 * BLOCK
        self._write(b"\x00" * (end + -(self.written + end) % RECORD))
