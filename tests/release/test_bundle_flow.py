"""The `modelforge-release` commands: bundle, keygen, sign, verify (RL-3) — and the
tamper suite: every altered bundle is refused with a message naming file/image/field, expected
and found. Synthetic images keep this fast; the Docker tests use real ones."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from modelforge_contracts.release_manifest import MANIFEST_FILE, manifest_for
from release.archive import write_images_tar
from release.cli import main
from release.verify import images_tar_name
from tests.release.synthetic import VERSION, synthetic_images

TAR = images_tar_name(VERSION)


def _release(cli: Callable[..., int], bundle: Path, private_key: Path) -> None:
    assert cli(["bundle", str(bundle)]) == 0
    assert cli(["sign", str(bundle), "--key", str(private_key)]) == 0


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    directory = tmp_path_factory.mktemp("keys")
    private, public = directory / "cosign.key", directory / "cosign.pub"
    assert main(["keygen", "--private", str(private), "--public", str(public)]) == 0
    other_private, other_public = directory / "other.key", directory / "other.pub"
    assert main(["keygen", "--private", str(other_private), "--public", str(other_public)]) == 0
    return private, public, other_public


@pytest.fixture(scope="module")
def signed_bundle(tmp_path_factory: pytest.TempPathFactory, keys: tuple[Path, Path, Path]) -> Path:
    root = tmp_path_factory.mktemp("bundle")
    images = synthetic_images(root / "layers")
    bundle = root / "bundle"
    bundle.mkdir()
    write_images_tar(images, bundle / TAR)
    (bundle / MANIFEST_FILE).write_text(manifest_for(images, version=VERSION, protocol=1).dumps())
    (bundle / "sbom").mkdir()
    for image in images:
        (bundle / "sbom" / f"{image.name}.cdx.json").write_text(json.dumps(image.sbom))
    _release(main, bundle, keys[0])
    return bundle


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
        ["modelforge-node-agent", "modelforge-node-agent:0.1.1", "not found"],
    ),
    "file listed but missing": (
        lambda b: (b / "sbom" / "modelforge-runtime-worker.cdx.json").unlink(),
        False,
        ["listed in SHA256SUMS but missing", "sbom/modelforge-runtime-worker.cdx.json"],
    ),
}


@pytest.mark.parametrize("case", list(TAMPERS))
def test_tampered_bundle_is_refused(
    case: str,
    signed_bundle: Path,
    keys: tuple[Path, Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    alter, resign, words = TAMPERS[case]
    bundle = _copy(signed_bundle, tmp_path)
    alter(bundle)
    if resign:
        _release(main, bundle, keys[0])
    capsys.readouterr()
    code, err = _verify(bundle, keys[1], capsys)
    assert code == 1
    for word in words:
        assert word in err, (case, err)


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
