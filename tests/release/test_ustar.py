"""The images tar's header format, both ways: what `UstarWriter` writes, `UstarReader` and
Python's tarfile read alike; what it refuses beyond the crafted corpus of test_bundle_flow."""

from __future__ import annotations

import io
import tarfile

import pytest

from release._ustar import (
    BLOCK,
    MAX_ENTRIES,
    RECORD,
    UstarError,
    UstarReader,
    UstarWriter,
    read_index,
)
from tests.release.crafted import entry


class _Unseekable:
    """A stream without seek, as verify's single pass reads the file."""

    def __init__(self, raw: bytes) -> None:
        self.stream = io.BytesIO(raw)

    def read(self, size: int = -1) -> bytes:
        return self.stream.read(size)


def _written(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    writer = UstarWriter(out, mtime=1_700_000_000)
    for name, data in files.items():
        writer.add(name, data)
    writer.close()
    return out.getvalue()


def test_what_the_writer_writes_both_readers_read_alike() -> None:
    files = {"manifest.json": b"[]", "a" * 64 + "/layer.tar": b"x" * 1000, "empty": b""}
    raw = _written(files)

    reader = UstarReader(io.BytesIO(raw), "t.tar")
    found = {}
    for item in reader.entries():
        found[item.name] = b"".join(reader.data())
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        python = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]

    assert found == python == files
    assert len(raw) % RECORD == 0
    assert [e.offset for e in read_index(io.BytesIO(raw), "t.tar")] == [0, 1024, 2560]


@pytest.mark.parametrize("name", ["ünicode", "a b", "x/", "a" * 101])
def test_the_writer_refuses_a_name_beyond_plain_ustar(name: str) -> None:
    with pytest.raises(UstarError, match="does not fit a plain ustar header"):
        UstarWriter(io.BytesIO(), mtime=0).add(name, b"")


def test_one_zero_block_then_the_end_of_the_file_is_truncated() -> None:
    raw = entry("manifest.json", b"[]") + b"\x00" * BLOCK

    with pytest.raises(UstarError, match="without the two zero blocks .* \\(truncated\\)"):
        read_index(io.BytesIO(raw), "t.tar")


def test_a_header_after_one_zero_block_is_refused() -> None:
    raw = entry("manifest.json", b"[]") + b"\x00" * BLOCK + entry("evil", b"x") + b"\x00" * RECORD

    with pytest.raises(UstarError, match="expected two zero blocks"):
        read_index(io.BytesIO(raw), "t.tar")


def test_the_number_of_entries_is_bounded() -> None:
    raw = b"".join(entry(f"d{index}", b"") for index in range(MAX_ENTRIES + 1)) + b"\0" * RECORD

    with pytest.raises(UstarError, match=f"more than {MAX_ENTRIES} entries"):
        read_index(io.BytesIO(raw), "t.tar")


def test_data_cut_short_is_truncated_whether_read_or_skipped() -> None:
    raw = entry("layer.tar", b"y" * 5000)[:3000]

    with pytest.raises(UstarError, match="truncated"):
        read_index(io.BytesIO(raw), "t.tar")
    reader = UstarReader(_Unseekable(raw), "t.tar")
    with pytest.raises(UstarError, match="inside the data of 'layer.tar' \\(truncated\\)"):
        for _ in reader.entries():
            b"".join(reader.data())
