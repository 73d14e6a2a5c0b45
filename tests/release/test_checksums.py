"""RL-3: SHA256SUMS rendered from the repository's template (readable by `sha256sum -c`)
and verified strictly, streaming, with progress and messages naming file, expected and found."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from release.checksums import (
    CHUNK_SIZE,
    ChecksumEntry,
    ChecksumError,
    SumsFormatError,
    parse_sha256sums,
    render_sha256sums,
    sha256_file,
    verify_sha256sums,
)

TEMPLATE = Path(__file__).resolve().parents[2] / "SHA256SUMS.template"
VERSION = "0.1.0"
BUNDLE_FILES = [
    f"modelforge-{VERSION}-images.tar",
    "release-manifest.json",
    "sbom/modelforge-control-plane.cdx.json",
    "sbom/modelforge-node-agent.cdx.json",
    "sbom/modelforge-runtime-worker.cdx.json",
]
DIGEST_A = "a" * 64


def make_bundle(directory: Path, *, tar_size: int = 1000) -> Path:
    """A bundle directory with every file the template lists, each with distinct content."""
    for name in BUNDLE_FILES:
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".tar"):
            path.write_bytes(bytes(i % 251 for i in range(tar_size)))
        else:
            path.write_text(f'{{"file": "{name}"}}\n')
    return directory


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def render(directory: Path) -> str:
    return render_sha256sums(TEMPLATE, directory, VERSION)


# --- rendering --------------------------------------------------------------------------------


def test_render_lists_every_bundle_file_in_sha256sum_format(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    sums = render(bundle)
    assert sums == "".join(f"{sha256_of(bundle / name)}  {name}\n" for name in BUNDLE_FILES)


def test_sha256sum_c_accepts_the_rendered_file(tmp_path: Path) -> None:
    sha256sum = shutil.which("sha256sum")
    assert sha256sum is not None, "coreutils sha256sum is required"
    bundle = make_bundle(tmp_path)
    (bundle / "SHA256SUMS").write_text(render(bundle))

    result = subprocess.run(
        [sha256sum, "--strict", "-c", "SHA256SUMS"], cwd=bundle, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": OK\n") == len(BUNDLE_FILES)


def test_render_fails_naming_a_file_missing_from_the_bundle(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    (bundle / "sbom/modelforge-node-agent.cdx.json").unlink()
    with pytest.raises(ChecksumError) as caught:
        render(bundle)
    assert str(caught.value) == (
        "listed in SHA256SUMS.template but missing: sbom/modelforge-node-agent.cdx.json"
    )
    assert caught.value.file_name == "sbom/modelforge-node-agent.cdx.json"


@pytest.mark.parametrize("version", ["", "../0.1.0", "0.1.0/x", "-rc1", "0.1 .0"])
def test_render_refuses_a_version_that_is_not_a_plain_string(tmp_path: Path, version: str) -> None:
    with pytest.raises(SumsFormatError, match="is not a plain version string"):
        render_sha256sums(TEMPLATE, make_bundle(tmp_path), version)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("deadbeef  release-manifest.json\n", "line 1: expected '@SHA256@  <path>'"),
        ("# ok\n@SHA256@ release-manifest.json\n", "line 2: expected '@SHA256@  <path>'"),
        ("@SHA256@  @NAME@.json\n", "characters outside"),
        ("@SHA256@  ../etc/passwd\n", "'..' component"),
        ("@SHA256@  a.json\n@SHA256@  a.json\n", "line 2: a.json is listed twice"),
        ("# nothing\n\n", "lists no files"),
    ],
)
def test_malformed_template_is_refused_naming_the_line(
    tmp_path: Path, template: str, message: str
) -> None:
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "release-manifest.json").write_text("{}")
    template_path = tmp_path / "SHA256SUMS.template"
    template_path.write_text(template)
    with pytest.raises(SumsFormatError, match=message):
        render_sha256sums(template_path, tmp_path, VERSION)


# --- verification -----------------------------------------------------------------------------


def test_verify_accepts_an_intact_bundle(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    sums = render(bundle)
    entries = verify_sha256sums(sums, bundle)
    assert [entry.name for entry in entries] == BUNDLE_FILES


def test_flipped_byte_names_the_file_with_expected_and_found(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    sums = render(bundle)
    path = bundle / "sbom/modelforge-control-plane.cdx.json"
    expected = sha256_of(path)
    content = bytearray(path.read_bytes())
    content[3] ^= 0x01
    path.write_bytes(bytes(content))
    found = sha256_of(path)

    with pytest.raises(ChecksumError) as caught:
        verify_sha256sums(sums, bundle)
    assert str(caught.value) == (
        f"sbom/modelforge-control-plane.cdx.json: SHA-256 expected {expected} "
        f"(from SHA256SUMS), found {found}"
    )
    assert caught.value.file_name == "sbom/modelforge-control-plane.cdx.json"


def test_edited_sums_line_is_caught(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    lines = render(bundle).splitlines(keepends=True)
    real = lines[1][:64]
    edited = ("0" if real[0] != "0" else "1") + real[1:]
    lines[1] = edited + lines[1][64:]

    with pytest.raises(ChecksumError) as caught:
        verify_sha256sums("".join(lines), bundle)
    message = str(caught.value)
    assert message.startswith("release-manifest.json: SHA-256 expected ")
    assert f"expected {edited} " in message and message.endswith(f"found {real}")


def test_missing_file_is_its_own_error_before_any_hashing(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    sums = render(bundle)
    (bundle / "sbom/modelforge-runtime-worker.cdx.json").unlink()
    hashed: list[str] = []

    with pytest.raises(ChecksumError) as caught:
        verify_sha256sums(sums, bundle, progress=lambda name, done, total: hashed.append(name))
    assert str(caught.value) == (
        "listed in SHA256SUMS but missing: sbom/modelforge-runtime-worker.cdx.json"
    )
    assert hashed == []  # the 1st-listed, possibly huge, image tar was not hashed first


def test_a_listed_fifo_or_directory_fails_instead_of_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "dir").mkdir()
    for name in ("pipe", "dir"):
        with pytest.raises(ChecksumError, match=f"not a readable regular file: {name}"):
            verify_sha256sums(f"{DIGEST_A}  {name}\n", tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "lists no files"),
        (f"{DIGEST_A} release-manifest.json\n", "line 1: expected"),  # one space
        (f"{DIGEST_A}\trelease-manifest.json\n", "line 1: expected"),
        (f"{DIGEST_A} *release-manifest.json\n", "line 1: expected"),  # binary marker
        (f"{DIGEST_A.upper()}  release-manifest.json\n", "line 1: expected"),
        (f"{DIGEST_A[:63]}  release-manifest.json\n", "line 1: expected"),
        (f"SHA256 (release-manifest.json) = {DIGEST_A}\n", "line 1: expected"),
        (f"{DIGEST_A}  \n", "line 1: expected"),
        (f"{DIGEST_A}  a.json\n\n{DIGEST_A}  b.json\n", "line 2: expected"),  # blank line
        (f"{DIGEST_A}  a.json\r\n", "CR line ends"),
        (f"{DIGEST_A}  /etc/passwd\n", "absolute path"),
        (f"{DIGEST_A}  ../secret\n", "'..' component"),
        (f"{DIGEST_A}  sbom/../../secret\n", "'..' component"),
        (f"{DIGEST_A}  ./a.json\n", "'.' or '..' component"),
        (f"{DIGEST_A}  sbom//a.json\n", "empty"),
        (f"{DIGEST_A}  .hidden\n", "component starting with '.'"),
        (f"{DIGEST_A}  a b.json\n", "characters outside"),
        (f"{DIGEST_A}  a\\b.json\n", "characters outside"),
        (f"{DIGEST_A}  a.json\n{'b' * 64}  a.json\n", "line 2: a.json is listed twice"),
    ],
)
def test_malformed_sums_are_refused_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(SumsFormatError, match=message):
        parse_sha256sums(text)


def test_parse_keeps_order_and_accepts_a_missing_final_newline() -> None:
    text = f"{'b' * 64}  z.json\n{DIGEST_A}  sbom/a.cdx.json"
    assert parse_sha256sums(text) == [
        ChecksumEntry(name="z.json", sha256="b" * 64),
        ChecksumEntry(name="sbom/a.cdx.json", sha256=DIGEST_A),
    ]


# --- streaming and progress -------------------------------------------------------------------


def test_progress_reports_increasing_byte_counts_per_file(tmp_path: Path) -> None:
    tar_size = 2 * CHUNK_SIZE + 12345
    bundle = make_bundle(tmp_path, tar_size=tar_size)
    sums = render(bundle)
    calls: list[tuple[str, int, int]] = []

    verify_sha256sums(sums, bundle, progress=lambda *call: calls.append(call))

    assert [name for name, done, _ in calls if done == 0] == BUNDLE_FILES  # each starts at 0
    tar_calls = [(done, total) for name, done, total in calls if name == BUNDLE_FILES[0]]
    assert tar_calls == [
        (0, tar_size),
        (CHUNK_SIZE, tar_size),
        (2 * CHUNK_SIZE, tar_size),
        (tar_size, tar_size),
    ]
    for name in BUNDLE_FILES:
        done = [d for n, d, _ in calls if n == name]
        assert done == sorted(set(done)), f"{name}: byte counts not strictly increasing"
        assert done[-1] == (bundle / name).stat().st_size


def test_sha256_file_of_an_empty_file_reports_zero_of_zero(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    calls: list[tuple[int, int]] = []
    digest = sha256_file(empty, progress=lambda done, total: calls.append((done, total)))
    assert digest == hashlib.sha256(b"").hexdigest()
    assert calls == [(0, 0)]
