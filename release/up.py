"""`up` and `down`: start Compose from verified, loaded images only, and stop it.

`up` trusts nothing it has not just checked. In order: the signatures of SHA256SUMS with the
pinned key and the release manifest's checksum (`verify.verify_release_manifest`); that this
manifest is the one `load` recorded (`release.state`); that every release image is present with
its recorded image ID and matches the manifest (Compose v1 would otherwise try a registry for a
missing image, whatever `pull_policy` says); then, from the configuration Compose resolves, that
every service it would start runs its own image — a release service (control-plane, node-agent,
runtime-worker) exactly its release tag, any other service (the optional PostgreSQL) an image
named by digest (`name@sha256:…`) that is already present and is no release image — so no
service can trigger a registry pull or run a release image under another service's name. Only
then Compose starts, with `--no-build` (and `--pull never` on v2) and the release tags set
explicitly; afterwards every created container must run the image ID planned for its service.
On any mismatch after a start the stack is stopped and `up` fails.

Before it asks the engine anything else, `up` refuses a Docker Engine older than 24 (the
version the engine reports), unless told to start on it anyway (`allow_old_engine`: a host
whose distribution ships an older engine, at the operator's own risk), which it then says.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from modelforge_contracts.release_manifest import Manifest, ManifestError, check_images
from release import state
from release.docker import (
    IMAGE_VARIABLES,
    MIN_ENGINE_MAJOR,
    DockerError,
    compose_command,
    engine_major,
    engine_version,
    inspect_image,
    inspect_json,
    run,
)
from release.verify import verify_release_manifest

#: The release services and the image each of them runs.
SERVICE_IMAGES = {
    "control-plane": "modelforge-control-plane",
    "node-agent": "modelforge-node-agent",
    "runtime-worker": "modelforge-runtime-worker",
}
POSTGRES_IMAGE_VARIABLE = "MODELFORGE_POSTGRES_IMAGE"
_DIGEST_REFERENCE = re.compile(r"[^@\s]+@sha256:[0-9a-f]{64}")
_SERVICE_LABEL = "com.docker.compose.service"
_LOAD_POSTGRES = (
    f"load it offline (`docker image load -i postgres.tar`), then set {POSTGRES_IMAGE_VARIABLE}="
    "<name>@sha256:<digest> as `docker image inspect --format '{{index .RepoDigests 0}}' "
    "<name>:<tag>` prints it (see docs/install.md)"
)


def up(
    directory: Path,
    compose_files: Sequence[Path],
    *,
    project: str,
    public_key: Path,
    services: Sequence[str] = (),
    say: Callable[[str], None] = print,
    allow_old_engine: bool = False,
) -> dict[str, str]:
    """Start the stack from verified, loaded images only. Returns container name -> image ID."""
    manifest, manifest_sha256 = verify_release_manifest(directory, public_key)
    record = state.read_record(manifest.version)
    if record.manifest_sha256 != manifest_sha256:
        raise DockerError(
            f"release-manifest.json: SHA-256 expected {record.manifest_sha256} (the manifest "
            f"`load` verified and loaded), found {manifest_sha256}; run `modelforge-release "
            "load` with this bundle first"
        )
    _check_engine(allow_old_engine, say)
    env = dict(os.environ)
    for entry in manifest.images.values():
        if entry.name in IMAGE_VARIABLES:
            env[IMAGE_VARIABLES[entry.name]] = entry.tag
    command = _compose(compose_files, project)
    if problems := _release_image_problems(manifest, record.images):
        # Never get as far as Compose; a stack already running from such images is stopped.
        if run(command + ["ps", "-q"], env=env).stdout.split():
            say("stopping the running stack: its images are not the verified ones")
            run(command + ["down"], env=env, capture=False)
        raise DockerError("\n".join(problems))
    declared = _resolved_services(command, env)
    targets = _targets(declared, services, env.get("COMPOSE_PROFILES", ""))
    plan, problems = _plan(declared, targets, manifest, record.images)
    if problems:
        raise DockerError("\n".join(problems))
    up_args = ["up", "-d", "--no-build"]
    if command[:2] == ["docker", "compose"]:
        up_args += ["--pull", "never"]
    tool = "docker compose" if command[0] == "docker" else "docker-compose"
    say(f"starting {project} with {tool}: {', '.join(sorted(targets))}")
    run(command + up_args + list(services), env=env, capture=False)
    running, problems = _check_containers(command, env, plan, manifest, record.images)
    if problems:
        say("stopping the stack: " + "; ".join(problems))
        run(command + ["down"], env=env, capture=False)
        raise DockerError("\n".join(problems))
    for name, image_id in sorted(running.items()):
        say(f"{name} runs {image_id}")
    return running


def down(compose_files: Sequence[Path], *, project: str) -> None:
    env = dict(os.environ)
    for variable in IMAGE_VARIABLES.values():
        env.setdefault(variable, "unused:local")
    run(_compose(compose_files, project) + ["down"], env=env, capture=False)


def _check_engine(allow_old: bool, say: Callable[[str], None]) -> None:
    version = engine_version()
    major = engine_major(version)
    if major is not None and major >= MIN_ENGINE_MAJOR:
        return
    found = (
        f"the Docker Engine is {version}, older than {MIN_ENGINE_MAJOR}"
        if major is not None
        else f"the Docker Engine reports version {version!r}, not a Docker Engine version"
    )
    if allow_old:
        say(f"warning: {found}; starting on it anyway (--allow-old-docker), unsupported")
        return
    raise DockerError(
        f"{found}: ModelForge needs Docker Engine {MIN_ENGINE_MAJOR} or later (docs/nodes.md); "
        "upgrade the engine, or pass --allow-old-docker to start on it anyway, unsupported"
    )


def _compose(files: Sequence[Path], project: str) -> list[str]:
    command = compose_command() + ["-p", project]
    for path in files:
        command += ["-f", str(path)]
    return command


def _release_image_problems(manifest: Manifest, recorded: Mapping[str, str]) -> list[str]:
    problems = []
    for entry in manifest.images.values():
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
    return problems


def _resolved_services(command: list[str], env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The services of the configuration Compose resolves from the files and the environment."""
    import yaml  # type: ignore[import-untyped]

    text = run(command + ["config"], env=env).stdout
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DockerError(f"the configuration Compose resolved is not YAML ({exc})") from None
    services = config.get("services") if isinstance(config, dict) else None
    if not isinstance(services, dict) or not all(isinstance(s, dict) for s in services.values()):
        raise DockerError("the configuration Compose resolved has no services")
    return {str(name): spec for name, spec in services.items()}


