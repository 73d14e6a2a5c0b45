"""Build the three ModelForge images without a Docker daemon and without a registry.

Each image has three layers: a Debian bookworm root filesystem made from Debian's packages by
mmdebstrap and pruned to what python3 needs at run time (shared, byte for byte, by all three);
the component's dependencies from its hash-locked wheels under `locks/`; the project's own wheel.
Layers and configs are deterministic, so two builds of the same inputs give the same diff_ids
and image IDs.

It must never pull from a container registry, talk to a Docker daemon, leave a shell, apt or
dpkg in an image, or let the build host's paths, users or clock into a layer or a config.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from node_agent import PROTOCOL_VERSION
from release import sbom
from release._tar import canonical_json, rfc3339, sha256_file, write_tree

COMPONENTS = ("control-plane", "node-agent", "runtime-worker")
ARCHITECTURE = "amd64"
OS = "linux"
USER_ID = 10001
SITE_DIR = "opt/modelforge/lib"
DEFAULT_SOURCE = "https://github.com/modelforge/modelforge"
DEBIAN_SUITE = "bookworm"
DEBIAN_SOURCES = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
PROJECT_DIR = Path(__file__).resolve().parent.parent

# What the images run on: python3 with its standard library, CA certificates, /etc/services.
_BASE_PACKAGES = tuple(
    "base-files netbase ca-certificates python3-minimal libpython3.11-stdlib".split()
)
# Needed to install or configure the packages above, never by them at run time.
_INSTALL_TIME_ONLY = frozenset({"dpkg", "debconf", "openssl", "mawk"})
_SHELLS_AND_PACKAGE_MANAGERS = re.compile(r"^usr/s?bin/(\w*sh|apt[^/]*|dpkg[^/]*)$")
_UNSHIPPED_DOCS = ("man", "locale", "info", "doc")
_STRIPPED = re.compile(
    r"^usr/share/(man|info|locale|lintian|bug)(/|$)"
    r"|^usr/share/doc/[^/]+/(?!copyright$)"  # the copyright notices stay
    r"|(^|/)__pycache__(/|$)|\.pyc$"
)
# Written by maintainer scripts, owned by no package, needed at run time.
_GENERATED = ("etc/ssl/certs", "etc/ca-certificates.conf", "etc/ld.so.conf", "etc/ld.so.cache")
# Mount points of named volumes: a fresh volume takes these owners from the image.
_USER_DIRS = (
    "var/lib/modelforge",
    "var/lib/modelforge/agent",
    "var/cache/modelforge/artifacts",
    "run/modelforge",
)
_SKELETON = {
    **dict.fromkeys(
        ("dev", "proc", "sys", "run", "home", "opt", "var/lib/dpkg", *_USER_DIRS), 0o755
    ),
    **{"tmp": 0o1777, "var/tmp": 0o1777, "root": 0o700},
}
_PASSWD = (
    "root:x:0:0:root:/root:/usr/sbin/nologin\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    f"modelforge:x:{USER_ID}:{USER_ID}:ModelForge:/var/lib/modelforge:/usr/sbin/nologin\n"
)
_GROUP = f"root:x:0:\nnogroup:x:65534:\nmodelforge:x:{USER_ID}:\n"
_NSSWITCH = "passwd: files\ngroup: files\nhosts: files dns\nnetworks: files\nservices: files\n"
# Debian bookworm has glibc 2.36: every manylinux wheel up to 2_36, newest preferred.
_PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)


#: The web console's sources; built into `dist/`, shipped in the project wheel (package data).
CONSOLE = Path("control_plane/console")


class ImageBuildError(Exception):
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
class _Layer:
    path: Path
    diff_id: str
    created_by: str


@dataclass(frozen=True)
class _Recipe:
    lock: str
    cmd: tuple[str, ...]
    env: tuple[str, ...] = ()
    ports: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()


def _recipe(component: str, flavour: str) -> _Recipe:
    if component == "control-plane":
        return _Recipe(
            "control-plane.lock",
            ("python3", "-m", "control_plane"),
            env=("MODELFORGE_HOST=0.0.0.0", "MODELFORGE_DATA_DIR=/var/lib/modelforge"),
            ports=("8000/tcp",),
        )
    if component == "node-agent":
        return _Recipe(
            "node-agent.lock",
            ("python3", "-m", "node_agent"),
            env=("NVIDIA_DRIVER_CAPABILITIES=utility",),
        )
    cuda_env = (
        "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
        f"LD_LIBRARY_PATH=/{SITE_DIR}/nvidia/cuda_runtime/lib",
    )
    return _Recipe(
        "runtime-worker-cuda.lock" if flavour == "cuda" else "runtime-worker.lock",
        ("python3", "-m", "runtime_worker"),
        env=cuda_env if flavour == "cuda" else (),
        labels=(("io.modelforge.flavour", flavour),),
    )


def build_images(
    *,
    version: str,
    revision: str,
    source_date_epoch: int,
    work_dir: Path,
    worker_flavour: Literal["cpu", "cuda"] = "cuda",
    components: Sequence[str] = COMPONENTS,
    progress: Callable[[str], None] = print,
    source: str = DEFAULT_SOURCE,
    debian_sources: Sequence[str] = DEBIAN_SOURCES,
    project_dir: Path = PROJECT_DIR,
) -> list[BuiltImage]:
    """Build the images of `components`; layer tars are kept under `work_dir/layers`.

    The pruned Debian base is cached under `work_dir/cache`, keyed by its recipe, the sources,
    SOURCE_DATE_EPOCH and this module's code; everything else is rebuilt on every call.
    """
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", version):
        raise ImageBuildError(f"version {version!r} is not a valid image tag")
    unknown = sorted(set(components) - set(COMPONENTS))
    if unknown or not components:
        raise ImageBuildError(f"unknown components {unknown}; choose from {list(COMPONENTS)}")
    if worker_flavour not in ("cpu", "cuda"):
        raise ImageBuildError(f"worker flavour {worker_flavour!r} is neither 'cpu' nor 'cuda'")
    work_dir = work_dir.resolve()
    scratch = work_dir / "build"
    shutil.rmtree(scratch, ignore_errors=True)
    for folder in ("layers", "logs", "build", "cache"):
        (work_dir / folder).mkdir(parents=True, exist_ok=True)
    steps = _Steps(work_dir, source_date_epoch, progress)

    base, debian = steps.debian_base(tuple(debian_sources))
    app, app_dists = steps.application(project_dir)
    images = []
    for component in COMPONENTS:
        if component not in components:
            continue
        recipe = _recipe(component, worker_flavour)
        deps, dists = steps.dependencies(project_dir / "locks" / recipe.lock)
        name = f"modelforge-{component}"
        labels = {
            "org.opencontainers.image.version": version,
            "org.opencontainers.image.revision": revision,
            "org.opencontainers.image.created": rfc3339(source_date_epoch),
            "org.opencontainers.image.source": source,
            "org.opencontainers.image.title": name,
            "org.opencontainers.image.licenses": "Apache-2.0",
            "io.modelforge.component": component,
            "io.modelforge.protocol": str(PROTOCOL_VERSION),
            **dict(recipe.labels),
        }
        layers = (base, deps, app)
        config = canonical_json(_config(recipe, layers, labels, source_date_epoch))
        images.append(
            BuiltImage(
                name=name,
                tag=f"{name}:{version}",
                config_digest="sha256:" + hashlib.sha256(config).hexdigest(),
                config_bytes=config,
                layers=tuple(layer.path for layer in layers),
                diff_ids=tuple(layer.diff_id for layer in layers),
                architecture=ARCHITECTURE,
                os=OS,
                labels=labels,
                sbom=sbom.build_sbom(
                    image=name,
                    version=version,
                    source_date_epoch=source_date_epoch,
                    debian=debian,
                    python=[*dists, *app_dists],
                ),
                size_bytes=sum(layer.path.stat().st_size for layer in layers),
            )
        )
        progress(
            f"{name}:{version}: image {images[-1].config_digest}, "
            f"{images[-1].size_bytes / 1e6:.1f} MB in {len(layers)} layers"
        )
    shutil.rmtree(scratch, ignore_errors=True)
    return images


def _config(
    recipe: _Recipe, layers: Sequence[_Layer], labels: Mapping[str, str], epoch: int
) -> dict[str, Any]:
    env = [
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        f"PYTHONPATH=/{SITE_DIR}",
        "PYTHONDONTWRITEBYTECODE=1",
        "PYTHONUNBUFFERED=1",
        "PYTHONUTF8=1",
        *recipe.env,
    ]
    config: dict[str, Any] = {
        "User": f"{USER_ID}:{USER_ID}",
        "Env": env,
        "Cmd": list(recipe.cmd),
        "WorkingDir": "/",
        "Labels": dict(labels),
    }
    if recipe.ports:
        config["ExposedPorts"] = {port: {} for port in recipe.ports}
    history = [{"created": rfc3339(epoch), "created_by": layer.created_by} for layer in layers]
    return {
        "architecture": ARCHITECTURE,
        "os": OS,
        "created": rfc3339(epoch),
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": history,
    }


class _Steps:
    """The build steps, sharing the work directory, SOURCE_DATE_EPOCH and progress output."""

    def __init__(self, work_dir: Path, epoch: int, progress: Callable[[str], None]) -> None:
        self.work_dir, self.epoch, self.progress = work_dir, epoch, progress
        self.scratch = work_dir / "build"

    def run(self, argv: Sequence[str], *, log: str, cwd: Path | None = None, **env: str) -> None:
        started = time.monotonic()
        log_path = self.work_dir / "logs" / f"{log}.log"
        full_env = {**os.environ, "SOURCE_DATE_EPOCH": str(self.epoch), **env}
        with log_path.open("wb") as out:
            # The argv is assembled in this module from fixed options and local paths.
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

    def layer(self, root: Path, created_by: str, **options: Any) -> _Layer:
        partial = self.scratch / "layer.tar.partial"
        diff_id = write_tree(root, partial, mtime=self.epoch, **options)
        path = self.work_dir / "layers" / f"{diff_id.removeprefix('sha256:')}.tar"
        partial.replace(path)
        self.progress(f"  layer {diff_id[:19]}: {path.stat().st_size / 1e6:.1f} MB")
        return _Layer(path, diff_id, created_by)

    def debian_base(self, sources: tuple[str, ...]) -> tuple[_Layer, list[sbom.DebianPackage]]:
        recipe = {
            "suite": DEBIAN_SUITE,
            "packages": _BASE_PACKAGES,
            "sources": sources,
            "epoch": self.epoch,
            "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        }
        key = hashlib.sha256(canonical_json(recipe)).hexdigest()[:16]
        cached = self.work_dir / "cache" / f"debian-base-{key}"
        created_by = f"mmdebstrap --variant=essential {DEBIAN_SUITE} + {','.join(_BASE_PACKAGES)}"
        if not (cached / "packages.json").exists():
            self.progress(f"debian base: mmdebstrap {DEBIAN_SUITE} (about a minute) ...")
            rootfs = self.scratch / "rootfs"
            mmdebstrap = shutil.which("mmdebstrap")
            if mmdebstrap is None:
                raise ImageBuildError("mmdebstrap is not installed: apt-get install mmdebstrap")
            excludes = [f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in _UNSHIPPED_DOCS]
            self.run(
                [
                    mmdebstrap,
                    "--variant=essential",
                    "--format=directory",
                    "--include=" + ",".join(_BASE_PACKAGES),
                    *excludes,
                    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
                    DEBIAN_SUITE,
                    str(rootfs),
                    *sources,
                ],
                log="mmdebstrap",
            )
            packages = _prune_rootfs(rootfs, run=self.run)
            self.progress(f"debian base: kept {len(packages)} packages")
            staged = self.scratch / "debian-base"
            staged.mkdir()
            layer = self.layer(
                rootfs, created_by, owners=dict.fromkeys(_USER_DIRS, (USER_ID, USER_ID))
            )
            layer.path.replace(staged / "layer.tar")
            rows = [[p.name, p.version, p.architecture, p.source] for p in packages]
            (staged / "packages.json").write_bytes(canonical_json(rows))
            shutil.rmtree(rootfs)
            shutil.rmtree(cached, ignore_errors=True)
            staged.replace(cached)
        else:
            self.progress(f"debian base: cached {cached.name}")
        rows = json.loads((cached / "packages.json").read_bytes())
        debian = [sbom.DebianPackage(*row) for row in rows]
        base = cached / "layer.tar"
        return _Layer(base, "sha256:" + sha256_file(base), created_by), debian

    def application(self, project_dir: Path) -> tuple[_Layer, list[sbom.PythonDistribution]]:
        self.progress("application: building the project wheel ...")
        backend = self.scratch / "build-backend"
        build_lock = project_dir / "locks" / "build.lock"
        self.pip(
            ["--require-hashes", "--only-binary=:all:", "-r", str(build_lock)],
            backend,
            log="build-backend",
        )
        source = self.scratch / "source"
        _copy_project(project_dir, source)
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
        return self.layer(root, f"pip install --no-deps {wheel.name}", normalize_modes=True), dists

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

    def dependencies(self, lock: Path) -> tuple[_Layer, list[sbom.PythonDistribution]]:
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
        dists = sbom.python_distributions(root / SITE_DIR)
        created_by = f"pip install --require-hashes --no-deps -r locks/{lock.name}"
        return self.layer(root, created_by, normalize_modes=True), dists

    def pip(self, args: Sequence[str], target: Path, *, log: str) -> None:
        options = "--disable-pip-version-check --no-input --no-deps --no-compile".split()
        self.run(
            [sys.executable, "-m", "pip", "install", *options, "--target", str(target), *args],
            log=log,
        )
        _scrub_site(target)


def _copy_project(project_dir: Path, destination: Path) -> None:
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


def _keep_closure(status: Mapping[str, Mapping[str, str]]) -> set[str]:
    """The run-time dependency closure of _BASE_PACKAGES (Pre-Depends and Depends)."""
    providers: dict[str, str] = {}
    for name, fields in status.items():
        for provided in fields.get("Provides", "").split(","):
            providers.setdefault(provided.split("(")[0].strip(), name)
    keep: set[str] = set()
    pending = list(_BASE_PACKAGES)
    while pending:
        name = pending.pop()
        if name in keep or name in _INSTALL_TIME_ONLY:
            continue
        keep.add(name)
        fields = status[name]
        relations = f"{fields.get('Pre-Depends', '')},{fields.get('Depends', '')}"
        for relation in filter(None, (r.strip() for r in relations.split(","))):
            choices = [re.split(r"[\s(:]", c.strip())[0] for c in relation.split("|")]
            installed = [
                c if c in status else providers[c] for c in choices if c in status or c in providers
            ]
            if not installed:
                raise ImageBuildError(f"{name}: dependency {relation!r} is not installed")
            pending.append(installed[0])
    return keep


def _prune_rootfs(rootfs: Path, *, run: Callable[..., None]) -> list[sbom.DebianPackage]:
    """Reduce an mmdebstrap tree to the packages python3 needs; return those packages."""
    info = rootfs / "var/lib/dpkg/info"
    status = sbom.parse_dpkg_status((rootfs / "var/lib/dpkg/status").read_text())
    keep = _keep_closure(status)
    aliases = {p.name: os.readlink(p) for p in rootfs.iterdir() if p.is_symlink()}
    owned = {*aliases, *_SKELETON, *_GENERATED, "usr/sbin/ldconfig"}
    for name in keep:
        listing = info / f"{name}.list"
        if not listing.exists():
            listing = info / f"{name}:{status[name]['Architecture']}.list"
        for line in listing.read_text().splitlines():
            first, _, rest = line.strip("/").partition("/")
            owned.add(f"{aliases[first]}/{rest}" if first in aliases and rest else line.strip("/"))
    for parent, dirs, files in os.walk(rootfs, topdown=False):
        for entry in (*files, *dirs):
            path = Path(parent, entry)
            relative = path.relative_to(rootfs).as_posix()
            if not _STRIPPED.search(relative) and (
                relative in owned or relative.startswith("etc/ssl/certs/")
            ):
                continue
            if path.is_symlink() or not path.is_dir():
                path.unlink()
            elif not any(path.iterdir()):
                path.rmdir()
    run(["chroot", str(rootfs), "/usr/sbin/ldconfig", "-X"], log="ldconfig")
    (rootfs / "usr/sbin/ldconfig").unlink()
    shutil.rmtree(rootfs / "var/cache/ldconfig", ignore_errors=True)
    for relative, mode in _SKELETON.items():
        (rootfs / relative).mkdir(parents=True, exist_ok=True)
        (rootfs / relative).chmod(mode)
    for relative, text in (
        ("etc/passwd", _PASSWD),
        ("etc/group", _GROUP),
        ("etc/nsswitch.conf", _NSSWITCH),
    ):
        (rootfs / relative).write_text(text)
        (rootfs / relative).chmod(0o644)
    # Scanners (Trivy, Grype, Syft) read the OS packages from here; dpkg itself is gone.
    paragraphs = [
        "".join(f"{key}: {value}\n" for key, value in status[name].items()) for name in sorted(keep)
    ]
    (rootfs / "var/lib/dpkg/status").write_text("\n".join(paragraphs))
    leftovers = sorted(
        path.relative_to(rootfs).as_posix()
        for path in rootfs.rglob("*")
        if _SHELLS_AND_PACKAGE_MANAGERS.match(path.relative_to(rootfs).as_posix())
    )
    if leftovers:
        raise ImageBuildError(f"the pruned base still holds {leftovers}")
    return sbom.debian_packages({name: status[name] for name in keep})
