"""What each image is: the components, and per component its lock file, command, environment,
exposed ports and labels.

The runtime worker comes in two flavours: `cuda` (the release default, with NVIDIA's CUDA
runtime libraries from `locks/runtime-worker-cuda.lock`) and `cpu`; both get the same tag and
differ in the `io.modelforge.flavour` label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from modelforge_contracts.protocol import PROTOCOL_VERSION
from release._tar import rfc3339
from release.oci import SITE_DIR

COMPONENTS = ("control-plane", "node-agent", "runtime-worker")
FLAVOURS = ("cpu", "cuda")
Flavour = Literal["cpu", "cuda"]
DEFAULT_SOURCE = "https://github.com/modelforge/modelforge"


@dataclass(frozen=True)
class Recipe:
    lock: str
    cmd: tuple[str, ...]
    env: tuple[str, ...] = ()
    ports: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()


def recipe(component: str, flavour: str) -> Recipe:
    """The recipe of `component`; `flavour` matters only to the runtime worker."""
    if component == "control-plane":
        return Recipe(
            "control-plane.lock",
            ("python3", "-m", "control_plane"),
            env=("MODELFORGE_HOST=0.0.0.0", "MODELFORGE_DATA_DIR=/var/lib/modelforge"),
            ports=("8000/tcp",),
        )
    if component == "node-agent":
        return Recipe(
            "node-agent.lock",
            ("python3", "-m", "node_agent"),
            env=("NVIDIA_DRIVER_CAPABILITIES=utility",),
        )
    cuda_env = (
        "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
        f"LD_LIBRARY_PATH=/{SITE_DIR}/nvidia/cuda_runtime/lib",
    )
    return Recipe(
        "runtime-worker-cuda.lock" if flavour == "cuda" else "runtime-worker.lock",
        ("python3", "-m", "runtime_worker"),
        env=cuda_env if flavour == "cuda" else (),
        labels=(("io.modelforge.flavour", flavour),),
    )


def image_name(component: str) -> str:
    return f"modelforge-{component}"


def image_labels(
    component: str,
    recipe: Recipe,
    *,
    version: str,
    revision: str,
    source_date_epoch: int,
    source: str,
) -> dict[str, str]:
    """The OCI labels every image carries, then the component's own."""
    return {
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.created": rfc3339(source_date_epoch),
        "org.opencontainers.image.source": source,
        "org.opencontainers.image.title": image_name(component),
        "org.opencontainers.image.licenses": "Apache-2.0",
        "io.modelforge.component": component,
        "io.modelforge.protocol": str(PROTOCOL_VERSION),
        **dict(recipe.labels),
    }
