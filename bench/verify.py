"""Bundle verification throughput and memory (RL-3).

Builds a signed bundle of at least 1 GiB from synthetic images (random, incompressible layers),
then times `modelforge-release verify` — signature, every checksum, and every layer's digest
inside the images tar — against `sha256sum` over the same files, in the same run, with a warm
page cache for both. Reports throughput, the ratio (target ≥ 0.9) and the verifier's peak RSS
(target < 100 MB). With `--images-tar`, also reports the uncompressed size of each image in a
real release tar (target: node agent ≤ 120 MB).

    python bench/verify.py --size-gib 1.2
    python bench/verify.py --images-tar dist/modelforge-0.1.0/modelforge-0.1.0-images.tar
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modelforge_contracts.release_manifest import MANIFEST_FILE, manifest_for  # noqa: E402
from release.archive import write_images_tar  # noqa: E402
from release.cli import main as release  # noqa: E402
from release.images import BuiltImage  # noqa: E402
from release.verify import images_tar_name  # noqa: E402

VERSION = "0.1.0"
NAMES = ("modelforge-control-plane", "modelforge-node-agent", "modelforge-runtime-worker")


def _layer(path: Path, size: int) -> str:
    """A one-file layer of `size` random bytes; returns its diff_id."""
    payload = path.with_suffix(".bin")
    with payload.open("wb") as handle:
        left = size
        while left > 0:
            chunk = os.urandom(min(left, 16 * 1024 * 1024))
            handle.write(chunk)
            left -= len(chunk)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        info = tar.gettarinfo(str(payload), arcname="blob.bin")
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        with payload.open("rb") as handle:
            tar.addfile(info, handle)
    payload.unlink()
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def build_bundle(root: Path, total_bytes: int) -> tuple[Path, Path]:
    layers = root / "layers"
    layers.mkdir(parents=True)
    per_image = total_bytes // len(NAMES)
    images = []
    for name in NAMES:
        layer = layers / f"{name}.tar"
        diff_id = _layer(layer, per_image)
        labels = {
            "org.opencontainers.image.version": VERSION,
            "io.modelforge.protocol": "1",
            "io.modelforge.component": name.removeprefix("modelforge-"),
        }
        config = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Labels": labels},
                "rootfs": {"type": "layers", "diff_ids": [diff_id]},
                "created": "2026-01-01T00:00:00Z",
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        images.append(
            BuiltImage(
                name=name,
                tag=f"{name}:{VERSION}",
                config_digest="sha256:" + hashlib.sha256(config).hexdigest(),
                config_bytes=config,
                layers=(layer,),
                diff_ids=(diff_id,),
                architecture="amd64",
                os="linux",
                labels=labels,
                sbom={"bomFormat": "CycloneDX", "specVersion": "1.5"},
                size_bytes=layer.stat().st_size,
            )
        )
    bundle = root / "bundle"
    bundle.mkdir()
    write_images_tar(images, bundle / images_tar_name(VERSION))
    for layer in layers.iterdir():
        layer.unlink()
    (bundle / MANIFEST_FILE).write_text(manifest_for(images, version=VERSION, protocol=1).dumps())
    (bundle / "sbom").mkdir()
    for image in images:
        (bundle / "sbom" / f"{image.name}.cdx.json").write_text(json.dumps(image.sbom))
    key, public = root / "cosign.key", root / "cosign.pub"
    assert release(["keygen", "--private", str(key), "--public", str(public)]) == 0
    assert release(["bundle", str(bundle)]) == 0
    assert release(["sign", str(bundle), "--key", str(key)]) == 0
    return bundle, public


def timed(command: list[str], cwd: Path) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    subprocess.run(
        command, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    elapsed = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return elapsed, max(peak, before) * 1024


def image_sizes(images_tar: Path) -> dict[str, int]:
    with tarfile.open(images_tar) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
        sizes = {member.name: member.size for member in tar.getmembers()}
    return {
        entry["RepoTags"][0]: sum(sizes[layer] for layer in entry["Layers"]) for entry in manifest
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--images-tar", type=Path)
    args = parser.parse_args()

    if args.images_tar:
        print("image sizes (uncompressed layers):")
        for tag, size in sorted(image_sizes(args.images_tar).items()):
            print(f"  {tag:40s} {size / 1e6:8.1f} MB")
    with tempfile.TemporaryDirectory(prefix="modelforge-bench-verify-") as scratch:
        root = Path(scratch)
        print(f"building a {args.size_gib:.2f} GiB signed bundle ...", flush=True)
        bundle, public = build_bundle(root, int(args.size_gib * 1024**3))
        files = [
            line.split(None, 1)[1] for line in (bundle / "SHA256SUMS").read_text().splitlines()
        ]
        total = sum((bundle / name).stat().st_size for name in files)
        verify = [sys.executable, "-m", "release.cli", "verify", str(bundle), "--key", str(public)]
        sha256sum = ["sha256sum", "--quiet", "-c", "SHA256SUMS"]
        results: dict[str, list[tuple[float, int]]] = {"verify": [], "sha256sum": []}
        timed(sha256sum, bundle)  # warm the page cache
        for _ in range(args.rounds):
            results["sha256sum"].append(timed(sha256sum, bundle))
            results["verify"].append(timed(verify, REPO))
        best = {name: min(t for t, _ in runs) for name, runs in results.items()}
        peak = max(rss for _, rss in results["verify"])
        ratio = best["sha256sum"] / best["verify"]
        print(f"bundle: {total / 1e9:.2f} GB in {len(files)} files")
        for name in ("sha256sum", "verify"):
            print(f"  {name:10s} {best[name]:6.2f} s  {total / best[name] / 1e6:7.0f} MB/s")
        print(
            f"throughput ratio verify/sha256sum: {ratio:.2f} (target >= 0.9: "
            f"{'met' if ratio >= 0.9 else 'NOT met'})"
        )
        print(
            f"verify peak RSS: {peak / 1e6:.1f} MB (target < 100 MB: "
            f"{'met' if peak < 100e6 else 'NOT met'})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
