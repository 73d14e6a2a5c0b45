"""OCI image assembly: layers, image configs, and the build steps that make the Python layers.

A layer is a directory tree written by `release._tar.write_tree` (sorted entries, one fixed
mtime, numeric owners) and stored under `work_dir/layers/<digest>.tar`; its diff_id is the
sha256 of that tar. The two Python layers are installed under SITE_DIR: a component's
dependencies from its hash-locked wheels (less what its recipe leaves out), and the project's
own wheel (with the web console,
built from its sources in a copy of the project). The image config is canonical JSON whose
every timestamp is SOURCE_DATE_EPOCH.

Nothing here may let the build host's paths, users or clock into a layer or a config: console
scripts (they name the host's interpreter), direct_url.json, bytecode and RECORD rows for
removed files are dropped from every installed tree.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from release import sbom
from release._tar import rfc3339, write_tree
from release.errors import ReleaseError

ARCHITECTURE = "amd64"
OS = "linux"
#: Where the Python layers install packages; the images' PYTHONPATH.
SITE_DIR = "opt/modelforge/lib"
#: The web console's sources; built into `dist/`, shipped in the project wheel (package data).
CONSOLE = Path("control_plane/console")

# Debian bookworm has glibc 2.36: every manylinux wheel up to 2_36, newest preferred.
_PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)


class ImageBuildError(ReleaseError):
    """A build step failed; the message names the step and, for a command, its log."""


@dataclass(frozen=True)
class BuiltImage:
    name: str
    tag: str
    config_digest: str
    config_bytes: bytes
    layers: tuple[Path, ...]
    diff_ids: tuple[str, ...]
    architecture: str
    os: str
    labels: Mapping[str, str]
    sbom: Mapping[str, Any]
    size_bytes: int


@dataclass(frozen=True)
class Layer:
    path: Path
    diff_id: str
    created_by: str


def image_config(
    *,
    layers: Sequence[Layer],
    user: int,
    cmd: Sequence[str],
    env: Sequence[str],
    ports: Sequence[str],
    labels: Mapping[str, str],
    epoch: int,
) -> dict[str, Any]:
    """The image config: runs `cmd` as `user:user` with the Python environment plus `env`."""
    config: dict[str, Any] = {
        "User": f"{user}:{user}",
        "Env": [
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            f"PYTHONPATH=/{SITE_DIR}",
            "PYTHONDONTWRITEBYTECODE=1",
            "PYTHONUNBUFFERED=1",
            "PYTHONUTF8=1",
            *env,
        ],
        "Cmd": list(cmd),
        "WorkingDir": "/",
        "Labels": dict(labels),
    }
    if ports:
        config["ExposedPorts"] = {port: {} for port in ports}
    history = [{"created": rfc3339(epoch), "created_by": layer.created_by} for layer in layers]
    return {
        "architecture": ARCHITECTURE,
        "os": OS,
        "created": rfc3339(epoch),
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": history,
    }


class Steps:
    """The build steps, sharing the work directory, SOURCE_DATE_EPOCH and progress output.

    Commands log to `work_dir/logs/<step>.log`; scratch trees live under `work_dir/build`.
    """

    def __init__(self, work_dir: Path, epoch: int, progress: Callable[[str], None]) -> None:
        self.work_dir, self.epoch, self.progress = work_dir, epoch, progress
        self.scratch = work_dir / "build"

    def run(self, argv: Sequence[str], *, log: str, cwd: Path | None = None, **env: str) -> None:
        started = time.monotonic()
        log_path = self.work_dir / "logs" / f"{log}.log"
        full_env = {**os.environ, "SOURCE_DATE_EPOCH": str(self.epoch), **env}
        with log_path.open("wb") as out:
            # The build steps assemble the argv from fixed options and local paths.
            done = subprocess.run(  # noqa: S603
                argv, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=cwd
            )
        if done.returncode != 0:
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            raise ImageBuildError(
                f"{Path(argv[0]).name} failed with exit code {done.returncode} (full log: "
                f"{log_path}); last lines:\n" + "\n".join(tail)
            )
        self.progress(f"  {log}: done in {time.monotonic() - started:.0f}s")

    def layer(self, root: Path, created_by: str, **options: Any) -> Layer:
        partial = self.scratch / "layer.tar.partial"
        diff_id = write_tree(root, partial, mtime=self.epoch, **options)
        path = self.work_dir / "layers" / f"{diff_id.removeprefix('sha256:')}.tar"
        partial.replace(path)
        self.progress(f"  layer {diff_id[:19]}: {path.stat().st_size / 1e6:.1f} MB")
        return Layer(path, diff_id, created_by)

    def application(self, project_dir: Path) -> tuple[Layer, list[sbom.PythonDistribution]]:
        """The project's own wheel, built with the pinned backend, installed without deps."""
        self.progress("application: building the project wheel ...")
        backend = self.scratch / "build-backend"
        build_lock = project_dir / "locks" / "build.lock"
        self.pip(
            ["--require-hashes", "--only-binary=:all:", "-r", str(build_lock)],
            backend,
            log="build-backend",
        )
        source = self.scratch / "source"
        copy_project(project_dir, source)
        self.console(project_dir, source / CONSOLE)
        wheels = self.scratch / "wheels"
        # The pinned backend from build.lock, not whatever a build-isolation download finds.
        options = "--no-deps --no-build-isolation --disable-pip-version-check".split()
        self.run(
            [sys.executable, "-m", "pip", "wheel", *options, "-w", str(wheels), str(source)],
            log="project-wheel",
            PYTHONPATH=str(backend),
        )
        (wheel,) = wheels.glob("*.whl")
        root = self.scratch / "application"
        self.pip([str(wheel)], root / SITE_DIR, log="application")
        dists = sbom.python_distributions(root / SITE_DIR)
        return self.layer(root, f"pip install --no-deps {wheel.name}"), dists

    def console(self, project_dir: Path, console: Path) -> None:
        """Build the web console from its sources in the copy (never a stale `dist/` from the
        checkout), with the checkout's locked node_modules or a fresh `npm ci`."""
        npm = shutil.which("npm")
        if npm is None:
            raise ImageBuildError(
                "npm is not installed: the control plane serves the console built from "
                f"{CONSOLE}; run scripts/ensure-node"
            )
        installed = project_dir / CONSOLE / "node_modules"
        if installed.is_dir():
            (console / "node_modules").symlink_to(installed.resolve(), target_is_directory=True)
        else:
            self.run([npm, "ci", "--no-audit", "--no-fund"], log="console-npm-ci", cwd=console)
        self.run([npm, "run", "build"], log="console-build", cwd=console)

    def dependencies(
        self,
        lock: Path,
        *,
        unshipped: Sequence[str] = (),
        directories: Mapping[str, tuple[int, int]] | None = None,
        programs: Sequence[tuple[Path, str]] = (),
    ) -> tuple[Layer, list[sbom.PythonDistribution]]:
        """The wheels pinned, with hashes, by `lock`, for CPython 3.11 on bookworm's glibc,
        without the paths the `unshipped` glob patterns (relative to SITE_DIR) match, the
        `directories` (relative path -> owner uid, gid) the image alone has, and the built
        `programs` (a file of the checkout -> its path in the image)."""
        self.progress(f"dependencies: {lock.name} ...")
        root = self.scratch / f"deps-{lock.stem}"
        shutil.rmtree(root, ignore_errors=True)
        platforms = [f"--platform={platform}" for platform in _PLATFORMS]
        wheels = "--python-version=3.11 --implementation=cp --abi=cp311 --only-binary=:all:"
        self.pip(
            ["--require-hashes", *wheels.split(), *platforms, "-r", str(lock)],
            root / SITE_DIR,
            log=f"deps-{lock.stem}",
        )
        created_by = f"pip install --require-hashes --no-deps -r locks/{lock.name}"
        if unshipped:
            self._remove(root / SITE_DIR, unshipped)
            created_by += ", without " + " ".join(unshipped)
        dists = sbom.python_distributions(root / SITE_DIR)
        for directory in directories or {}:
            (root / directory).mkdir(parents=True)
        for built, placed in programs:
            if not built.is_file():
                raise ImageBuildError(f"{built} is missing: run make install, which builds it")
            (root / placed).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(built, root / placed)
            (root / placed).chmod(0o755)
            created_by += f", with {placed}"
        return self.layer(root, created_by, owners=directories), dists

    def _remove(self, site: Path, patterns: Sequence[str]) -> None:
        """Remove what `patterns` match below `site` (and its RECORD rows); a pattern that
        matches nothing is an error, so a lock update cannot silently make one stale."""
        for pattern in patterns:
            matches = sorted(site.glob(pattern))
            if not matches:
                raise ImageBuildError(
                    f"unshipped pattern {pattern!r} matches nothing under {SITE_DIR}; "
                    "update the recipe in release/recipes.py"
                )
            size = 0
            for path in matches:
                if path.is_dir() and not path.is_symlink():
                    size += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                    shutil.rmtree(path)
                else:
                    size += path.lstat().st_size
                    path.unlink()
            self.progress(f"  left out {pattern}: {len(matches)} paths, {size / 1e6:.1f} MB")
        _scrub_site(site)

    def pip(self, args: Sequence[str], target: Path, *, log: str) -> None:
        options = "--disable-pip-version-check --no-input --no-deps --no-compile".split()
        self.run(
            [sys.executable, "-m", "pip", "install", *options, "--target", str(target), *args],
            log=log,
        )
        _scrub_site(target)


