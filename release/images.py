"""Build the three ModelForge images without a Docker daemon and without a registry.

Each image has three layers: a Debian bookworm root filesystem made from Debian's packages by
mmdebstrap and pruned to what python3 and the C++ runtime need at run time (shared, byte for
byte, by all three); the component's dependencies from its hash-locked wheels under `locks/`;
the project's own wheel. `release.recipes` says which components exist and what each runs,
`release.rootfs` makes the Debian base, `release.oci` the Python layers and the image configs;
this module checks the arguments and puts the pieces together. Layers and configs are
deterministic, so two builds of the same inputs give the same diff_ids and image IDs.

Every image is checked before it is returned (`release.elfcheck`): each ELF file's interpreter
and DT_NEEDED libraries must resolve inside the image, except the few its recipe says the
NVIDIA Container Toolkit provides at run time; otherwise the build fails naming each file and
library.

It must never pull from a container registry, talk to a Docker daemon, leave a shell, apt or
dpkg in an image, or let the build host's paths, users or clock into a layer or a config.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from release import elfcheck, sbom
from release._tar import canonical_json
from release.oci import (
    ARCHITECTURE,
    CONSOLE,
    OS,
    SITE_DIR,
    BuiltImage,
    ImageBuildError,
    Steps,
    image_config,
)
from release.recipes import (
    COMPONENTS,
    DEFAULT_SOURCE,
    FLAVOURS,
    Flavour,
    image_labels,
    image_name,
    recipe,
)
from release.rootfs import DEBIAN_SOURCES, DEBIAN_SUITE, USER_DIRS, USER_ID, debian_base

# The public names of the image build, wherever they are defined.
__all__ = [
    "ARCHITECTURE",
    "COMPONENTS",
    "CONSOLE",
    "DEBIAN_SOURCES",
    "DEBIAN_SUITE",
    "DEFAULT_SOURCE",
    "OS",
    "PROJECT_DIR",
    "SITE_DIR",
    "USER_ID",
    "BuiltImage",
    "ImageBuildError",
    "build_images",
]

PROJECT_DIR = Path(__file__).resolve().parent.parent


def build_images(
    *,
    version: str,
    revision: str,
    source_date_epoch: int,
    work_dir: Path,
    worker_flavour: Flavour = "cuda",
    components: Sequence[str] = COMPONENTS,
    progress: Callable[[str], None] = print,
    source: str = DEFAULT_SOURCE,
    debian_sources: Sequence[str] = DEBIAN_SOURCES,
    project_dir: Path = PROJECT_DIR,
) -> list[BuiltImage]:
    """Build the images of `components`; layer tars are kept under `work_dir/layers`.

    The pruned Debian base is cached under `work_dir/cache`, keyed by its recipe, the sources,
    SOURCE_DATE_EPOCH and the code that makes it (see `release.rootfs`); everything else is
    rebuilt on every call.
    """
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", version):
        raise ImageBuildError(f"version {version!r} is not a valid image tag")
    unknown = sorted(set(components) - set(COMPONENTS))
    if unknown or not components:
        raise ImageBuildError(f"unknown components {unknown}; choose from {list(COMPONENTS)}")
    if worker_flavour not in FLAVOURS:
        raise ImageBuildError(f"worker flavour {worker_flavour!r} is neither 'cpu' nor 'cuda'")
    work_dir = work_dir.resolve()
    scratch = work_dir / "build"
    shutil.rmtree(scratch, ignore_errors=True)
    for folder in ("layers", "logs", "build", "cache"):
        (work_dir / folder).mkdir(parents=True, exist_ok=True)
    steps = Steps(work_dir, source_date_epoch, progress)

    base, debian = debian_base(steps, tuple(debian_sources))
    app, app_dists = steps.application(project_dir)
    images = []
    for component in COMPONENTS:
        if component not in components:
            continue
        component_recipe = recipe(component, worker_flavour)
        deps, dists = steps.dependencies(
            project_dir / "locks" / component_recipe.lock,
            unshipped=component_recipe.unshipped,
            directories=_owned(component_recipe.own_directories),
            programs=[(project_dir / built, placed) for built, placed in component_recipe.programs],
        )
        name = image_name(component)
        labels = image_labels(
            component,
            component_recipe,
            version=version,
            revision=revision,
            source_date_epoch=source_date_epoch,
            source=source,
        )
        layers = (base, deps, app)
        config_fields = image_config(
            layers=layers,
            user=USER_ID,
            cmd=component_recipe.cmd,
            env=component_recipe.env,
            ports=component_recipe.ports,
            labels=labels,
            epoch=source_date_epoch,
        )
        config = canonical_json(config_fields)
        checked = elfcheck.check_image(
            name,
            [layer.path for layer in layers],
            config_fields["config"]["Env"],
            dict(component_recipe.provided_at_run_time),
        )
        if not checked.ok:
            raise ImageBuildError(elfcheck.failure_message(checked))
        progress(checked.summary())
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
                    programs=[
                        sbom.built_program(project_dir / built)
                        for built, _ in component_recipe.programs
                    ],
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


def _owned(directories: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Owners for an image's own directories and the directories above them in its layer: the
    image's user for those and for the base's volume mount points (a layer's entry for a
    directory replaces the base's owner and mode), root for the rest."""
    owners: dict[str, tuple[int, int]] = {}
    for directory in directories:
        parts = directory.split("/")
        for depth in range(1, len(parts) + 1):
            path = "/".join(parts[:depth])
            mine = path == directory or path in USER_DIRS
            owners[path] = (USER_ID, USER_ID) if mine else (0, 0)
    return owners
