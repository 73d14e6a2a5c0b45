"""The release against a real Docker engine: build the three images without Docker, bundle, sign,
verify, then load and `up` from a read-only bundle (the record of the load goes to the state
directory) the control plane, node agent (cpu mode) and runtime worker; enroll the agent through
the admin API until the node is ready; every container runs its recorded image ID. `up` refuses
a manifest edited after the load, a release image under another service's name, and a
PostgreSQL image that is not named by digest or not loaded, before Compose starts anything; a
container from a different image under the same tag makes `up` fail and stop the stack.

The control plane binds a LAN address of its own (on an interface this test makes, beyond
loopback) and its nodes reach it over plain http:// on a trusted network (issue 42): the node's
Compose files pass the opt-in (`MODELFORGE_AGENT_ALLOW_INSECURE_HTTP`), the wizard writes it
once told the operator confirmed, and the node runs a job in the released worker image."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from release.cli import main as release
from release.docker import compose_command
from release.state import STATE_DIR_VARIABLE, record_path
from tests.e2e.server import free_port
from tests.e2e_docker.conftest import VERSION
from tests.release import crafted
from tests.release.synthetic import resign

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose"
CP_FILES = [COMPOSE / "docker-compose.yml", COMPOSE / "docker-compose.release-manifest.yml"]
NODE_FILES = [
    COMPOSE / "docker-compose.node-agent.yml",
    COMPOSE / "docker-compose.runtime-worker.yml",
    Path(__file__).with_name("compose.node-host-network.yml"),
]
RELEASE_TAGS = [
    f"{name}:{VERSION}"
    for name in ("modelforge-control-plane", "modelforge-node-agent", "modelforge-runtime-worker")
]
#: The rest of the control plane's compose files, as options after a service name.
CP_FILES_ARGS = [arg for path in CP_FILES[1:] for arg in ("-f", str(path))]


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


#: The LAN address the control plane binds: a private address on an interface of this test's own.
LAN_ADDRESS = "10.213.7.1"


@pytest.fixture
def lan_address() -> Iterator[str]:
    """`LAN_ADDRESS` on an interface made for the test (one end of a veth pair whose other end
    goes nowhere; removed after): an address of this host beyond loopback, which nothing outside
    it reaches. (A veth pair, not a dummy interface: CI's kernel has no dummy module.)"""
    name = f"mflan{os.getpid() % 100000}"
    subprocess.run(
        ["ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}p"], check=True
    )
    try:
        subprocess.run(["ip", "addr", "add", f"{LAN_ADDRESS}/32", "dev", name], check=True)
        for end in (name, f"{name}p"):
            subprocess.run(["ip", "link", "set", end, "up"], check=True)
        yield LAN_ADDRESS
    finally:
        subprocess.run(["ip", "link", "del", name], check=False)


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's own state directory: what `load` records, outside the bundle."""
    folder = tmp_path / "release-state"
    monkeypatch.setenv(STATE_DIR_VARIABLE, str(folder))
    return folder


@pytest.fixture
def read_only_bundle(
    release_bundle: tuple[Path, Path], tmp_path: Path
) -> Iterator[tuple[Path, Path]]:
    """The bundle behind a read-only bind mount, as on read-only media (root ignores modes)."""
    bundle, public = release_bundle
    mounted = tmp_path / "read-only-bundle"
    mounted.mkdir()
    subprocess.run(["mount", "--bind", str(bundle), str(mounted)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mounted)], check=True)
        with pytest.raises(OSError, match="Read-only file system"):
            (mounted / "probe").write_text("x")
        yield mounted, public
    finally:
        subprocess.run(["umount", str(mounted)], check=False)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _project_containers(project: str, service: str | None = None) -> list[str]:
    filters = ["--filter", f"label=com.docker.compose.project={project}"]
    if service:
        filters += ["--filter", f"label=com.docker.compose.service={service}"]
    return docker("ps", "-aq", *filters).stdout.split()


def _logs(project: str) -> str:
    return "\n".join(
        docker("logs", "--tail", "30", container, check=False).stdout
        + docker("logs", "--tail", "30", container, check=False).stderr
        for container in _project_containers(project)
    )


