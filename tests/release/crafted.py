"""Crafted images tars: the encodings two tar readers may read differently, written byte by byte.

Each variant rewrites a bundle's images tar (and, where the attack needs it, its release
manifest) so that, once SHA256SUMS is rendered and signed again with the bundle's own key, only
the images tar's reading can refuse it. The three hidden-payload variants are the bypass of
issue 24: Python's `tarfile` reads an entry as a regular file (a layer whose SHA-256 is in the
config and the release manifest) where Go's `archive/tar`, which `docker image load` uses, sees
a directory without data and reads that "layer" as more entries: a second `manifest.json` that
points the node agent's tag at another config (uid 0, another command).

Works on any bundle `write_images_tar` wrote (the synthetic one of the unit tests, the real one
of `make e2e`), streaming the untouched entries, so a real bundle's layers never sit in memory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from modelforge_contracts.release_manifest import MANIFEST_FILE as RELEASE_MANIFEST

BLOCK = 512
RECORD = 20 * BLOCK
NODE_AGENT = "modelforge-node-agent"
TAR_MANIFEST = "manifest.json"


def octal(value: int, width: int) -> bytes:
    return b"%0*o\x00" % (width - 1, value)


def header(
    name: bytes,
    size: int,
    *,
    typeflag: bytes = b"0",
    linkname: bytes = b"",
    magic: bytes = b"ustar\x0000",
    prefix: bytes = b"",
    size_field: bytes | None = None,
    signed_checksum: bool = False,
) -> bytes:
    """One 512-byte tar header as Python's and Go's writers lay it out, checksum included."""
    block = bytearray(BLOCK)
    block[0:100] = name.ljust(100, b"\x00")[:100]
    block[100:108] = octal(0o644, 8)
    block[108:116] = octal(0, 8)
    block[116:124] = octal(0, 8)
    block[124:136] = size_field if size_field is not None else octal(size, 12)
    block[136:148] = octal(1_700_000_000, 12)
    block[148:156] = b" " * 8
    block[156:157] = typeflag
    block[157:257] = linkname.ljust(100, b"\x00")
    block[257:265] = magic
    block[329:337] = octal(0, 8)
    block[337:345] = octal(0, 8)
    block[345:500] = prefix.ljust(155, b"\x00")
    if signed_checksum:
        checksum = sum(b - 256 if b > 127 else b for b in block)
    else:
        checksum = sum(block)
    block[148:156] = b"%06o\x00 " % checksum
    return bytes(block)


def pad(data: bytes, filler: bytes = b"\x00") -> bytes:
    missing = -len(data) % BLOCK
    return data + (filler * missing)[:missing]


def entry(name: str, data: bytes, **fields: Any) -> bytes:
    """Header, data and zero padding of one regular file (or what `fields` make of it)."""
    return header(name.encode(), len(data), **fields) + pad(data)


def pax_record(keyword: str, value: str) -> bytes:
    body = f" {keyword}={value}\n".encode()
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


# -- the genuine tar, entry by entry ------------------------------------------------------------


def _members(path: Path) -> list[tarfile.TarInfo]:
    with tarfile.open(path) as tar:
        return tar.getmembers()


def _raw(path: Path, member: tarfile.TarInfo) -> Iterator[bytes]:
    """The raw bytes of one member: its header(s), data and padding, streamed."""
    end = member.offset_data + member.size + (-member.size % BLOCK)
    with path.open("rb") as handle:
        handle.seek(member.offset)
        left = end - member.offset
        while left:
            chunk = handle.read(min(left, 1 << 20))
            left -= len(chunk)
            yield chunk


def _read(path: Path, name: str) -> bytes:
    with tarfile.open(path) as tar:
        stream = tar.extractfile(name)
        assert stream is not None
        return stream.read()


def _write(path: Path, pieces: Iterator[bytes]) -> None:
    """`pieces`, then the two zero blocks and padding to a whole record, as tarfile writes."""
    written = 0
    partial = path.with_name(path.name + ".crafted")
    with partial.open("wb") as out:
        for piece in pieces:
            out.write(piece)
            written += len(piece)
        end = BLOCK * 2
        end += -(written + end) % RECORD
        out.write(b"\x00" * end)
    partial.replace(path)


def _images_tar(bundle: Path) -> Path:
    (tar,) = bundle.glob("modelforge-*-images.tar")
    return tar


def rewrite(
    bundle: Path,
    replace: Callable[[tarfile.TarInfo, Path], bytes | None],
    *,
    append: bytes = b"",
) -> None:
    """Copy the images tar; where `replace` returns bytes, they stand for that member."""
    path = _images_tar(bundle)
    source = path.with_name(path.name + ".source")
    shutil.copyfile(path, source)

    def pieces() -> Iterator[bytes]:
        for member in _members(source):
            crafted = replace(member, source)
            if crafted is None:
                yield from _raw(source, member)
            else:
                yield crafted
        yield append

    try:
        _write(path, pieces())
    finally:
        source.unlink()


def _manifest_entry_with(member_name: str, **fields: Any) -> Callable[[Path], None]:
    """manifest.json written again under another encoding of its header (same name, same data)."""

    def apply(bundle: Path) -> None:
        def replace(member: tarfile.TarInfo, source: Path) -> bytes | None:
            if member.name != TAR_MANIFEST:
                return None
            return entry(member_name, _read(source, TAR_MANIFEST), **fields)

        rewrite(bundle, replace)

    return apply


def _before_manifest(prefix: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    """manifest.json preceded by the header(s) `prefix` writes for its data."""

    def apply(bundle: Path) -> None:
        def replace(member: tarfile.TarInfo, source: Path) -> bytes | None:
            if member.name != TAR_MANIFEST:
                return None
            data = _read(source, TAR_MANIFEST)
            return prefix(data) + entry(TAR_MANIFEST, data)

        rewrite(bundle, replace)

    return apply


def _gnu_long_name(data: bytes) -> bytes:
    name = TAR_MANIFEST.encode() + b"\x00"
    return header(b"././@LongLink", len(name), typeflag=b"L") + pad(name)


def _gnu_long_link(data: bytes) -> bytes:
    link = b"manifest.json\x00"
    return header(b"././@LongLink", len(link), typeflag=b"K") + pad(link)


def _pax(typeflag: bytes) -> Callable[[bytes], bytes]:
    def write(data: bytes) -> bytes:
        records = pax_record("path", TAR_MANIFEST)
        return header(b"PaxHeaders/manifest.json", len(records), typeflag=typeflag) + pad(records)

    return write


def _directory_with_data(bundle: Path) -> None:
    """A directory entry whose size covers a second manifest.json: both readers skip no data
    for a directory and read it as the next header, but the header says there is some."""

    def replace(member: tarfile.TarInfo, source: Path) -> bytes | None:
        if member.name != TAR_MANIFEST:
            return None
        data = _read(source, TAR_MANIFEST)
        hidden = entry(TAR_MANIFEST + "2", data)
        return entry(TAR_MANIFEST, data) + header(b"etc/", len(hidden), typeflag=b"5") + hidden

    rewrite(bundle, replace)


def _garbage_in_padding(bundle: Path) -> None:
    """manifest.json's padding after its data (past its size) holding a tar header, not zeros."""

    def replace(member: tarfile.TarInfo, source: Path) -> bytes | None:
        if member.name != TAR_MANIFEST:
            return None
        data = _read(source, TAR_MANIFEST)
        filler = header(b"evil", 0)[: -len(data) % BLOCK]
        return header(TAR_MANIFEST.encode(), len(data)) + data + filler

    rewrite(bundle, replace)


