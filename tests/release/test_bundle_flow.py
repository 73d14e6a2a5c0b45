"""The `modelforge-release` commands: bundle, keygen, sign, verify (RL-3) — and the
tamper suite: every altered bundle, and every crafted images tar of `tests.release.crafted`, is
refused by verify and by load (before anything reaches Docker) with a message naming
file/image/field, expected and found. Synthetic images keep this fast; the Docker tests use real
ones."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from modelforge_contracts.release_manifest import MANIFEST_FILE
from release.cli import main
from release.verify import images_tar_name
from tests.release import crafted
from tests.release.synthetic import VERSION, resign

TAR = images_tar_name(VERSION)


def _copy(bundle: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(bundle, target)
    return target


def _verify(bundle: Path, public: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["verify", str(bundle), "--key", str(public)])
    return code, capsys.readouterr().err


def test_a_good_bundle_verifies(
    signed_bundle: Path, keys: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _verify(signed_bundle, keys[1], capsys)
    assert code == 0, err
    assert "verified: signature, checksums, and 3 images of release 0.1.0" in err
    assert f"{TAR}:" in err and "(100%)" in err  # progress was shown
    names = sorted(p.name for p in signed_bundle.iterdir())
    assert names == sorted(
        [TAR, MANIFEST_FILE, "sbom", "SHA256SUMS", "SHA256SUMS.sig", "SHA256SUMS.sigstore.json"]
    )


def _edit_manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:  # type: ignore[type-arg]
    def apply(bundle: Path) -> None:
        data = json.loads((bundle / MANIFEST_FILE).read_text())
        edit(data["images"]["modelforge-node-agent"])
        (bundle / MANIFEST_FILE).write_text(json.dumps(data))

    return apply


def _flip_byte(bundle: Path) -> None:
    tar = bundle / TAR
    data = bytearray(tar.read_bytes())
    data[len(data) // 2] ^= 0x01
    tar.write_bytes(bytes(data))


def _flip_header_byte(bundle: Path) -> None:
    tar = bundle / TAR
    data = bytearray(tar.read_bytes())
    data[3] ^= 0x20  # inside the first entry's name: the tar itself still parses, or not
    tar.write_bytes(bytes(data))


def _edit_sums(bundle: Path) -> None:
    sums = (bundle / "SHA256SUMS").read_text()
    (bundle / "SHA256SUMS").write_text(sums.replace(sums[0], "f" if sums[0] != "f" else "e", 1))


def _wrong_signature(bundle: Path) -> None:
    shutil.copy(bundle / "SHA256SUMS", bundle / "other")
    (bundle / "SHA256SUMS.sig").write_text("MEUCIQDn" + "A" * 80)


Entries = list[tuple[tarfile.TarInfo, bytes]]


def _edit_images_tar(edit: Callable[[Entries], None]) -> Callable[[Path], None]:
    """Rewrite the images tar entry by entry after `edit` changed the list of entries."""

    def apply(bundle: Path) -> None:
        path = bundle / TAR
        with tarfile.open(path) as tar:
            entries = [
                (member, tar.extractfile(member).read() if member.isfile() else b"")  # type: ignore[union-attr]
                for member in tar.getmembers()
            ]
        edit(entries)
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            for member, data in entries:
                member.size = len(data) if member.isfile() else 0
                tar.addfile(member, io.BytesIO(data) if member.isfile() else None)

    return apply


def _entry(
    name: str, data: bytes = b"x", kind: bytes = tarfile.REGTYPE, link: str = ""
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mtime = kind, link, 1_700_000_000
    return info, data


def _add_entries(*added: tuple[tarfile.TarInfo, bytes]) -> Callable[[Path], None]:
    return _edit_images_tar(lambda entries: entries.extend(added))


def _tar_manifest(entries: Entries) -> list[dict]:  # type: ignore[type-arg]
    (data,) = [data for member, data in entries if member.name == "manifest.json"]
    loaded: list[dict] = json.loads(data)  # type: ignore[type-arg]
    return loaded


def _put(entries: Entries, name: str, data: bytes) -> None:
    for index, (member, _) in enumerate(entries):
        if member.name == name:
            entries[index] = (member, data)
            return
    entries.append(_entry(name, data))


def _edit_tar_manifest(edit: Callable[[list[dict], Entries], None]) -> Callable[[Path], None]:  # type: ignore[type-arg]
    def apply(entries: Entries) -> None:
        manifest = _tar_manifest(entries)
        edit(manifest, entries)
        _put(entries, "manifest.json", json.dumps(manifest).encode())

    return _edit_images_tar(apply)


def _shadow_manifest(name: str) -> Callable[[Path], None]:
    """A second manifest.json under a name the engine cleans to `manifest.json`, after the
    real one (the engine keeps the last), tagging the node agent's config as the control plane."""

    def apply(entries: Entries) -> None:
        manifest = _tar_manifest(entries)
        manifest[0]["Config"] = manifest[1]["Config"]
        entries.append(_entry(name, json.dumps(manifest).encode()))

    return _edit_images_tar(apply)


