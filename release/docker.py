"""`load`, `up` and `down` against a Docker engine, after `verify`.

`load` runs `docker image load`, compares each loaded image's tag, RootFS layers, architecture
and labels with the manifest (the engine's image ID is not compared: it may change on load) and
records the local image IDs. `up` proves every image is present with its recorded ID before
Compose runs (Compose v1 would otherwise try a registry for a missing image), starts Compose
with `--no-build` (and `--pull never` on v2) and the release tags set explicitly, then checks
that every created container runs the recorded image ID; on any mismatch it stops the stack.
Nothing here passes a secret on a command line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelforge_contracts.release_manifest import (
    MANIFEST_FILE,
    Manifest,
    ManifestError,
    check_images,
    load_manifest,
)
from release.verify import VerifiedBundle

LOADED_FILE = "loaded-images.json"
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


def _run(
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


def inspect_image(tag: str) -> InspectedImage | None:
    result = subprocess.run(
        ["docker", "image", "inspect", tag], text=True, capture_output=True, check=False
    )
    if result.returncode != 0:
        return None
    data: dict[str, Any] = json.loads(result.stdout)[0]
    tags = data.get("RepoTags") or []
    config = data.get("Config") or {}
    return InspectedImage(
        tag=tag if tag in tags else (tags[0] if tags else ""),
        image_id=str(data["Id"]),
        diff_ids=tuple((data.get("RootFS") or {}).get("Layers") or ()),
        architecture=str(data.get("Architecture", "")),
        os=str(data.get("Os", "")),
        labels=dict(config.get("Labels") or {}),
    )


def load(bundle: VerifiedBundle, *, say: Callable[[str], None] = print) -> dict[str, str]:
    say(f"loading {bundle.images_tar.name} into the Docker engine")
    _run(["docker", "image", "load", "-i", str(bundle.images_tar)], capture=False)
    found = []
    for entry in bundle.manifest.images.values():
        image = inspect_image(entry.tag)
        if image is None:
            raise DockerError(f"{entry.name}: {entry.tag} is not in the engine after the load")
        found.append(image)
    check_images(bundle.manifest, found)
    recorded = {image.tag: image.image_id for image in found}
    (bundle.directory / LOADED_FILE).write_text(json.dumps(recorded, indent=2, sort_keys=True))
    for tag, image_id in sorted(recorded.items()):
        say(f"loaded {tag} as {image_id}")
    return recorded


def compose_command() -> list[str]:
    """`docker compose` (v2) when present, else Debian's `docker-compose` (v1)."""
    if (
        subprocess.run(
            ["docker", "compose", "version"], capture_output=True, check=False
        ).returncode
        == 0
    ):
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise DockerError("neither `docker compose` nor `docker-compose` is installed")


def _recorded(directory: Path) -> tuple[Manifest, dict[str, str]]:
    manifest = load_manifest(directory / MANIFEST_FILE)
    try:
        recorded = json.loads((directory / LOADED_FILE).read_text())
    except (OSError, ValueError):
        raise DockerError(
            f"no {LOADED_FILE} in {directory}: run `modelforge-release load` first"
        ) from None
    return manifest, {str(k): str(v) for k, v in recorded.items()}


def _compose(files: Sequence[Path], project: str) -> list[str]:
    command = compose_command() + ["-p", project]
    for path in files:
        command += ["-f", str(path)]
    return command


def up(
    directory: Path,
    compose_files: Sequence[Path],
    *,
    project: str,
    services: Sequence[str] = (),
    say: Callable[[str], None] = print,
) -> dict[str, str]:
    """Start the stack from verified, loaded images only. Returns container name -> image ID."""
    manifest, recorded = _recorded(directory)
    env = dict(os.environ)
    command = _compose(compose_files, project)
    problems = []
    for entry in manifest.images.values():
        env[IMAGE_VARIABLES[entry.name]] = entry.tag
        image = inspect_image(entry.tag)
        if image is None:
            problems.append(f"{entry.tag} is not loaded; run `modelforge-release load` first")
        elif image.image_id != recorded.get(entry.tag):
            problems.append(
                f"{entry.name}: image ID expected {recorded.get(entry.tag)}, found "
                f"{image.image_id} — the tag was replaced since `load`"
            )
        else:
            try:
                check_images(
                    Manifest(manifest.version, manifest.protocol, {entry.name: entry}), [image]
                )
            except ManifestError as exc:
                problems.append(str(exc))
    if problems:
        # Compose v1 would try a registry for a missing image; never get that far. A stack
        # already running from such images is stopped.
        if _run(command + ["ps", "-q"], env=env).stdout.split():
            say("stopping the running stack: its images are not the verified ones")
            _run(command + ["down"], env=env, capture=False)
        raise DockerError("\n".join(problems))
    up_args = ["up", "-d", "--no-build"]
    if command[:2] == ["docker", "compose"]:
        up_args += ["--pull", "never"]
    tool = "docker compose" if command[0] == "docker" else "docker-compose"
    say(f"starting {project} with {tool}")
    _run(command + up_args + list(services), env=env, capture=False)
    containers = _run(command + ["ps", "-q"], env=env).stdout.split()
    running: dict[str, str] = {}
    for container in containers:
        data = json.loads(_run(["docker", "container", "inspect", container]).stdout)[0]
        name = str(data.get("Name", container)).lstrip("/")
        tag = str((data.get("Config") or {}).get("Image", ""))
        image_id = str(data.get("Image", ""))
        running[name] = image_id
        if recorded.get(tag) != image_id:
            problems.append(
                f"container {name}: image ID expected {recorded.get(tag, '(not a release tag)')}"
                f", found {image_id} (image {tag})"
            )
    if problems:
        say("stopping the stack: " + "; ".join(problems))
        _run(command + ["down"], env=env, capture=False)
        raise DockerError("\n".join(problems))
    for name, image_id in sorted(running.items()):
        say(f"{name} runs {image_id}")
    return running


def down(compose_files: Sequence[Path], *, project: str) -> None:
    env = dict(os.environ)
    for variable in IMAGE_VARIABLES.values():
        env.setdefault(variable, "unused:local")
    _run(_compose(compose_files, project) + ["down"], env=env, capture=False)
