"""Artifact downloads with HTTP range requests (RFC 9110, section 14): one response for both
download routes, so an interrupted transfer resumes.

The `Range` header is judged here, before the file is sent: a malformed one is refused with
`RANGE_INVALID` (400), one whose ranges all start past the end with `RANGE_NOT_SATISFIABLE`
(416, with `Content-Range: bytes */<length>`), both with the usual error body. A range unit
other than `bytes` is ignored, as the RFC asks, and the whole file is sent. The file response
is then given only the satisfiable ranges, written out in full, so it never answers by itself.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import FileResponse
from starlette.types import Receive, Scope, Send

from control_plane.errors import ModelForgeError, NotFound, RangeNotSatisfiable

#: More ranges than this in one request are refused (a client resuming a download asks for one).
MAX_RANGES = 100
_INT_RANGE = re.compile(r"([0-9]{1,30})-([0-9]{0,30})")
_SUFFIX_RANGE = re.compile(r"-([0-9]{1,30})")


def artifact_response(path: Path, *, digest: str, headers: Headers) -> FileResponse:
    """The artifact at `path`, whole (200) or the ranges the request's `Range` header asks for
    (206); raises `RANGE_INVALID` or `RangeNotSatisfiable` for a header it cannot serve."""
    header = headers.get("range")
    try:
        size = path.stat().st_size
    except FileNotFoundError:  # removed since it was looked up
        raise NotFound(
            "No artifact with this digest.",
            "Upload it first (POST /api/v1/artifacts).",
            code="ARTIFACT_NOT_FOUND",
        ) from None
    ranges = None if header is None else satisfiable_ranges(header, size)
    return _ArtifactFile(
        path,
        ranges=ranges,
        media_type="application/octet-stream",
        headers={"X-ModelForge-Digest": digest},
    )


def satisfiable_ranges(header: str, size: int) -> list[tuple[int, int]] | None:
    """The inclusive byte ranges of `header` that lie within a file of `size` bytes, or None
    when the header is to be ignored (another range unit)."""
    unit, equals, spec = header.partition("=")
    if not equals:
        raise _invalid()
    if unit.strip().lower() != "bytes":
        return None
    parts = [part.strip() for part in spec.split(",")]
    parts = [part for part in parts if part]  # empty list elements are allowed, and ignored
    if not parts:
        raise _invalid()
    if len(parts) > MAX_RANGES:
        raise _invalid(f"at most {MAX_RANGES} ranges are served at once")
    ranges: list[tuple[int, int]] = []
    for part in parts:
        if match := _INT_RANGE.fullmatch(part):
            first = int(match.group(1))
            last = int(match.group(2)) if match.group(2) else size - 1
            if match.group(2) and last < first:
                raise _invalid("a range ends before it starts")
            if first < size:
                ranges.append((first, min(last, size - 1)))
        elif match := _SUFFIX_RANGE.fullmatch(part):
            length = int(match.group(1))
            if length > 0 and size > 0:
                ranges.append((max(size - length, 0), size - 1))
        else:
            raise _invalid()
    if not ranges:
        raise RangeNotSatisfiable(
            f"No range of the Range header starts within the artifact ({size} bytes).",
            "Ask for a range that starts before the end of the file (its length is in the "
            "Content-Range header), or send no Range header for the whole file.",
            size=size,
        )
    return ranges


def _invalid(why: str = "") -> ModelForgeError:
    return ModelForgeError(
        "The Range header is not a byte range this control plane can read"
        + (f": {why}." if why else "."),
        "Send `Range: bytes=<first>-<last>` (either bound may be left out, comma-separated for "
        "several ranges), or no Range header for the whole file.",
        code="RANGE_INVALID",
    )


class _ArtifactFile(FileResponse):
    """A file response that sees exactly the ranges judged above (or none), never the raw
    header: Starlette's own answers to a header it dislikes are plain text."""

    def __init__(self, path: Path, *, ranges: list[tuple[int, int]] | None, **kw: Any) -> None:
        super().__init__(path, **kw)
        self._ranges = ranges

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(name, value) for name, value in scope["headers"] if name != b"range"]
        if self._ranges is not None:
            spec = ",".join(f"{first}-{last}" for first, last in self._ranges)
            headers.append((b"range", f"bytes={spec}".encode()))
        await super().__call__({**scope, "headers": headers}, receive, send)
