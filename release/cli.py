"""`modelforge-release`: build, bundle, keygen, sign, verify, load, up, down.

Every command fails with a one-line reason and a non-zero exit code; none takes a secret as an
argument (a signing-key password is read from the environment variable named by
`--password-env`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from importlib.metadata import version as package_version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress() -> Callable[[str, int, int], None]:
    """Progress for long streaming steps: a line per file at most every 2 s, and at the end."""
    last: dict[str, float] = {}

    def report(name: str, done: int, total: int) -> None:
        now = time.monotonic()
        started = last.setdefault(name, now)
        if (done == total and total > 0) or now - started >= 2.0:
            last[name] = now
            percent = 100.0 if total == 0 else 100.0 * done / total
            _say(f"  {name}: {done / 1e6:,.0f}/{total / 1e6:,.0f} MB ({percent:.0f}%)")

    return report


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args],
            cwd=REPO,
            capture_output=True,
            text=True,  # noqa: S607
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def cmd_build(args: argparse.Namespace) -> None:
    from modelforge_contracts.protocol import PROTOCOL_VERSION
    from modelforge_contracts.release_manifest import MANIFEST_FILE, manifest_for
    from release.archive import write_images_tar
    from release.images import build_images
    from release.verify import images_tar_name

    version = args.version or package_version("modelforge")
    revision = args.revision or _git("rev-parse", "HEAD") or "unknown"
    epoch = args.source_date_epoch or int(_git("log", "-1", "--format=%ct") or 0)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    images = build_images(
        version=version,
        revision=revision,
        source_date_epoch=epoch,
        work_dir=args.work_dir,
        worker_flavour=args.worker_flavour,
        progress=_say,
    )
    _say(f"writing {images_tar_name(version)}")
    write_images_tar(images, out / images_tar_name(version))
    (out / MANIFEST_FILE).write_text(
        manifest_for(images, version=version, protocol=PROTOCOL_VERSION).dumps()
    )
    (out / "sbom").mkdir(exist_ok=True)
    for image in images:
        sbom = json.dumps(image.sbom, indent=2, sort_keys=True) + "\n"
        (out / "sbom" / f"{image.name}.cdx.json").write_text(sbom)
        _say(f"{image.tag}  {image.config_digest}  {image.size_bytes / 1e6:.1f} MB")


def cmd_bundle(args: argparse.Namespace) -> None:
    from modelforge_contracts.release_manifest import MANIFEST_FILE, load_manifest
    from release.checksums import render_sha256sums
    from release.verify import SUMS_FILE, TEMPLATE

    manifest = load_manifest(args.bundle / MANIFEST_FILE)
    sums = render_sha256sums(TEMPLATE, args.bundle, manifest.version, _progress())
    (args.bundle / SUMS_FILE).write_text(sums)
    _say(f"wrote {args.bundle / SUMS_FILE}")


def cmd_keygen(args: argparse.Namespace) -> None:
    from release.signing import generate_keypair

    generate_keypair(args.private, args.public, password_env=args.password_env)
    _say(f"private key {args.private} (mode 0600), public key {args.public}")


def cmd_sign(args: argparse.Namespace) -> None:
    from modelforge_contracts.release_manifest import read_limited
    from release.signing import detached_signature, public_key_pem, sign_blob, sigstore_bundle
    from release.verify import SIGNATURE_FILE, SIGSTORE_BUNDLE_FILE, SUMS_FILE

    data = read_limited(args.bundle / SUMS_FILE, limit=1 << 20)
    signature = sign_blob(data, args.key, password_env=args.password_env)
    (args.bundle / SIGNATURE_FILE).write_bytes(detached_signature(signature))
    bundle = sigstore_bundle(data, signature, public_key_pem(args.key, args.password_env))
    (args.bundle / SIGSTORE_BUNDLE_FILE).write_text(json.dumps(bundle, indent=2) + "\n")
    _say(f"signed {SUMS_FILE}: {SIGNATURE_FILE}, {SIGSTORE_BUNDLE_FILE}")


def cmd_verify(args: argparse.Namespace) -> None:
    from release.verify import verify_bundle

    verified = verify_bundle(args.bundle, args.key, progress=_progress())
    _say(
        f"verified: signature, checksums, and {len(verified.manifest.images)} images "
        f"of release {verified.manifest.version}"
    )


def cmd_load(args: argparse.Namespace) -> None:
    from release.docker import load
    from release.verify import verify_bundle

    load(verify_bundle(args.bundle, args.key, progress=_progress()), say=_say)


def cmd_up(args: argparse.Namespace) -> None:
    from release.up import up

    up(
        args.bundle,
        args.compose_file,
        project=args.project,
        public_key=args.key,
        services=args.services,
        say=_say,
        allow_old_engine=args.allow_old_docker,
    )


def cmd_down(args: argparse.Namespace) -> None:
    from release.up import down

    down(args.compose_file, project=args.project)


class _IntermixedParser(argparse.ArgumentParser):
    """Options and positional arguments in any order (`up BUNDLE -f FILE service …`)."""

    _parsing = False

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._parsing:  # parse_known_intermixed_args calls back in here
            return super().parse_known_args(args, namespace)
        self._parsing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._parsing = False


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="modelforge-release", description=__doc__)
    sub = root.add_subparsers(dest="command", required=True, parser_class=_IntermixedParser)

    build = sub.add_parser("build", help="build the three images and write the bundle files")
    build.add_argument("--out", type=Path, required=True, help="bundle directory to write")
    build.add_argument("--work-dir", type=Path, default=Path("build/release"))
    build.add_argument("--version")
    build.add_argument("--revision")
    build.add_argument("--source-date-epoch", type=int)
    build.add_argument("--worker-flavour", choices=["cuda", "cpu"], default="cuda")
    build.set_defaults(run=cmd_build)

    bundle = sub.add_parser("bundle", help="render SHA256SUMS from SHA256SUMS.template")
    bundle.add_argument("bundle", type=Path)
    bundle.set_defaults(run=cmd_bundle)

    keygen = sub.add_parser("keygen", help="write an ECDSA P-256 key pair that cosign accepts")
    keygen.add_argument("--private", type=Path, required=True)
    keygen.add_argument("--public", type=Path, required=True)
    keygen.add_argument("--password-env", help="environment variable holding a key password")
    keygen.set_defaults(run=cmd_keygen)

    sign = sub.add_parser("sign", help="sign SHA256SUMS (detached signature + Sigstore bundle)")
    sign.add_argument("bundle", type=Path)
    sign.add_argument("--key", type=Path, required=True, help="private key (PEM)")
    sign.add_argument("--password-env")
    sign.set_defaults(run=cmd_sign)

    for name, run, text in (
        ("verify", cmd_verify, "verify a bundle without Docker"),
        ("load", cmd_load, "verify, then load into Docker"),
    ):
        command = sub.add_parser(name, help=text)
        command.add_argument("bundle", type=Path)
        command.add_argument("--key", type=Path, required=True, help="pinned public key (PEM)")
        command.set_defaults(run=run)

    up = sub.add_parser("up", help="start Compose from the loaded, verified images")
    up.add_argument("bundle", type=Path)
    up.add_argument("--key", type=Path, required=True, help="pinned public key (PEM)")
    up.add_argument("--compose-file", "-f", type=Path, action="append", required=True)
    up.add_argument("--project", "-p", default="modelforge")
    up.add_argument("services", nargs="*")
    up.add_argument(
        "--allow-old-docker",
        action="store_true",
        help="start even on a Docker Engine older than 24 (unsupported)",
    )
    up.set_defaults(run=cmd_up)

    down = sub.add_parser("down", help="stop a stack started by `up`")
    down.add_argument("--compose-file", "-f", type=Path, action="append", required=True)
    down.add_argument("--project", "-p", default="modelforge")
    down.set_defaults(run=cmd_down)
    return root


def main(argv: list[str] | None = None) -> int:
    from modelforge_contracts.release_manifest import ManifestError
    from release.errors import ReleaseError

    args = parser().parse_args(argv)
    try:
        args.run(args)
    # Every error of the tool is a ReleaseError; ManifestError comes from the contracts (which
    # import nothing of the tool) and OSError from a file a command reads or writes.
    except (ReleaseError, ManifestError, OSError) as exc:
        _say(f"modelforge-release {args.command}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