def _replace_config(manifest: list[dict], entries: Entries, new: bytes) -> None:  # type: ignore[type-arg]
    """The node agent's config replaced by `new`, under its own digest."""
    old_name = manifest[1]["Config"]
    new_name = hashlib.sha256(new).hexdigest() + ".json"
    entries[:] = [(m, d) for m, d in entries if m.name != old_name]
    entries.append(_entry(new_name, new))
    manifest[1]["Config"] = new_name


def _swap_config(manifest: list[dict], entries: Entries) -> None:  # type: ignore[type-arg]
    """The node agent's config replaced by another one (same layers and labels, one more
    environment variable); the release manifest is unchanged."""
    (old,) = [data for member, data in entries if member.name == manifest[1]["Config"]]
    config = json.loads(old)
    config["config"]["Env"] = ["LD_PRELOAD=/opt/evil.so"]
    _replace_config(manifest, entries, json.dumps(config, sort_keys=True).encode())


def _swap_manifest_entries(bundle: Path) -> None:
    data = json.loads((bundle / MANIFEST_FILE).read_text())
    images = data["images"]
    images["modelforge-control-plane"], images["modelforge-node-agent"] = (
        images["modelforge-node-agent"],
        images["modelforge-control-plane"],
    )
    (bundle / MANIFEST_FILE).write_text(json.dumps(data))


