"""The wizard's generated start and recreation commands, run under real Bash with a `docker`
substitute on PATH: the token is never an argument, never traced, never in history;
its env file is mode 0600 while Compose reads it and is gone after success, failure and signals.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from control_plane.errors import InvalidRequest
from control_plane.fleet import node_setup, start_script
from tests.factories import node_agent_entry

TOKEN = "mfe_Wizard-Token-Never-In-Args-0123456789"
SUBSTITUTE = Path(__file__).with_name("docker_substitute.py")
LAYERS = node_agent_entry()["rootfs_layers"]


def worker_tag() -> str:
    return str(node_agent_entry()["tag"]).replace("node-agent", "runtime-worker")


def go_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).replace("&", "\\u0026")


@dataclass
class Node:
    """A node's compose folder, a `docker` substitute and what it recorded."""

    workdir: Path
    env: dict[str, str]
    log: Path
    facts: dict[str, Any]

    def write_facts(self) -> None:
        Path(self.env["MF_DOCKER_FACTS"]).write_text(json.dumps(self.facts))

    def calls(self) -> list[dict[str, object]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def up_call(self) -> dict[str, object]:
        (call,) = [c for c in self.calls() if "up" in c["argv"]]  # type: ignore[operator]
        return call


@pytest.fixture
def node(tmp_path: Path) -> Node:
    entry = node_agent_entry()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(f'#!/bin/sh\nexec {sys.executable} {SUBSTITUTE} "$@"\n')
    docker.chmod(0o755)
    # Compose v1 is its own program; the substitute answers it as `docker compose …`.
    compose_v1 = bin_dir / "docker-compose"
    compose_v1.write_text(f'#!/bin/sh\nexec {sys.executable} {SUBSTITUTE} compose "$@"\n')
    compose_v1.chmod(0o755)
    workdir = tmp_path / "compose"
    workdir.mkdir()
    for name in ("docker-compose.node-agent.yml", "docker-compose.runtime-worker.yml"):
        (workdir / name).write_text("services: {}\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp),
        "MF_DOCKER_LOG": str(tmp_path / "docker.log"),
        "MF_DOCKER_FACTS": str(tmp_path / "facts.json"),
    }
    agent_id, worker_id = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    worker_tag = str(entry["tag"]).replace("node-agent", "runtime-worker")
    facts: dict[str, Any] = {
        "images": {
            entry["tag"]: {
                "id": agent_id,
                "layers": LAYERS,
                "architecture": "amd64",
                "os": "linux",
                "labels_json": go_json(entry["labels"]),
            },
            worker_tag: {"id": worker_id},
        },
        "containers": {
            "node-agent": {
                "id": "c-agent",
                "image": agent_id,
                "env": ["MODELFORGE_AGENT_ENROLLMENT_TOKEN=", "PATH=/usr/bin"],
            },
            "runtime-worker": {"id": "c-worker", "image": worker_id},
        },
    }
    result = Node(workdir=workdir, env=env, log=tmp_path / "docker.log", facts=facts)
    result.write_facts()
    return result


def commands(
    entry: dict[str, object] | None = None, offer: start_script.AgentOffer | None = None
) -> tuple[str, str, str]:
    image = node_setup.choose_image(
        image_source="bundle",
        manifest_entry=json.dumps(entry or node_agent_entry()),
        registry_image=None,
        release_manifest=None,
    )
    return node_setup.render(
        enrollment_id="enr_test",
        display_name="GPU node 7",
        api_origin="http://127.0.0.1:8000",
        accelerator_mode="cpu",
        image=image,
        offer=offer,
    )


def run_bash(
    node: Node, script: str, *, stdin: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", script],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=node.workdir,
        env={**node.env, **(extra_env or {})},
        timeout=60,
        check=False,
    )


def assert_token_never_leaked(node: Node, *outputs: str) -> None:
    for call in node.calls():
        assert TOKEN not in " ".join(call["argv"])  # type: ignore[arg-type]
    for output in outputs:
        assert TOKEN not in output
    assert TOKEN not in (node.workdir / "modelforge-node.env").read_text()
    assert list(Path(node.env["TMPDIR"]).iterdir()) == []


def test_start_command_passes_the_token_only_through_a_private_env_file(node: Node) -> None:
    _, start, _ = commands()
    # `set -x` first, as an operator's shell might have it: the command must switch it off.
    result = run_bash(node, "set -x\n" + start, stdin=TOKEN + "\n")

    assert result.returncode == 0, result.stderr
    assert "node agent started" in result.stdout
    up = node.up_call()
    argv = up["argv"]
    assert "--no-build" in argv and argv[argv.index("--pull") + 1] == "never"  # type: ignore[union-attr,index]
    assert up["env_file_mode"] == 0o600
    assert f"MODELFORGE_AGENT_ENROLLMENT_TOKEN={TOKEN}\n" in up["env_file_content"]  # type: ignore[operator]
    assert not Path(up["env_file"]).exists()  # type: ignore[arg-type]
    assert_token_never_leaked(node, result.stdout, result.stderr)
    env_file = (node.workdir / "modelforge-node.env").read_text()
    assert "MODELFORGE_AGENT_CONTROL_PLANE_URL=http://127.0.0.1:8000" in env_file
    assert "MODELFORGE_NODE_AGENT_IMAGE=modelforge-node-agent:" in env_file
    # The image ID was captured before Compose ran, and the container was checked against it.
    argvs = [c["argv"] for c in node.calls()]
    id_at = argvs.index(["image", "inspect", "--format", "{{.Id}}", str(node_agent_entry()["tag"])])
    up_at = argvs.index(argv)
    assert id_at < up_at
    assert argv[-2:] == ["node-agent", "runtime-worker"]
    assert ["inspect", "--format", "{{.Image}}", "c-agent"] in argvs[up_at:]
    assert ["inspect", "--format", "{{.Image}}", "c-worker"] in argvs[up_at:]
    assert f"MODELFORGE_RUNTIME_WORKER_IMAGE={worker_tag()}" in env_file


def test_token_stays_out_of_an_interactive_shells_history(node: Node) -> None:
    _, start, _ = commands()
    history = Path(node.env["HOME"]) / "history"
    result = subprocess.run(
        ["bash", "--norc", "--noprofile", "-i"],
        input=start + TOKEN + "\necho pasted-and-done\nexit\n",
        capture_output=True,
        text=True,
        cwd=node.workdir,
        env={**node.env, "HISTFILE": str(history), "HISTSIZE": "1000"},
        timeout=60,
        check=False,
    )
    assert "node agent started" in result.stdout, result.stderr
    recorded = history.read_text()
    assert "echo pasted-and-done" in recorded  # history was written ...
    assert TOKEN not in recorded  # ... and the token, read at the prompt, is not in it
    assert_token_never_leaked(node, result.stdout, result.stderr)


def test_env_file_is_removed_when_compose_fails(node: Node) -> None:
    _, start, _ = commands()
    result = run_bash(node, start, stdin=TOKEN + "\n", extra_env={"MF_DOCKER_UP": "fail"})

    assert result.returncode != 0
    up = node.up_call()
    assert up["env_file_mode"] == 0o600
    assert not Path(up["env_file"]).exists()  # type: ignore[arg-type]
    assert_token_never_leaked(node, result.stdout, result.stderr)


def _as_at_a_terminal() -> None:
    """In the child before it runs Bash: Ctrl-C and Ctrl-\\ as a terminal's foreground job gets
    them. A run started in the background of a non-interactive shell (as `cmd &` does) ignores
    SIGINT and SIGQUIT, every child inherits that, and Bash cannot trap a signal ignored when it
    started: the test would then wait for a script that never saw the Ctrl-C."""
    for signum in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_env_file_is_removed_on_a_signal(node: Node, signum: signal.Signals) -> None:
    _, start, _ = commands()
    with subprocess.Popen(
        ["bash", "--norc", "--noprofile", "-c", start],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=node.workdir,
        env={**node.env, "MF_DOCKER_UP": "hang"},
        start_new_session=True,  # its own process group, like a terminal's foreground job
        preexec_fn=_as_at_a_terminal,  # noqa: PLW1509 - signal dispositions only, before exec
    ) as process:
        try:
            _interrupt_while_up(node, process, signum)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


def _interrupt_while_up(node: Node, process: subprocess.Popen[str], signum: signal.Signals) -> None:
    assert process.stdin is not None
    process.stdin.write(TOKEN + "\n")
    process.stdin.flush()
    deadline = time.monotonic() + 30
    while not any("up" in c["argv"] for c in node.calls()):  # type: ignore[operator]
        assert time.monotonic() < deadline, "compose up was never called"
        time.sleep(0.05)
    env_path = Path(node.up_call()["env_file"])  # type: ignore[arg-type]
    assert env_path.exists() and stat.S_IMODE(env_path.stat().st_mode) == 0o600

    os.killpg(process.pid, signum)  # Ctrl-C (or a kill) reaches the whole foreground job
    stdout, stderr = process.communicate(timeout=30)

    assert process.returncode != 0
    assert not env_path.exists()
    assert_token_never_leaked(node, stdout, stderr)


def test_a_loaded_image_that_differs_from_the_entry_stops_before_the_token_is_read(
    node: Node,
) -> None:
    agent_tag = str(node_agent_entry()["tag"])
    node.facts["images"][agent_tag]["layers"] = [LAYERS[0], "sha256:" + "3" * 64]
    node.write_facts()
    _, start, _ = commands()
    result = run_bash(node, start, stdin=TOKEN + "\n")

    assert result.returncode != 0
    assert "rootfs_layers differs from the release manifest entry" in result.stderr
    assert not any("up" in c["argv"] for c in node.calls())  # type: ignore[operator]
    assert_token_never_leaked(node, result.stdout, result.stderr)


def test_a_container_on_another_image_is_stopped(node: Node) -> None:
    node.facts["containers"]["runtime-worker"]["image"] = "sha256:" + "c" * 64
    node.write_facts()
    _, start, _ = commands()
    result = run_bash(node, start, stdin=TOKEN + "\n")

    assert result.returncode != 0
    assert "runtime-worker runs image sha256:ccc" in result.stderr
    assert any("stop" in c["argv"] for c in node.calls())  # type: ignore[operator]


def test_recreate_command_drops_the_token_and_keeps_the_image(node: Node) -> None:
    _, start, recreate = commands()
    assert run_bash(node, start, stdin=TOKEN + "\n").returncode == 0
    node.log.unlink()

    result = run_bash(node, recreate, stdin="")

    assert result.returncode == 0, result.stderr
    up = node.up_call()
    assert "--force-recreate" in up["argv"]  # type: ignore[operator]
    assert up["env_file"] == "modelforge-node.env"
    assert "ENROLLMENT_TOKEN" not in up["env_file_content"]  # type: ignore[operator]

    node.facts["containers"]["node-agent"]["env"] = [f"MODELFORGE_AGENT_ENROLLMENT_TOKEN={TOKEN}"]
    node.write_facts()
    still = run_bash(node, recreate, stdin="")
    assert still.returncode != 0
    assert "still has the enrollment token" in still.stderr
    assert TOKEN not in still.stdout + still.stderr


def test_compose_v1_gets_no_pull_flag_and_the_empty_array_survives_set_u(node: Node) -> None:
    _, start, recreate = commands()
    v1 = {"MF_DOCKER_COMPOSE": "v1"}
    result = run_bash(node, start, stdin=TOKEN + "\n", extra_env=v1)

    assert result.returncode == 0, result.stderr
    argv = node.up_call()["argv"]
    assert "--no-build" in argv and "--pull" not in argv
    assert node.up_call()["env_file_mode"] == 0o600
    assert_token_never_leaked(node, result.stdout, result.stderr)
    node.log.unlink()
    assert run_bash(node, recreate, stdin="", extra_env=v1).returncode == 0


@pytest.mark.parametrize(
    "api_origin",
    [
        "http://127.0.0.1:$(id)",
        "http://127.0.0.1:8000\nMODELFORGE_AGENT_TLS_VERIFY=false",
        "http://127.0.0.1:8000/path",
        "http://a b",
        "http://127.0.0.1:123456",
    ],
)
def test_nothing_but_a_plain_origin_reaches_the_env_file(api_origin: str) -> None:
    """The wizard's check refuses these first; the script itself also refuses to write one."""
    image = node_setup.choose_image(
        image_source="bundle",
        manifest_entry=json.dumps(node_agent_entry()),
        registry_image=None,
        release_manifest=None,
    )
    for render in (
        lambda: node_setup.check_api_origin(api_origin, None),
        lambda: node_setup.render(
            enrollment_id="enr_test",
            display_name="GPU node 7",
            api_origin=api_origin,
            accelerator_mode="cpu",
            image=image,
        ),
    ):
        with pytest.raises(InvalidRequest) as refused:
            render()
        assert refused.value.code == "API_ORIGIN_INVALID"


OFFER_VARIABLES = tuple(start_script.OFFER_VARIABLES.values())
COMPOSE = Path(__file__).resolve().parents[2] / "compose"


def env_settings(env_file: str) -> dict[str, str]:
    lines = [line for line in env_file.splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def test_the_env_file_leaves_what_the_node_offers_to_the_agent_unless_given() -> None:
    env_file, _, _ = commands()
    settings = env_settings(env_file)
    assert not [name for name in settings if name in OFFER_VARIABLES]
    assert "MODELFORGE_AGENT_RESTART" not in settings  # Compose's default, unless-stopped


def test_the_env_file_carries_each_setting_given() -> None:
    offer = start_script.AgentOffer(parallel=3, cpus=12, gpus=0, ram_mb=48000, max_idle_seconds=600)
    settings = env_settings(commands(offer=offer)[0])
    assert {name: settings[name] for name in OFFER_VARIABLES} == {
        "MODELFORGE_AGENT_PARALLEL": "3",
        "MODELFORGE_AGENT_CPUS": "12",
        "MODELFORGE_AGENT_GPUS": "0",  # 0 is a setting (no GPU offered), not "left out"
        "MODELFORGE_AGENT_RAM_MB": "48000",
        "MODELFORGE_AGENT_MAX_IDLE_SECONDS": "600",
    }
    # An idle exit is code 0: the container must then stay stopped, not be started again.
    assert settings["MODELFORGE_AGENT_RESTART"] == "on-failure"
    only_parallel = env_settings(commands(offer=start_script.AgentOffer(parallel=2))[0])
    assert [name for name in only_parallel if name in OFFER_VARIABLES] == [
        "MODELFORGE_AGENT_PARALLEL"
    ]
    never_idle = env_settings(commands(offer=start_script.AgentOffer(max_idle_seconds=0))[0])
    assert never_idle["MODELFORGE_AGENT_MAX_IDLE_SECONDS"] == "0"
    assert "MODELFORGE_AGENT_RESTART" not in never_idle


def test_every_setting_the_wizard_writes_is_one_the_compose_file_passes_on() -> None:
    offer = start_script.AgentOffer(parallel=3, cpus=1, gpus=1, ram_mb=1, max_idle_seconds=1)
    written = env_settings(commands(offer=offer)[0])
    compose = (COMPOSE / "docker-compose.node-agent.yml").read_text()
    for name in [*OFFER_VARIABLES, "MODELFORGE_AGENT_RESTART"]:
        assert name in written
        assert "${" + name + ":-" in compose, f"{name} is written but Compose ignores it"


@pytest.mark.parametrize("value", [True, -1, 2.5, "3", "3\nMODELFORGE_AGENT_TLS_VERIFY=false"])
def test_nothing_but_a_whole_number_reaches_the_env_file_as_a_setting(value: object) -> None:
    """The request's schema refuses these first; the script itself also refuses to write one."""
    with pytest.raises(InvalidRequest) as refused:
        start_script.AgentOffer(parallel=value)  # type: ignore[arg-type]
    assert "parallel" in refused.value.message


def test_the_start_command_hands_the_settings_to_compose_and_the_recreation_keeps_them(
    node: Node,
) -> None:
    _, start, recreate = commands(offer=start_script.AgentOffer(parallel=3, ram_mb=8000))
    assert run_bash(node, start, stdin=TOKEN + "\n").returncode == 0
    given = env_settings(str(node.up_call()["env_file_content"]))
    assert given["MODELFORGE_AGENT_PARALLEL"] == "3" and given["MODELFORGE_AGENT_RAM_MB"] == "8000"
    node.log.unlink()
    assert run_bash(node, recreate, stdin="").returncode == 0
    kept = env_settings(str(node.up_call()["env_file_content"]))
    assert kept["MODELFORGE_AGENT_PARALLEL"] == "3" and kept["MODELFORGE_AGENT_RAM_MB"] == "8000"