def _size_field(kind: str) -> Callable[[Path], None]:
    """manifest.json's size written in base-256 (both readers accept it, ustar does not), or
    with a NUL inside the octal digits (Python stops at the NUL, Go trims only the ends)."""

    def apply(bundle: Path) -> None:
        def replace(member: tarfile.TarInfo, source: Path) -> bytes | None:
            if member.name != TAR_MANIFEST:
                return None
            data = _read(source, TAR_MANIFEST)
            if kind == "base-256":
                field = b"\x80" + len(data).to_bytes(11, "big")
            else:
                digits = b"%011o\x00" % len(data)
                field = digits[:5] + b"\x00" + digits[6:]
            return header(TAR_MANIFEST.encode(), len(data), size_field=field) + pad(data)

        rewrite(bundle, replace)

    return apply


def _data_after_the_end_blocks(bundle: Path) -> None:
    rewrite(bundle, lambda member, source: None)
    path = _images_tar(bundle)
    with path.open("ab") as handle:
        handle.write(entry(TAR_MANIFEST, b"[]") + b"\x00" * (2 * BLOCK))


# -- the hidden payload: what Go reads as entries and Python as a layer's data ------------------


def _hidden_payload(bundle: Path, wrap: Callable[[str, bytes], bytes]) -> None:
    """The node agent's tag pointed, for Go only, at another config, through an entry `wrap`
    encodes: Python sees a regular file (a layer, listed in the node agent's visible config and
    the release manifest), Go a directory followed by a second manifest.json and that config."""
    path = _images_tar(bundle)
    manifest = json.loads(_read(path, TAR_MANIFEST))
    (position,) = [i for i, m in enumerate(manifest) if m["RepoTags"][0].startswith(NODE_AGENT)]
    agent = manifest[position]
    original_config = agent["Config"]
    config = json.loads(_read(path, original_config))

    evil = json.loads(json.dumps(config))
    evil["config"]["User"] = "0:0"
    evil["config"]["Cmd"] = ["python3", "-c", "print('not the release')"]
    evil_bytes = json.dumps(evil, sort_keys=True).encode()
    evil_name = hashlib.sha256(evil_bytes).hexdigest() + ".json"
    hidden_manifest = json.loads(json.dumps(manifest))
    hidden_manifest[position]["Config"] = evil_name
    payload = entry(TAR_MANIFEST, json.dumps(hidden_manifest).encode()) + entry(
        evil_name, evil_bytes
    )
    hidden_layer = "sha256:" + hashlib.sha256(payload).hexdigest()
    layer_name = hidden_layer.removeprefix("sha256:") + "/layer.tar"

    visible = json.loads(json.dumps(config))
    visible["rootfs"]["diff_ids"].append(hidden_layer)
    visible_bytes = json.dumps(visible, sort_keys=True).encode()
    visible_digest = "sha256:" + hashlib.sha256(visible_bytes).hexdigest()
    visible_name = visible_digest.removeprefix("sha256:") + ".json"
    agent["Config"] = visible_name
    agent["Layers"].append(layer_name)

    def replace(member: tarfile.TarInfo, source: Path) -> bytes | None:
        if member.name == TAR_MANIFEST:
            return entry(TAR_MANIFEST, json.dumps(manifest).encode())
        if member.name == original_config:
            return entry(visible_name, visible_bytes)
        return None

    rewrite(bundle, replace, append=wrap(layer_name, payload))

    release = json.loads((bundle / RELEASE_MANIFEST).read_text())
    release["images"][NODE_AGENT]["config_digest"] = visible_digest
    release["images"][NODE_AGENT]["rootfs_layers"].append(hidden_layer)
    (bundle / RELEASE_MANIFEST).write_text(json.dumps(release, indent=2, sort_keys=True) + "\n")