def copy_project(project_dir: Path, destination: Path) -> None:
    """Copy what the wheel is built from, so the build never writes into the checkout."""
    pyproject = tomllib.loads((project_dir / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted({pattern.split(".")[0].rstrip("*") for pattern in patterns})
    # The console is built afresh in the copy: never its node_modules or a stale dist/.
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "node_modules", "dist")
    shutil.rmtree(destination, ignore_errors=True)
    destination.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(project_dir / name, destination / name)
    for package in packages:
        shutil.copytree(project_dir / package, destination / package, ignore=ignore)


def _scrub_site(target: Path) -> None:
    """Drop what records the build host: console scripts (its interpreter path), direct_url."""
    shutil.rmtree(target / "bin", ignore_errors=True)
    for cache in target.rglob("__pycache__"):
        shutil.rmtree(cache)
    for direct_url in target.glob("*.dist-info/direct_url.json"):
        direct_url.unlink()  # the file:// URL of the wheel in the build directory
    for record in target.glob("*.dist-info/RECORD"):
        kept = []
        for line in record.read_text(encoding="utf-8").splitlines():
            path = next(csv.reader([line]))[0]
            if not path.startswith("../") and (target / path).exists():
                kept.append(line + "\n")
        record.write_text("".join(kept), encoding="utf-8")
