"""`load` against a Docker engine, after `verify`, and the engine calls `up` shares.

`load` never hands Docker the bundle's images tar: it pipes into `docker image load` a tar it
writes itself from the entries verify checked (`archive.write_verified_images_tar`), so no
second reader ever parses the bundle's bytes. Then it compares each loaded image's ID with the
manifest's `config_digest` where the engine's ID is the config's digest (the classic image
store; the containerd image store's ID is a manifest's digest), and its tag, RootFS layers,
architecture and labels with the manifest, and records the local image IDs under the state
directory (`release.state`), never in the bundle, which may be read-only. Nothing here passes a
secret on a command line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, cast

from modelforge_contracts.release_manifest import Manifest, check_images
from release import archive, state
from release.errors import ReleaseError
from release.verify import VerifiedBundle

#: The Compose variable that selects each image (compose/*.yml).
IMAGE_VARIABLES = {
    "modelforge-control-plane": "MODELFORGE_CONTROL_PLANE_IMAGE",
    "modelforge-node-agent": "MODELFORGE_NODE_AGENT_IMAGE",
    "modelforge-runtime-worker": "MODELFORGE_RUNTIME_WORKER_IMAGE",
}


class DockerError(ReleaseError):
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
    say(f"loading the verified images of {bundle.images_tar.name} into the Docker engine")
    _pipe_verified_images(bundle)
    found = []
    for entry in bundle.manifest.images.values():
        image = inspect_image(entry.tag)
        if image is None:
            raise DockerError(f"{entry.name}: {entry.tag} is not in the engine after the load")
        found.append(image)
    if image_ids_are_config_digests():
        check_image_ids(bundle.manifest, found)
    else:
        say(
            "the engine's containerd image store names images by manifest digest: image IDs "
            "are recorded, not compared with config_digest"
        )
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


def _pipe_verified_images(bundle: VerifiedBundle) -> None:
    """`docker image load` reading, on its stdin, the tar written from the verified entries.

    A config or layer that no longer matches what verify found stops the stream inside an entry
    and the load is killed: Docker unpacks the whole tar before it loads anything, so it loads
    nothing from a stream that ends early."""
    with tempfile.TemporaryFile() as errors:
        try:
            process = subprocess.Popen(
                ["docker", "image", "load"], stdin=subprocess.PIPE, stderr=errors
            )
        except FileNotFoundError:
            raise DockerError("docker is not installed") from None
        stdin = cast(IO[bytes], process.stdin)  # stdin=PIPE: never None
        try:
            archive.write_verified_images_tar(bundle.images_tar, bundle.images, stdin)
            stdin.close()
        except archive.ArchiveError as exc:
            _stop(process)
            raise DockerError(f"{exc}; the load was stopped, verify the bundle again") from None
        except BrokenPipeError:
            pass  # docker stopped reading: its exit status and message say why
        except OSError as exc:  # reading the bundle again failed (it went away, a disk error)
            _stop(process)
            raise DockerError(
                f"cannot read {bundle.images_tar} again ({exc.strerror or type(exc).__name__}); "
                "the load was stopped and loaded nothing: check the bundle's files and disk, "
                "then verify the bundle again"
            ) from None
        finally:
            if not stdin.closed:
                try:
                    stdin.close()
                except BrokenPipeError:
                    pass
        if (code := process.wait()) != 0:
            errors.seek(0)
            detail = errors.read(64 << 10).decode(errors="replace").strip().splitlines()[-3:]
            raise DockerError(f"`docker image load` failed (exit {code}): " + " | ".join(detail))


def _stop(load: subprocess.Popen[bytes]) -> None:
    """Kill a `docker image load` before its stream ended (it loads nothing then) and reap it."""
    load.kill()
    load.wait()


def image_ids_are_config_digests() -> bool:
    """Whether the engine's image ID is the SHA-256 of the image's config: true for the classic
    image store (every storage driver but the containerd snapshotters)."""
    status = run(["docker", "info", "--format", "{{json .DriverStatus}}"]).stdout
    try:
        pairs = json.loads(status) or []
    except ValueError:
        raise DockerError("`docker info` did not print the storage driver's status") from None
    return not any(
        isinstance(pair, list) and pair[:1] == ["driver-type"] and "containerd" in str(pair[1:])
        for pair in pairs
    )


def check_image_ids(manifest: Manifest, found: Sequence[InspectedImage]) -> None:
    """Each release image's engine ID is the `config_digest` the manifest names: the engine
    loaded exactly the config verify checked under that tag."""
    by_tag = {image.tag: image for image in found}
    problems = []
    for entry in manifest.images.values():
        image = by_tag.get(entry.tag)
        if image is not None and image.image_id != entry.config_digest:
            problems.append(
                f"{entry.name}: image ID expected {entry.config_digest} (config_digest), found "
                f"{image.image_id}; the engine holds another config under {entry.tag}"
            )
    if problems:
        raise DockerError("\n".join(problems))


#: The oldest Docker Engine major version a ModelForge node or control plane is run on.
MIN_ENGINE_MAJOR = 24


def engine_version() -> str:
    """The Docker Engine's version, as the engine itself reports it (`docker version`'s server
    part, read from the engine's API: the client's own version says nothing of the engine)."""
    reported = run(["docker", "version", "--format", "{{.Server.Version}}"]).stdout.strip()
    if not reported:
        raise DockerError("`docker version` reported no engine version")
    return reported.splitlines()[0][:64]


def engine_major(version: str) -> int | None:
    """The major number of an engine version ("20.10.24+dfsg1" -> 20); None if it has none."""
    digits = version.removeprefix("v").split(".", 1)[0]
    return int(digits) if digits.isdigit() else None


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