def _long_name_ending_in_slash(layer_name: str, payload: bytes) -> bytes:
    """GNU long name `<layer>/`, then a typeflag-NUL header with the plain name: Python decides
    "regular file" from the raw name, Go "directory" from the long one."""
    long_name = (layer_name + "/").encode() + b"\x00"
    return (
        header(b"././@LongLink", len(long_name), typeflag=b"L")
        + pad(long_name)
        + header(layer_name.encode(), len(payload), typeflag=b"\x00")
        + pad(payload)
    )


def _long_name_past_its_size(layer_name: str, payload: bytes) -> bytes:
    """A GNU long name whose size ends after `<digest>/`: Go reads that many bytes (a directory),
    Python the whole block up to its first NUL (`<digest>/layer.tar`, a file)."""
    long_name = layer_name.encode() + b"\x00"
    size = len(layer_name.split("/")[0]) + 1
    return (
        header(b"././@LongLink", size, typeflag=b"L")
        + pad(long_name)
        + header(b"x", len(payload), typeflag=b"\x00")
        + pad(payload)
    )


def _pax_path_past_its_size(layer_name: str, payload: bytes) -> bytes:
    """A PAX header whose size covers `path=<digest>/` (Go: a directory) followed, inside the
    same block, by `path=<digest>/layer.tar` (Python parses it too: a file)."""
    first = pax_record("path", layer_name.split("/")[0] + "/")
    second = pax_record("path", layer_name)
    return (
        header(b"PaxHeaders/x", len(first), typeflag=b"x")
        + pad(first + second)
        + header(b"x", len(payload), typeflag=b"\x00")
        + pad(payload)
    )


