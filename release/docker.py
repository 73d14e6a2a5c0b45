"""`load` against a Docker engine, after `verify`, and the engine calls `up` shares.

`load` runs `docker image load`, compares each loaded image's tag, RootFS layers, architecture
and labels with the manifest (the engine's image ID is not compared: it may change on load) and
records the local image IDs under the state directory (`release.state`), never in the bundle,
which may be read-only. Nothing here passes a secret on a command line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from modelforge_contracts.release_manifest import check_images
from release import state
from release.verify import VerifiedBundle

#: The Compose variable that selects each image (compose/*.yml).
IMAGE_VARIABLES = {
    "modelforge-control-plane": "MODELFORGE_CONTROL_PLANE_IMAGE",
    "modelforge-node-agent": "MODELFORGE_NODE_AGENT_IMAGE",
    "modelforge-runtime-worker": "MODELFORGE_RUNTIME_WORKER_IMAGE",
}


class DockerError(Exception):
    """Docker or Compose refused, or what they produced does not match the release."""


@dataclass(frozen=True)
class InspectedImage:
    tag: str
    image_id: str
    diff_ids: tuple[str, ...]
    architecture: str
    os: str
    labels: dict[str, str]


def run(
    args: Sequence[str], *, env: dict[str, str] | None = None, capture: bool = True
) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(
            list(args),
            env=env,
            text=True,
            check=False,
            capture_output=capture,
        )
    except FileNotFoundError:
        raise DockerError(f"{args[0]} is not installed") from None
    if result.returncode != 0:
        detail = (result.stderr or "").strip().splitlines()[-3:] if capture else []
        raise DockerError(
            f"`{' '.join(args[:3])}` failed (exit {result.returncode}): " + " | ".join(detail)
        )
    return result


def inspect_json(kind: str, reference: str) -> dict[str, Any] | None:
    """`docker <kind> inspect <reference>` as one object, or None if the engine has none."""
    try:
        result = subprocess.run(
            ["docker", kind, "inspect", reference], text=True, capture_output=True, check=False
        )
    except FileNotFoundError:
        raise DockerError("docker is not installed") from None
    if result.returncode != 0:
        return None
    try:
        data = json.loads(result.stdout)
    except ValueError:
        raise DockerError(f"`docker {kind} inspect {reference}` did not print JSON") from None
    if not isinstance(data, list) or len(data) != 1 or not isinstance(data[0], dict):
        raise DockerError(f"`docker {kind} inspect {reference}` printed no single object")
    found: dict[str, Any] = data[0]
    return found


def inspect_image(tag: str) -> InspectedImage | None:
    data = inspect_json("image", tag)
    if data is None:
        return None
    tags = data.get("RepoTags") or []
    config = data.get("Config") or {}
    return InspectedImage(
        tag=tag if tag in tags else (tags[0] if tags else ""),
        image_id=str(data.get("Id", "")),
        diff_ids=tuple((data.get("RootFS") or {}).get("Layers") or ()),
        architecture=str(data.get("Architecture", "")),
        os=str(data.get("Os", "")),
        labels=dict(config.get("Labels") or {}),
    )


def load(bundle: VerifiedBundle, *, say: Callable[[str], None] = print) -> dict[str, str]:
    say(f"loading {bundle.images_tar.name} into the Docker engine")
    run(["docker", "image", "load", "-i", str(bundle.images_tar)], capture=False)
    found = []
    for entry in bundle.manifest.images.values():
        image = inspect_image(entry.tag)
        if image is None:
            raise DockerError(f"{entry.name}: {entry.tag} is not in the engine after the load")
        found.append(image)
    check_images(bundle.manifest, found)
    recorded = {image.tag: image.image_id for image in found}
    path = state.write_record(
        state.LoadRecord(
            version=bundle.manifest.version,
            manifest_sha256=bundle.manifest_sha256,
            images=recorded,
        )
    )
    for tag, image_id in sorted(recorded.items()):
        say(f"loaded {tag} as {image_id}")
    say(f"recorded the local image IDs in {path}")
    return recorded


def compose_command() -> list[str]:
    """`docker compose` (v2) when present, else Debian's `docker-compose` (v1)."""
    try:
        v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    except FileNotFoundError:
        raise DockerError("docker is not installed") from None
    if v2.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise DockerError("neither `docker compose` nor `docker-compose` is installed")