def _data_after_the_end(bundle: Path) -> None:
    """A whole tar (holding a shadow manifest.json) appended after the end-of-archive blocks."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info, data = _entry("manifest.json", b"[]")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with (bundle / TAR).open("ab") as handle:
        handle.write(buffer.getvalue())


def _unreadable_signature_bundle(bundle: Path) -> None:
    (bundle / "SHA256SUMS.sigstore.json").write_text("[" * 100_000 + "]" * 100_000)


# (alteration, re-sign with the real key afterwards?, words the error must contain)
TAMPERS: dict[str, tuple[Callable[[Path], None], bool, list[str]]] = {
    "flipped byte in the images tar": (_flip_byte, False, [TAR, "expected", "found"]),
    "flipped byte in a tar header": (_flip_header_byte, False, [TAR, "expected", "found"]),
    "edited SHA256SUMS": (_edit_sums, False, ["SHA256SUMS.sig", "does not verify"]),
    "wrong signature": (_wrong_signature, False, ["SHA256SUMS.sig"]),
    "changed label": (
        _edit_manifest(lambda e: e["labels"].update({"io.modelforge.protocol": "2"})),
        True,
        ["modelforge-node-agent", "label io.modelforge.protocol", "expected '2'", "found '1'"],
    ),
    "extra layer": (
        _edit_manifest(lambda e: e["rootfs_layers"].append("sha256:" + "a" * 64)),
        True,
        ["modelforge-node-agent", "rootfs_layers (count)", "expected 3", "found 2"],
    ),
    "missing layer": (
        _edit_manifest(lambda e: e["rootfs_layers"].pop()),
        True,
        ["modelforge-node-agent", "rootfs_layers (count)", "expected 1", "found 2"],
    ),
    "different architecture": (
        _edit_manifest(lambda e: e.update(architecture="arm64")),
        True,
        ["modelforge-node-agent", "architecture", "expected 'arm64'", "found 'amd64'"],
    ),
    "different tag": (
        _edit_manifest(lambda e: e.update(tag="modelforge-node-agent:0.1.1")),
        True,
        ["modelforge-node-agent", "tag expected", "found 'modelforge-node-agent:0.1.1'"],
    ),
    "shadow manifest.json under x/../manifest.json": (
        _shadow_manifest("x/../manifest.json"),
        True,
        [TAR, "'x/../manifest.json'", "second entry named 'manifest.json'"],
    ),
    "shadow manifest.json under .//manifest.json": (
        _shadow_manifest(".//manifest.json"),
        True,
        [TAR, "'.//manifest.json'", "second entry named 'manifest.json'"],
    ),
    "config swapped, manifest unchanged": (
        _edit_tar_manifest(_swap_config),
        True,
        ["modelforge-node-agent", "config_digest expected sha256:", "found sha256:"],
    ),
    "extra RepoTag": (
        _edit_tar_manifest(lambda m, _: m[1]["RepoTags"].append("postgres:16")),
        True,
        ["RepoTags expected ['modelforge-node-agent:0.1.0']", "'postgres:16'"],
    ),
    "same image twice in manifest.json": (
        _edit_tar_manifest(lambda m, _: m.append(dict(m[1]))),
        True,
        ["image modelforge-node-agent:0.1.0 appears 2 times"],
    ),
    "entries swapped between images in the release manifest": (
        _swap_manifest_entries,
        True,
        [
            "modelforge-node-agent: tag expected 'modelforge-node-agent:0.1.0', "
            "found 'modelforge-control-plane:0.1.0'",
            "label io.modelforge.component expected 'node-agent', found 'control-plane'",
        ],
    ),
    "traversal entry": (
        _add_entries(_entry("../evil")),
        True,
        [TAR, "'../evil'", "climbs out of the archive's root"],
    ),
    "absolute entry": (
        _add_entries(_entry("/etc/cron.d/evil")),
        True,
        [TAR, "'/etc/cron.d/evil'", "an absolute name"],
    ),
    "symlink entry": (
        _add_entries(_entry("evil", b"", tarfile.SYMTYPE, "/etc/passwd")),
        True,
        [TAR, "'evil' is a symbolic link to '/etc/passwd'"],
    ),
    "hard link entry": (
        _add_entries(_entry("evil", b"", tarfile.LNKTYPE, "manifest.json")),
        True,
        [TAR, "'evil' is a hard link to 'manifest.json'"],
    ),
    "device entry": (
        _add_entries(_entry("evil", b"", tarfile.CHRTYPE)),
        True,
        [TAR, "'evil' is a character device"],
    ),
    "fifo entry": (_add_entries(_entry("evil", b"", tarfile.FIFOTYPE)), True, ["is a fifo"]),
    "entry manifest.json does not reference": (
        _add_entries(_entry("index.json", b"{}")),
        True,
        [TAR, "not referenced by manifest.json", "index.json"],
    ),
    "data after the end of the archive": (
        _data_after_the_end,
        True,
        [TAR, "data after the end of the archive"],
    ),
    "unlisted extra file": (
        lambda b: (b / "extra.txt").write_text("hello"),
        False,
        ["unlisted file extra.txt", "not in SHA256SUMS"],
    ),
    "missing Sigstore bundle": (
        lambda b: (b / "SHA256SUMS.sigstore.json").unlink(),
        False,
        ["SHA256SUMS.sigstore.json is missing", "a release carries it"],
    ),
    "deeply nested Sigstore bundle": (
        _unreadable_signature_bundle,
        False,
        ["SHA256SUMS.sigstore.json", "nested more than"],
    ),
    "deeply nested release manifest": (
        lambda b: (b / MANIFEST_FILE).write_text("[" * 50_000 + "]" * 50_000),
        True,
        [MANIFEST_FILE, "nested more than 32 levels"],
    ),
    "wrongly typed release manifest": (
        _edit_manifest(lambda e: e.update(labels=["io.modelforge.component"], tag=7)),
        True,
        ["modelforge-node-agent: field tag must be", "field labels must be an object"],
    ),
    "release manifest without config_digest": (
        _edit_manifest(lambda e: e.pop("config_digest")),
        True,
        ["modelforge-node-agent: field config_digest expected a digest", "found None"],
    ),
    "deeply nested manifest.json": (
        _edit_images_tar(lambda e: _put(e, "manifest.json", b"[" * 50_000 + b"]" * 50_000)),
        True,
        [TAR, "manifest.json", "nested more than 32 levels"],
    ),
    "wrongly typed config": (
        _edit_tar_manifest(lambda m, e: _replace_config(m, e, b'{"rootfs": [1, 2]}')),
        True,
        ["modelforge-node-agent:0.1.0: config rootfs.diff_ids is missing or not a list"],
    ),
    "file listed but missing": (
        lambda b: (b / "sbom" / "modelforge-runtime-worker.cdx.json").unlink(),
        False,
        ["listed in SHA256SUMS but missing", "sbom/modelforge-runtime-worker.cdx.json"],
    ),
}


for _name, (_alter, _words) in crafted.VARIANTS.items():
    TAMPERS[f"crafted tar: {_name}"] = (_alter, True, [TAR, *_words])


@pytest.fixture
def docker_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `docker` first on PATH that only writes down how it was called: the record stays
    empty as long as nothing reaches Docker."""
    folder = tmp_path / "bin"
    folder.mkdir()
    record = tmp_path / "docker-calls"
    record.touch()
    script = folder / "docker"
    script.write_text(f'#!/bin/sh\necho "$@" >> {record}\nexit 1\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return record


@pytest.mark.parametrize("case", list(TAMPERS))
def test_tampered_bundle_is_refused_by_verify_and_load(
    case: str,
    signed_bundle: Path,
    keys: tuple[Path, Path, Path],
    tmp_path: Path,
    docker_calls: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    alter, sign_again, words = TAMPERS[case]
    bundle = _copy(signed_bundle, tmp_path)
    alter(bundle)
    if sign_again:
        resign(bundle, keys[0])
    capsys.readouterr()
    code, err = _verify(bundle, keys[1], capsys)
    assert code == 1
    for word in words:
        assert word in err, (case, err)

    code = main(["load", str(bundle), "--key", str(keys[1])])
    loaded = capsys.readouterr().err
    assert code == 1
    assert err.splitlines()[-1].removeprefix("modelforge-release verify: ") in loaded
    assert docker_calls.read_text() == ""


@pytest.mark.parametrize("case", crafted.HIDDEN_PAYLOAD)
def test_hidden_payload_is_a_plain_layer_to_pythons_tarfile(
    case: str, signed_bundle: Path, tmp_path: Path
) -> None:
    """The corpus holds the bypass: Python's tarfile (what verify read with before) sees one
    manifest.json and a regular file under a layer's name, whose bytes are tar headers — a
    second manifest.json first — for a reader that takes that entry for a directory."""
    bundle = _copy(signed_bundle, tmp_path)
    crafted.VARIANTS[case][0](bundle)
    hidden = json.loads((bundle / MANIFEST_FILE).read_text())["images"]["modelforge-node-agent"]
    layer = hidden["rootfs_layers"][-1].removeprefix("sha256:") + "/layer.tar"

    with tarfile.open(bundle / TAR) as tar:
        names = tar.getnames()
        (member,) = [m for m in tar.getmembers() if m.name.rstrip("/") == layer]
        data = tar.extractfile(member).read()  # type: ignore[union-attr]

    assert names.count("manifest.json") == 1
    assert member.isfile()
    assert data[:100].rstrip(b"\x00") == b"manifest.json" and data[257:263] == b"ustar\x00"


def test_wrong_public_key_is_refused(
    signed_bundle: Path, keys: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _verify(signed_bundle, keys[2], capsys)
    assert code == 1 and "SHA256SUMS.sig does not verify against the public key" in err


def test_private_key_never_printed(
    signed_bundle: Path,
    keys: tuple[Path, Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bundle = _copy(signed_bundle, tmp_path)
    main(["sign", str(bundle), "--key", str(keys[0])])
    output = capsys.readouterr()
    body = keys[0].read_text().splitlines()[1]
    assert body not in output.out + output.err