def _hide(wrap: Callable[[str, bytes], bytes]) -> Callable[[Path], None]:
    return lambda bundle: _hidden_payload(bundle, wrap)


#: The three bypasses of issue 24: a layer to Python, a directory and more entries to Go.
HIDDEN_PAYLOAD = (
    "GNU long name ending in / before a typeflag-NUL entry",
    "GNU long name whose data runs past its size",
    "PAX path after the PAX header's size",
)

#: variant -> (alteration of a bundle, words the refusal names). Re-sign after the alteration.
VARIANTS: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "GNU long name ending in / before a typeflag-NUL entry": (
        _hide(_long_name_ending_in_slash),
        ["a GNU long name"],
    ),
    "GNU long name whose data runs past its size": (
        _hide(_long_name_past_its_size),
        ["a GNU long name"],
    ),
    "PAX path after the PAX header's size": (
        _hide(_pax_path_past_its_size),
        ["a PAX extended header"],
    ),
    "typeflag NUL regular file": (
        _manifest_entry_with(TAR_MANIFEST, typeflag=b"\x00"),
        ["'manifest.json'", "typeflag NUL"],
    ),
    "GNU long name": (_before_manifest(_gnu_long_name), ["a GNU long name"]),
    "GNU long link name": (_before_manifest(_gnu_long_link), ["a GNU long link name"]),
    "PAX extended header": (_before_manifest(_pax(b"x")), ["a PAX extended header"]),
    "PAX global header": (_before_manifest(_pax(b"g")), ["a PAX global header"]),
    "file whose name ends in /": (
        _manifest_entry_with(TAR_MANIFEST + "/"),
        ["'manifest.json/'", "ends in '/'"],
    ),
    "base-256 size": (_size_field("base-256"), ["'manifest.json'", "size"]),
    "size with a NUL inside": (_size_field("nul"), ["'manifest.json'", "size"]),
    "checksum valid only as signed bytes": (
        _manifest_entry_with("manifest.json", signed_checksum=True, prefix=b"\xe9"),
        ["checksum"],
    ),
    "ustar prefix field": (
        _manifest_entry_with(TAR_MANIFEST, prefix=b"."),
        ["'manifest.json'", "prefix"],
    ),
    "GNU magic": (
        _manifest_entry_with(TAR_MANIFEST, magic=b"ustar  \x00"),
        ["'manifest.json'", "magic"],
    ),
    "directory whose size hides an entry": (
        _directory_with_data,
        ["'etc/'", "directory of size"],
    ),
    "a header in the padding after an entry's data": (
        _garbage_in_padding,
        ["'manifest.json'", "padding"],
    ),
    "entries after the end-of-archive blocks": (
        _data_after_the_end_blocks,
        ["data after the end of the archive"],
    ),
}