def test_tampered_bundle_loads_nothing(release_bundle: tuple[Path, Path], tmp_path: Path) -> None:
    bundle, public = release_bundle
    tampered = tmp_path / "tampered"
    subprocess.run(["cp", "-r", str(bundle), str(tampered)], check=True)
    data = json.loads((tampered / "release-manifest.json").read_text())
    data["images"]["modelforge-node-agent"]["architecture"] = "arm64"
    (tampered / "release-manifest.json").write_text(json.dumps(data))
    for image in ("modelforge-control-plane", "modelforge-node-agent", "modelforge-runtime-worker"):
        docker("image", "rm", "-f", f"{image}:{VERSION}", check=False)
    assert release(["load", str(tampered), "--key", str(public)]) == 1
    assert (
        docker("image", "inspect", f"modelforge-node-agent:{VERSION}", check=False).returncode != 0
    )
    assert not record_path(VERSION).exists()


def _engine_images() -> set[str]:
    return set(docker("image", "ls", "-a", "-q", "--no-trunc").stdout.split())


def test_crafted_tars_load_nothing(release_bundle: tuple[Path, Path], tmp_path: Path) -> None:
    """The three bypasses of issue 24, on the real bundle, re-signed with its key: the engine
    itself would load the hidden config under the node agent's tag, but `load` refuses each
    one before Docker reads a byte, and the engine's images stay as they were."""
    bundle, public = release_bundle
    private = public.with_name("cosign.key")
    for tag in RELEASE_TAGS:
        docker("image", "rm", "-f", tag, check=False)
    before = _engine_images()
    first = None
    for name in crafted.HIDDEN_PAYLOAD:
        tampered = tmp_path / name.replace(" ", "-").replace("/", "slash")
        subprocess.run(["cp", "-r", str(bundle), str(tampered)], check=True)
        crafted.VARIANTS[name][0](tampered)
        resign(tampered, private)
        assert release(["verify", str(tampered), "--key", str(public)]) == 1, name
        assert release(["load", str(tampered), "--key", str(public)]) == 1, name
        assert _engine_images() == before, name
        assert not record_path(VERSION).exists()
        first = first or tampered
    assert first is not None

    # What the verifier guards against: the engine, given the crafted tar itself, loads the
    # hidden config (uid 0) under the node agent's tag.
    tar = first / f"modelforge-{VERSION}-images.tar"
    try:
        docker("image", "load", "-i", str(tar))
        user = docker("image", "inspect", "--format", "{{.Config.User}}", RELEASE_TAGS[1])
        assert user.stdout.strip() == "0:0"
    finally:
        for tag in RELEASE_TAGS:
            docker("image", "rm", "-f", tag, check=False)
        for image in _engine_images() - before:
            docker("image", "rm", "-f", image, check=False)
    assert _engine_images() == before


def _up(bundle: Path, public: Path, project: str, files: list[Path], *extra: str) -> int:
    # scripts/ensure-docker installs Debian 12's docker.io, an engine 20.10, which `up` refuses
    # unless told (the refusal itself: tests/release/test_up.py, with a substitute engine).
    return release(
        ["up", str(bundle), "-p", project, *sum((["-f", str(f)] for f in files), []), *extra]
        + ["--key", str(public), "--allow-old-docker"]
    )


def _refusals_before_compose(bundle: Path, public: Path, tmp_path: Path, project: str) -> None:
    """Each of these is refused before Compose runs: nothing of `project` is ever created."""
    # A release image under another service's name.
    renamed = tmp_path / "renamed.yml"
    renamed.write_text(f"services:\n  node-agent:\n    image: modelforge-control-plane:{VERSION}\n")
    os.environ["MODELFORGE_AGENT_CONTROL_PLANE_URL"] = "http://127.0.0.1:1"
    try:
        assert _up(bundle, public, project, [*NODE_FILES, renamed]) == 1
    finally:
        os.environ.pop("MODELFORGE_AGENT_CONTROL_PLANE_URL", None)
    # PostgreSQL by tag, then by a digest that is not loaded: either could be pulled.
    os.environ["COMPOSE_PROFILES"] = "postgres"
    try:
        os.environ.pop("MODELFORGE_POSTGRES_IMAGE", None)
        assert _up(bundle, public, project, CP_FILES) == 1
        os.environ["MODELFORGE_POSTGRES_IMAGE"] = "postgres@sha256:" + "0" * 64
        assert _up(bundle, public, project, CP_FILES) == 1
    finally:
        os.environ.pop("COMPOSE_PROFILES", None)
        os.environ.pop("MODELFORGE_POSTGRES_IMAGE", None)
    # A release manifest edited after the load (a copy of the bundle, so the original stays).
    edited = tmp_path / "edited"
    subprocess.run(["cp", "-r", str(bundle), str(edited)], check=True)
    data = json.loads((edited / "release-manifest.json").read_text())
    data["images"]["modelforge-control-plane"]["labels"]["io.modelforge.protocol"] = "9"
    (edited / "release-manifest.json").write_text(json.dumps(data))
    assert _up(edited, public, project, CP_FILES) == 1
    assert _project_containers(project) == []


