"""Deterministic bytes for release artefacts: tar entries and canonical JSON.

Every entry gets one fixed mtime, numeric owners (0:0 unless told otherwise), a mode decided
here (directories 0755, files 0644 or 0755 by their executable bits, unless told
otherwise), no user or group names and no atime/ctime/xattr records; a tree is written in the
byte order of its UTF-8 path names. The same input therefore always gives the same bytes, and the
same sha256, whatever the umask, the locale or the file system encoding of the build host.

This module must never read the clock, follow a symlink, or record a host user, group, mode or
path.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tarfile
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from release.errors import ReleaseError

CHUNK = 1 << 20


class UnwritableEntryError(ReleaseError, ValueError):
    """A tree holds something a layer cannot carry (a socket, a fifo, a device); still a
    ValueError, as it was before the release tool had one error class."""


def canonical_json(value: object) -> bytes:
    """Sorted keys, compact separators, UTF-8: the byte form every digest is taken over."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def rfc3339(epoch: int) -> str:
    """SOURCE_DATE_EPOCH as the UTC timestamp written into configs, labels and SBOMs."""
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def sha256_stream(stream: IO[bytes]) -> str:
    """The hex sha256 of what is left in `stream`, read in constant memory."""
    digest = hashlib.sha256()
    while chunk := stream.read(CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    with path.open("rb") as stream:
        return sha256_stream(stream)


def open_writer(path: Path) -> tarfile.TarFile:
    # Names are encoded as UTF-8 whatever the locale (bytes that are not UTF-8 stay as they are).
    return tarfile.open(
        path, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape"
    )


def _info(name: str, *, mtime: int, mode: int, uid: int = 0, gid: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime = mtime  # an int: tarfile then writes no pax mtime record
    info.mode = mode
    info.uid, info.gid = uid, gid
    info.uname = info.gname = ""
    return info


def write_tree(
    root: Path,
    out: Path,
    *,
    mtime: int,
    owners: Mapping[str, tuple[int, int]] | None = None,
    modes: Mapping[str, int] | None = None,
) -> str:
    """Write everything below `root` as an image layer tar at `out`; return its "sha256:<hex>".

    Paths in the tar are relative to `root` ("usr/bin/python3"). `owners` maps a relative path to
    the numeric (uid, gid) it gets; everything else is 0:0. `modes` maps a relative path to its
    mode (/tmp's 1777, /root's 0700); everything else is normalised — directories 0755, files
    0755 if anyone may execute them, else 0644 — so neither the host's umask nor a special
    bit (setuid, setgid, sticky) leaks into the layer. Hard links inside the tree stay hard links
    (the first path in sorted order carries the data). Device nodes, fifos and sockets are
    refused: a layer must not carry them.
    """
    owners = owners or {}
    modes = modes or {}
    base = os.fsencode(root)
    # Walked and sorted as bytes, named as UTF-8: no dependence on locale or file system encoding.
    paths = sorted(
        (os.path.relpath(os.path.join(parent, name), base), os.path.join(parent, name))
        for parent, dirs, files in os.walk(base)
        for name in (*dirs, *files)
    )
    first_link: dict[tuple[int, int], str] = {}
    with open_writer(out) as tar:
        for relative, absolute in paths:
            arcname = relative.decode("utf-8", "surrogateescape")
            st = os.lstat(absolute)
            if arcname in modes:
                mode = modes[arcname]
            elif stat.S_ISDIR(st.st_mode) or st.st_mode & 0o111:
                mode = 0o755
            else:
                mode = 0o644
            uid, gid = owners.get(arcname, (0, 0))
            info = _info(arcname, mtime=mtime, mode=mode, uid=uid, gid=gid)
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif stat.S_ISLNK(st.st_mode):
                info.type = tarfile.SYMTYPE
                info.mode = 0o777
                info.linkname = os.readlink(absolute).decode("utf-8", "surrogateescape")
                tar.addfile(info)
            elif stat.S_ISREG(st.st_mode):
                inode = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and inode in first_link:
                    info.type = tarfile.LNKTYPE
                    info.linkname = first_link[inode]
                    tar.addfile(info)
                    continue
                first_link[inode] = arcname
                info.size = st.st_size
                with open(absolute, "rb") as stream:
                    tar.addfile(info, stream)
            else:
                name = os.fsdecode(absolute)
                raise UnwritableEntryError(f"{name}: not a file, directory or symlink")
    return "sha256:" + sha256_file(out)
