"""Owner-only files written atomically: keys, tokens, identities, state.

The content goes to a temporary file created with mode 0600 in the same directory (never
readable by anyone else, not even for a moment), is flushed and fsynced, then renamed over the
target — or, with `exclusive=True`, linked to it, so an existing file (a key) is never
clobbered. The directory is fsynced too, so the new name survives a crash.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_private(
    path: Path, content: bytes | str, *, exclusive: bool = False, mode: int = 0o600
) -> None:
    """Write `content` to `path` atomically with `mode` (0600 unless said otherwise).

    Raises `FileExistsError` when `exclusive` and `path` exists; any other failure is the
    `OSError` that caused it, and leaves no temporary file behind.
    """
    data = content.encode() if isinstance(content, str) else content
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        if exclusive:
            os.link(tmp_name, path)  # fails if the name exists: never a silent overwrite
        else:
            os.replace(tmp_name, path)
    finally:
        Path(tmp_name).unlink(missing_ok=True)
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make a rename or link in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