def test_release_end_to_end(
    read_only_bundle: tuple[Path, Path],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    lan_address: str,
) -> None:
    bundle, public = read_only_bundle
    assert release(["verify", str(bundle), "--key", str(public)]) == 0
    assert release(["load", str(bundle), "--key", str(public)]) == 0
    recorded = json.loads(record_path(VERSION).read_text())["images"]
    assert sorted(recorded) == RELEASE_TAGS
    # The classic image store (vfs): each image ID is its config's digest, as `load` checked.
    manifest = json.loads((bundle / "release-manifest.json").read_text())["images"]
    assert {entry["tag"]: entry["config_digest"] for entry in manifest.values()} == recorded

    # Shell-less: the image runs its default command, and `sh` does not exist in it.
    no_shell = docker(
        "run",
        "--rm",
        "--network",
        "none",
        f"modelforge-node-agent:{VERSION}",
        "sh",
        "-c",
        "true",
        check=False,
    )
    assert no_shell.returncode != 0
    preflight = docker(
        "run",
        "--rm",
        "--network",
        "none",
        "-e",
        "MODELFORGE_AGENT_ACCELERATOR_MODE=nvidia",
        f"modelforge-node-agent:{VERSION}",
        "python3",
        "-m",
        "node_agent",
        "--preflight",
        check=False,
    )
    assert preflight.returncode == 3 and "NVIDIA_NVML_UNAVAILABLE" in preflight.stdout

    port = free_port()
    cp_project, node_project = f"mfcp{port}", f"mfnode{port}"
    os.environ.update(
        MODELFORGE_PORT=str(port),
        MODELFORGE_BIND_ADDRESS=lan_address,
        MODELFORGE_RELEASE_MANIFEST_SOURCE=str(bundle / "release-manifest.json"),
    )
    wizard_dir = tmp_path / "wizard-compose"
    worker_tag = f"modelforge-runtime-worker:{VERSION}"
    try:
        capfd.readouterr()
        _refusals_before_compose(bundle, public, tmp_path, cp_project)
        refusals = capfd.readouterr().err
        for words in (
            "service node-agent: image expected modelforge-node-agent:0.1.0 (its release image), "
            "found modelforge-control-plane:0.1.0",
            "service postgres: image expected a reference by digest",
            f"service postgres: image postgres@sha256:{'0' * 64} is not present in the engine",
            "release-manifest.json: SHA-256 expected",
        ):
            assert words in refusals, refusals
        # Options and services in any order.
        assert _up(bundle, public, cp_project, CP_FILES[:1], "control-plane", *CP_FILES_ARGS) == 0
        url = f"http://{lan_address}:{port}"
        _wait(
            lambda: httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200,
            90,
            "control plane health",
        )
        # The image serves the built console at / (and its hashed assets).
        console = httpx.get(f"{url}/", timeout=5)
        assert console.status_code == 200 and "<title>ModelForge console</title>" in console.text
        asset = re.search(r'src="(/assets/[^"]+\.js)"', console.text)
        assert asset and httpx.get(url + asset.group(1), timeout=5).status_code == 200
        container = _project_containers(cp_project)[0]
        admin_token = docker(
            "exec",
            container,
            "python3",
            "-c",
            "import sys; sys.stdout.write(open('/var/lib/modelforge/admin-token').read().strip())",
        ).stdout
        admin = {"X-ModelForge-Admin-Token": admin_token}
        minted = httpx.post(
            f"{url}/api/v1/admin/node-enrollments",
            headers=admin,
            json={"display_name": "docker-node", "expires_in_seconds": 900},
        ).json()
        node_env = tmp_path / "node.env"
        fd = os.open(node_env, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(
                f"MODELFORGE_AGENT_ENROLLMENT_TOKEN={minted['token']}\n"
                f"MODELFORGE_AGENT_CONTROL_PLANE_URL={url}\n"
                "MODELFORGE_AGENT_ACCELERATOR_MODE=cpu\n"
                # Plain http:// beyond loopback: the trusted-LAN opt-in the Compose file passes.
                "MODELFORGE_AGENT_ALLOW_INSECURE_HTTP=true\n"
            )
        for line in node_env.read_text().splitlines():
            key, value = line.split("=", 1)
            os.environ[key] = value
        try:
            assert _up(bundle, public, node_project, NODE_FILES) == 0
        finally:
            os.environ.pop("MODELFORGE_AGENT_ENROLLMENT_TOKEN", None)  # used once, at creation
            node_env.unlink()
        node_id = minted["node_id"]
        try:
            _wait(
                lambda: (
                    httpx.get(f"{url}/api/v1/admin/nodes/{node_id}/readiness", headers=admin)
                    .json()
                    .get("ready")
                    is True
                ),
                120,
                "node readiness",
            )
        except AssertionError:
            readiness = httpx.get(f"{url}/api/v1/admin/nodes/{node_id}/readiness", headers=admin)
            raise AssertionError(f"{readiness.text}\n{_logs(node_project)}") from None
        _run_a_job(url, admin)
        for project in (cp_project, node_project):
            for container in _project_containers(project):
                info = json.loads(docker("container", "inspect", container).stdout)[0]
                assert info["Image"] == recorded[info["Config"]["Image"]]
                assert info["HostConfig"]["ReadonlyRootfs"] is True
                assert info["HostConfig"]["CapDrop"] == ["ALL"]
                assert info["Config"]["User"] == "10001:10001"

        _wizard_start_command(bundle, url, admin, wizard_dir)

        # A container from a different image under the same tag: `up` fails and stops the stack.
        docker("tag", f"modelforge-control-plane:{VERSION}", worker_tag)
        os.environ["MODELFORGE_RUNTIME_WORKER_IMAGE"] = worker_tag
        subprocess.run(
            [
                *compose_command(),
                "-p",
                node_project,
                *sum((["-f", str(f)] for f in NODE_FILES), []),
                "up",
                "-d",
                "--no-build",
                "--force-recreate",
                "runtime-worker",
            ],
            check=True,
            capture_output=True,
            env=_env(
                MODELFORGE_AGENT_CONTROL_PLANE_URL=url,
                MODELFORGE_NODE_AGENT_IMAGE=f"modelforge-node-agent:{VERSION}",
            ),
        )
        assert _up(bundle, public, node_project, NODE_FILES) == 1
        assert _project_containers(node_project) == []
    finally:
        # The worker's tag back on the worker's image: no control-plane image under its name.
        docker("tag", recorded[worker_tag], worker_tag, check=False)
        wizard_files = [wizard_dir / name for name in WIZARD_FILES]
        for project, files in (
            ("modelforge-node", wizard_files),
            (node_project, NODE_FILES),
            (cp_project, CP_FILES),
        ):
            if not all(f.exists() for f in files):
                continue
            subprocess.run(
                [
                    *compose_command(),
                    "-p",
                    project,
                    *sum((["-f", str(f)] for f in files), []),
                    "down",
                    "-v",
                ],
                capture_output=True,
                env=_env(
                    MODELFORGE_AGENT_CONTROL_PLANE_URL="http://127.0.0.1:1",
                    MODELFORGE_CONTROL_PLANE_IMAGE="x:local",
                    MODELFORGE_NODE_AGENT_IMAGE="x:local",
                    MODELFORGE_RUNTIME_WORKER_IMAGE="x:local",
                ),
            )
        for key in (
            "MODELFORGE_RUNTIME_WORKER_IMAGE",
            "MODELFORGE_AGENT_CONTROL_PLANE_URL",
            "MODELFORGE_AGENT_ACCELERATOR_MODE",
            "MODELFORGE_AGENT_ALLOW_INSECURE_HTTP",
            "MODELFORGE_PORT",
            "MODELFORGE_BIND_ADDRESS",
            "MODELFORGE_RELEASE_MANIFEST_SOURCE",
        ):
            os.environ.pop(key, None)
    for tag in RELEASE_TAGS:
        found = docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()
        assert found == recorded[tag], f"{tag} is left tagged to {found}"


def _run_a_job(url: str, admin: dict[str, str]) -> None:
    """A Python job through the node's released agent and worker images: it succeeds."""
    job = {
        "entrypoint": {
            "kind": "python",
            "module": "job",
            "function": "work",
            "source": {"job.py": "def work(x):\n    return x * 2\n"},
        },
        "params": {"x": 21},
    }
    submitted = httpx.post(f"{url}/api/v1/jobs", headers=admin, json=job)
    assert submitted.status_code == 201, submitted.text
    path = f"{url}/api/v1/jobs/{submitted.json()['job_id']}"

    def ended() -> bool:
        return httpx.get(path, headers=admin).json()["state"] in ("succeeded", "failed")

    _wait(ended, 120, "the job on the LAN node")
    done = httpx.get(path, headers=admin).json()
    assert (done["state"], done["result"]) == ("succeeded", 42), done


WIZARD_FILES = ("docker-compose.node-agent.yml", "docker-compose.runtime-worker.yml")


def _wizard_start_command(bundle: Path, url: str, admin: dict[str, str], folder: Path) -> None:
    """The Enroll node wizard's API, then its generated start and recreation commands run by
    real Bash against real Docker (Compose v1 here), from a copy of the release's compose/."""
    entry = json.loads((bundle / "release-manifest.json").read_text())["images"][
        "modelforge-node-agent"
    ]
    checked = httpx.post(
        f"{url}/api/v1/admin/node-images/check",
        headers=admin,
        json={"manifest_entry": json.dumps(entry)},
    )
    assert checked.status_code == 200, checked.text
    assert "release manifest" in checked.json()["checked_against"]
    forged = {**entry, "labels": {**entry["labels"], "org.opencontainers.image.revision": "x"}}
    refused = httpx.post(
        f"{url}/api/v1/admin/node-images/check",
        headers=admin,
        json={"manifest_entry": json.dumps(forged)},
    )
    assert refused.status_code == 422
    assert "label org.opencontainers.image.revision" in refused.json()["error"]["message"]

    minted = httpx.post(
        f"{url}/api/v1/admin/node-enrollments",
        headers=admin,
        json={"display_name": "wizard-node", "expires_in_seconds": 900},
    ).json()
    setup = httpx.post(
        f"{url}/api/v1/admin/node-enrollments/{minted['enrollment_id']}/node-setup",
        headers={**admin, "Origin": url},
        json={
            "api_origin": url,
            "accelerator_mode": "cpu",
            "manifest_entry": json.dumps(entry),
            # Plain http:// to a LAN address: the wizard writes the opt-in once confirmed.
            "allow_insecure_http": True,
        },
    ).json()
    assert "MODELFORGE_AGENT_ALLOW_INSECURE_HTTP=true" in setup["env_file"], setup
    folder.mkdir()
    for name in WIZARD_FILES:
        text = (COMPOSE / name).read_text()
        if name == "docker-compose.node-agent.yml":  # this control plane is on this host
            text = text.replace("    restart:", "    network_mode: host\n    restart:", 1)
        (folder / name).write_text(text)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}

    def bash(script: str, stdin: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", script],
            input=stdin,
            cwd=folder,
            env=clean,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    started = bash(setup["start_command"], minted["token"] + "\n")
    assert started.returncode == 0, started.stdout + started.stderr
    assert minted["token"] not in started.stdout + started.stderr
    assert minted["token"] not in (folder / "modelforge-node.env").read_text()

    def ready() -> bool:
        answer = httpx.get(f"{url}/api/v1/admin/nodes/{minted['node_id']}/readiness", headers=admin)
        return answer.status_code == 200 and answer.json()["ready"] is True

    def agent_environment() -> list[str]:
        (container,) = _project_containers("modelforge-node", service="node-agent")
        info = json.loads(docker("container", "inspect", container).stdout)[0]
        return list(info["Config"]["Env"])

    _wait(ready, 120, "readiness of the node started by the wizard's command")
    assert f"MODELFORGE_AGENT_ENROLLMENT_TOKEN={minted['token']}" in agent_environment()

    recreated = bash(setup["recreate_command"], "")
    assert recreated.returncode == 0, recreated.stdout + recreated.stderr
    after = time.time()
    assert "MODELFORGE_AGENT_ENROLLMENT_TOKEN=" in agent_environment()  # present, but empty
    assert not any(minted["token"] in line for line in agent_environment())

    def heard_since_recreation() -> bool:
        node = httpx.get(f"{url}/api/v1/admin/nodes/{minted['node_id']}", headers=admin).json()
        seen = node["last_heartbeat_at"]
        return seen is not None and datetime.fromisoformat(seen).timestamp() > after and ready()

    # The same node (persisted identity and credential), heard from after the recreation.
    _wait(heard_since_recreation, 120, "readiness after recreation")
