"""Small synthetic images (a few tiny layers each) for fast bundle tests without mmdebstrap,
and the signed bundle made of them.

They go through the same `write_images_tar` / manifest / SHA256SUMS / signing code as real ones.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

from modelforge_contracts.release_manifest import MANIFEST_FILE, manifest_for
from release.archive import write_images_tar
from release.checksums import render_sha256sums
from release.cli import main
from release.images import BuiltImage
from release.verify import TEMPLATE, images_tar_name

VERSION = "0.1.0"
NAMES = ("modelforge-control-plane", "modelforge-node-agent", "modelforge-runtime-worker")


def _layer(path: Path, files: dict[str, bytes]) -> str:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size = len(files[name])
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(files[name]))
    path.write_bytes(buffer.getvalue())
    return "sha256:" + hashlib.sha256(buffer.getvalue()).hexdigest()


def synthetic_images(directory: Path) -> list[BuiltImage]:
    directory.mkdir(parents=True, exist_ok=True)
    base = directory / "base.tar"
    base_id = _layer(base, {"etc/os-release": b"ID=debian\n"})
    images = []
    for name in NAMES:
        component = name.removeprefix("modelforge-")
        app = directory / f"{component}.tar"
        app_id = _layer(app, {f"opt/{component}/README": f"{component}\n".encode() * 64})
        labels = {
            "org.opencontainers.image.version": VERSION,
            "org.opencontainers.image.title": name,
            "io.modelforge.component": component,
            "io.modelforge.protocol": "1",
        }
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Labels": labels, "User": "10001:10001"},
            "rootfs": {"type": "layers", "diff_ids": [base_id, app_id]},
            "created": "2023-11-14T22:13:20Z",
        }
        config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
        images.append(
            BuiltImage(
                name=name,
                tag=f"{name}:{VERSION}",
                config_digest="sha256:" + hashlib.sha256(config_bytes).hexdigest(),
                config_bytes=config_bytes,
                layers=(base, app),
                diff_ids=(base_id, app_id),
                architecture="amd64",
                os="linux",
                labels=labels,
                sbom={"bomFormat": "CycloneDX", "specVersion": "1.5", "components": []},
                size_bytes=base.stat().st_size + app.stat().st_size,
            )
        )
    return images


def signed_bundle(root: Path, private_key: Path) -> Path:
    """A complete release bundle of the synthetic images under `root`, signed with the key."""
    images = synthetic_images(root / "layers")
    bundle = root / "bundle"
    bundle.mkdir()
    write_images_tar(images, bundle / images_tar_name(VERSION))
    (bundle / MANIFEST_FILE).write_text(manifest_for(images, version=VERSION, protocol=1).dumps())
    (bundle / "sbom").mkdir()
    for image in images:
        (bundle / "sbom" / f"{image.name}.cdx.json").write_text(json.dumps(image.sbom))
    assert main(["bundle", str(bundle)]) == 0
    assert main(["sign", str(bundle), "--key", str(private_key)]) == 0
    return bundle


def resign(bundle: Path, private_key: Path) -> None:
    """SHA256SUMS rendered afresh and signed with the real key, without `bundle`'s own checks of
    the manifest: a tampered bundle whose signature and checksums are all good, so only the
    check under test can refuse it."""
    (bundle / "SHA256SUMS").write_text(render_sha256sums(TEMPLATE, bundle, VERSION))
    assert main(["sign", str(bundle), "--key", str(private_key)]) == 0