def _targets(
    declared: Mapping[str, Mapping[str, Any]], requested: Sequence[str], profiles_env: str
) -> set[str]:
    """What `compose up` starts: the services named (or those of the active profiles), and
    everything they depend on."""
    profiles = {profile.strip() for profile in profiles_env.split(",") if profile.strip()}

    def active(spec: Mapping[str, Any]) -> bool:
        own = spec.get("profiles") or []
        return not own or "*" in profiles or bool(profiles.intersection(own))

    pending = list(requested) or [name for name, spec in declared.items() if active(spec)]
    targets: set[str] = set()
    while pending:
        name = pending.pop()
        if name in targets:
            continue
        targets.add(name)
        depends = (declared.get(name) or {}).get("depends_on") or []
        pending.extend(str(dependency) for dependency in _names(depends))
    return targets


def _names(value: Any) -> Iterable[Any]:
    return value.keys() if isinstance(value, dict) else value if isinstance(value, list) else []


def _plan(
    declared: Mapping[str, Mapping[str, Any]],
    targets: Iterable[str],
    manifest: Manifest,
    recorded: Mapping[str, str],
) -> tuple[dict[str, str], list[str]]:
    """Service -> the image ID it must run, and every reason not to start at all."""
    release_tags = {entry.tag: name for name, entry in manifest.images.items()}
    release_ids = {image_id: tag for tag, image_id in recorded.items()}
    plan: dict[str, str] = {}
    problems = []
    for service in sorted(targets):
        spec = declared.get(service)
        image = spec.get("image") if spec is not None else None
        if spec is None:
            problems.append(f"service {service} is not in the compose files")
        elif not isinstance(image, str) or not image:
            problems.append(f"service {service} names no image; `up` builds nothing")
        elif service in SERVICE_IMAGES:
            entry = manifest.images.get(SERVICE_IMAGES[service])
            if entry is None:
                problems.append(
                    f"service {service}: release {manifest.version} has no image "
                    f"{SERVICE_IMAGES[service]}"
                )
            elif image != entry.tag:
                problems.append(
                    f"service {service}: image expected {entry.tag} (its release image), "
                    f"found {image}; a release image runs only under its own service"
                )
            else:
                plan[service] = recorded.get(entry.tag, "")
        elif image in release_tags:
            problems.append(
                f"service {service}: image {image} is the release image {release_tags[image]}; "
                "a release image runs only under its own service"
            )
        elif not _DIGEST_REFERENCE.fullmatch(image):
            hint = f"; {_LOAD_POSTGRES}" if service == "postgres" else ""
            problems.append(
                f"service {service}: image expected a reference by digest "
                f"(name@sha256:<digest>) so that nothing is pulled, found {image!r}{hint}"
            )
        else:
            found = inspect_json("image", image)
            found_id = str(found.get("Id", "")) if found is not None else None
            if found_id is None:
                hint = _LOAD_POSTGRES if service == "postgres" else "load it first"
                problems.append(
                    f"service {service}: image {image} is not present in the engine and is "
                    f"never pulled; {hint}"
                )
            elif found_id in release_ids:
                problems.append(
                    f"service {service}: image {image} is the release image "
                    f"{release_ids[found_id]}; a release image runs only under its own service"
                )
            else:
                plan[service] = found_id
    return plan, problems


def _check_containers(
    command: list[str],
    env: dict[str, str],
    plan: Mapping[str, str],
    manifest: Manifest,
    recorded: Mapping[str, str],
) -> tuple[dict[str, str], list[str]]:
    """Container name -> image ID of every container of the project, and every container
    that does not run the image planned for its service."""
    expected = dict(plan)
    for service, image_name in SERVICE_IMAGES.items():
        entry = manifest.images.get(image_name)
        if entry is not None:
            expected.setdefault(service, recorded.get(entry.tag, ""))
    release_ids = set(recorded.values())
    running: dict[str, str] = {}
    problems = []
    for container in run(command + ["ps", "-q"], env=env).stdout.split():
        data = inspect_json("container", container) or {}
        name = str(data.get("Name", container)).lstrip("/")
        labels = (data.get("Config") or {}).get("Labels") or {}
        service = str(labels.get(_SERVICE_LABEL, ""))
        image = str((data.get("Config") or {}).get("Image", ""))
        image_id = str(data.get("Image", ""))
        running[name] = image_id
        want = expected.get(service)
        if want is not None and image_id != want:
            problems.append(
                f"container {name} (service {service}): image ID expected {want}, found "
                f"{image_id} (image {image})"
            )
        elif want is None and image_id in release_ids:
            problems.append(
                f"container {name} (service {service}) runs a release image under another "
                "service's name"
            )
    return running, problems
