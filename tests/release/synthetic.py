"""Small synthetic images (a few tiny layers each) for fast bundle tests without mmdebstrap.

They go through the same `write_images_tar` / manifest / SHA256SUMS / signing code as real ones.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

from release.images import BuiltImage

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
