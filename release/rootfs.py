"""The images' shared base layer: a Debian bookworm root file system pruned to what python3 and
the C++ runtime need.

mmdebstrap installs `_BASE_PACKAGES` from Debian's packages (honouring SOURCE_DATE_EPOCH);
the tree is then cut down to those packages' run-time dependency closure, without dpkg's
database (a plain `var/lib/dpkg/status` remains for scanners), a shell, apt or dpkg, manual
pages, locales or bytecode. A fixed skeleton (mount points, /tmp, the volumes' directories
owned by USER_ID) and fixed passwd, group and nsswitch.conf files are added.

The layer and its package list are cached under `work_dir/cache`, keyed by the suite, the
packages, the apt sources, SOURCE_DATE_EPOCH and the code that determines the layer's bytes:
this module, `release._tar` (the tar format) and `release.sbom` (the package list). Changing
any of them builds the base afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from release import _tar, sbom
from release._tar import canonical_json, sha256_file, write_tree
from release.oci import ImageBuildError, Layer, Steps

DEBIAN_SUITE = "bookworm"
DEBIAN_SOURCES = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
#: The uid and gid the images run as; its home and the volumes' mount points belong to it.
USER_ID = 10001

# What the images run on: python3 with its standard library, CA certificates, /etc/services,
# and the C++ runtime (libstdc++.so.6; libgcc_s.so.1 comes with libc6) that manylinux wheels
# built from C++ (numpy, onnxruntime, protobuf's upb) link against and may not bundle.
_BASE_PACKAGES = tuple(
    "base-files netbase ca-certificates python3-minimal libpython3.11-stdlib libstdc++6".split()
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
#: Mount points of named volumes: a fresh volume takes these owners from the image. The node
#: agent's state directory (var/lib/modelforge/agent) is not among them: only the agent's image
#: has it (its recipe), so a runtime worker's container has no such path to hide from jobs.
USER_DIRS = (
    "var/lib/modelforge",
    "var/cache/modelforge/artifacts",
    "run/modelforge",
)
_SKELETON = {
    **dict.fromkeys(
        ("dev", "proc", "sys", "run", "home", "opt", "var/lib/dpkg", *USER_DIRS), 0o755
    ),
    **{"tmp": 0o1777, "var/tmp": 0o1777, "root": 0o700},
}
#: The modes a layer keeps as they are; `write_tree` decides every other mode itself.
SPECIAL_MODES = {path: mode for path, mode in _SKELETON.items() if mode != 0o755}
_PASSWD = (
    "root:x:0:0:root:/root:/usr/sbin/nologin\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    f"modelforge:x:{USER_ID}:{USER_ID}:ModelForge:/var/lib/modelforge:/usr/sbin/nologin\n"
)
_GROUP = f"root:x:0:\nnogroup:x:65534:\nmodelforge:x:{USER_ID}:\n"
_NSSWITCH = "passwd: files\ngroup: files\nhosts: files dns\nnetworks: files\nservices: files\n"
# The code the cached layer's bytes and package list depend on.
_CODE = (Path(__file__), Path(_tar.__file__), Path(sbom.__file__))


def base_cache_key(sources: tuple[str, ...], epoch: int) -> str:
    """The cache key of the base built from `sources` at `epoch` by the current code."""
    recipe = {
        "suite": DEBIAN_SUITE,
        "packages": _BASE_PACKAGES,
        "sources": sources,
        "epoch": epoch,
        "code": {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in _CODE},
    }
    return hashlib.sha256(canonical_json(recipe)).hexdigest()[:16]


def debian_base(steps: Steps, sources: tuple[str, ...]) -> tuple[Layer, list[sbom.DebianPackage]]:
    """The base layer (from the cache when it holds one for these inputs) and its packages."""
    cached = steps.work_dir / "cache" / f"debian-base-{base_cache_key(sources, steps.epoch)}"
    created_by = f"mmdebstrap --variant=essential {DEBIAN_SUITE} + {','.join(_BASE_PACKAGES)}"
    if not (cached / "packages.json").exists():
        steps.progress(f"debian base: mmdebstrap {DEBIAN_SUITE} (about a minute) ...")
        rootfs = steps.scratch / "rootfs"
        mmdebstrap = shutil.which("mmdebstrap")
        if mmdebstrap is None:
            raise ImageBuildError("mmdebstrap is not installed: apt-get install mmdebstrap")
        excludes = [f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in _UNSHIPPED_DOCS]
        steps.run(
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
        packages = _prune_rootfs(rootfs, run=steps.run)
        steps.progress(f"debian base: kept {len(packages)} packages")
        staged = steps.scratch / "debian-base"
        staged.mkdir()
        owners = dict.fromkeys(USER_DIRS, (USER_ID, USER_ID))
        diff_id = write_tree(
            rootfs, staged / "layer.tar", mtime=steps.epoch, owners=owners, modes=SPECIAL_MODES
        )
        size = (staged / "layer.tar").stat().st_size
        steps.progress(f"  layer {diff_id[:19]}: {size / 1e6:.1f} MB")
        rows = [[p.name, p.version, p.architecture, p.source] for p in packages]
        (staged / "packages.json").write_bytes(canonical_json(rows))
        shutil.rmtree(rootfs)
        shutil.rmtree(cached, ignore_errors=True)
        staged.replace(cached)
    else:
        steps.progress(f"debian base: cached {cached.name}")
    rows = json.loads((cached / "packages.json").read_bytes())
    debian = [sbom.DebianPackage(*row) for row in rows]
    base = cached / "layer.tar"
    return Layer(base, "sha256:" + sha256_file(base), created_by), debian


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
