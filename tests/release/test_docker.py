"""What `load` hands Docker: a tar it writes itself from the entries verify checked (the same
bytes as the bundle's tar for a bundle this tool wrote), cut short inside an entry when the
bundle changed after verify; and the comparison of engine image IDs with `config_digest`.
The runs against a real engine are in tests/e2e_docker/test_release_docker.py; here a `docker`
first on PATH only keeps what it is given on stdin."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from release.archive import ArchiveError, write_verified_images_tar
from release.cli import main
from release.docker import DockerError, InspectedImage, check_image_ids
from release.verify import verify_bundle
from tests.release.synthetic import VERSION


@pytest.fixture
def bundle(signed_bundle: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(signed_bundle, copy)
    return copy


@pytest.fixture
def docker_stdin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `docker` that writes down its arguments, keeps its stdin, and fails (no engine)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    kept = tmp_path / "docker-stdin"
    script = folder / "docker"
    script.write_text(f'#!/bin/sh\necho "$@" >> {kept}.args\ncat > {kept}\nexit 1\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return kept


def _layer_offset(tar_path: Path) -> tuple[int, int]:
    """The data offset and size of the last entry (a layer) of an images tar."""
    with tarfile.open(tar_path) as tar:
        last = tar.getmembers()[-1]
    return last.offset_data, last.size


def test_load_pipes_the_tar_it_wrote_from_the_verified_entries(
    bundle: Path,
    keys: tuple[Path, Path, Path],
    docker_stdin: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    images_tar = bundle / f"modelforge-{VERSION}-images.tar"

    code = main(["load", str(bundle), "--key", str(keys[1])])

    assert code == 1
    assert "`docker image load` failed (exit 1)" in capsys.readouterr().err
    assert docker_stdin.with_suffix(".args").read_text() == "image load\n"  # no path: stdin
    # The bundle's tar was written by this tool: the stream is byte for byte the same.
    assert docker_stdin.read_bytes() == images_tar.read_bytes()


def test_stream_from_a_tar_with_more_than_verify_used_holds_only_what_it_checked(
    bundle: Path, keys: tuple[Path, Path, Path]
) -> None:
    verified = verify_bundle(bundle, keys[1])
    out = io.BytesIO()

    write_verified_images_tar(verified.images_tar, verified.images, out)

    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        names = tar.getnames()
    assert names[0] == "manifest.json"
    assert len(names) == 1 + 3 + 4  # manifest, three configs, base + three application layers
    assert (
        hashlib.sha256(out.getvalue()).digest()
        == hashlib.sha256(verified.images_tar.read_bytes()).digest()
    )


def test_a_layer_changed_after_verify_cuts_the_stream_inside_that_layer(
    bundle: Path, keys: tuple[Path, Path, Path]
) -> None:
    verified = verify_bundle(bundle, keys[1])
    offset, size = _layer_offset(verified.images_tar)
    with verified.images_tar.open("r+b") as handle:  # the same length, one byte flipped
        handle.seek(offset + size - 1)
        last = handle.read(1)
        handle.seek(offset + size - 1)
        handle.write(bytes([last[0] ^ 0x01]))
    out = io.BytesIO()

    with pytest.raises(ArchiveError, match="changed since it was verified"):
        write_verified_images_tar(verified.images_tar, verified.images, out)

    written = out.getvalue()
    assert len(written) < offset + size  # the layer's last bytes never went out
    with pytest.raises(tarfile.ReadError), tarfile.open(fileobj=io.BytesIO(written)) as tar:
        for member in tar:  # a reader that gets this stream fails inside the layer
            stream = tar.extractfile(member)
            if stream is not None:
                stream.read()


def test_a_config_changed_after_verify_stops_the_stream_before_any_entry(
    bundle: Path, keys: tuple[Path, Path, Path]
) -> None:
    verified = verify_bundle(bundle, keys[1])
    config = verified.images[1].config_entry
    with tarfile.open(verified.images_tar) as tar:
        member = tar.getmember(config)
    with verified.images_tar.open("r+b") as handle:
        handle.seek(member.offset_data + 2)
        handle.write(b"X")
    out = io.BytesIO()

    with pytest.raises(ArchiveError, match=f"config {config}: expected sha256:.*found sha256:"):
        write_verified_images_tar(verified.images_tar, verified.images, out)
    assert out.getvalue() == b""


def test_load_refuses_a_tar_changed_after_verify_and_the_load_is_stopped(
    bundle: Path, keys: tuple[Path, Path, Path], docker_stdin: Path
) -> None:
    from release.docker import load

    verified = verify_bundle(bundle, keys[1])
    offset, size = _layer_offset(verified.images_tar)
    with verified.images_tar.open("r+b") as handle:
        handle.seek(offset)
        handle.write(b"\xff")

    with pytest.raises(DockerError, match="changed since it was verified.*the load was stopped"):
        load(verified, say=lambda line: None)
    # Killed at once: it may not even have started keeping its stdin.
    kept = docker_stdin.read_bytes() if docker_stdin.exists() else b""
    assert len(kept) < offset + size


def _inspected(tag: str, image_id: str) -> InspectedImage:
    return InspectedImage(tag, image_id, (), "amd64", "linux", {})


def test_image_ids_must_be_the_config_digests(bundle: Path, keys: tuple[Path, Path, Path]) -> None:
    manifest = verify_bundle(bundle, keys[1]).manifest
    found = [_inspected(e.tag, str(e.config_digest)) for e in manifest.images.values()]
    check_image_ids(manifest, found)

    agent = manifest.images["modelforge-node-agent"]
    found[1] = _inspected(agent.tag, "sha256:" + "e" * 64)
    with pytest.raises(DockerError) as raised:
        check_image_ids(manifest, found)
    assert str(raised.value) == (
        f"modelforge-node-agent: image ID expected {agent.config_digest} (config_digest), found "
        f"sha256:{'e' * 64}; the engine holds another config under {agent.tag}"
    )


def test_a_bundle_that_cannot_be_read_again_stops_the_load_and_reaps_docker(
    bundle: Path, keys: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, only an ArchiveError stopped the load: an OSError re-reading the bundle (here the
    images tar removed after verify) escaped as itself, and `docker image load` was left running
    and unreaped."""
    from release.docker import load

    folder = tmp_path / "waiting-bin"
    folder.mkdir()
    script = folder / "docker"  # a load that waits, as Docker does for the rest of its stdin
    script.write_text("#!/bin/sh\nexec sleep 120\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    verified = verify_bundle(bundle, keys[1])
    verified.images_tar.unlink()

    with pytest.raises(DockerError) as raised:
        load(verified, say=lambda line: None)

    message = str(raised.value)
    assert f"cannot read {verified.images_tar}" in message
    assert "the load was stopped" in message and "verify the bundle again" in message
    # Killed and reaped: no child of this process left, running or a zombie.
    assert _children_named({"docker", "sleep"}) == []


def _children_named(names: set[str]) -> list[tuple[int, str, str]]:
    """This process's children (pid, name, state) with one of `names`, zombies included."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # ended meanwhile
        name = text[text.index("(") + 1 : text.rindex(")")]
        state, parent = text[text.rindex(")") + 2 :].split()[:2]
        if int(parent) == os.getpid() and name in names:
            found.append((int(stat.parent.name), name, state))
    return found
