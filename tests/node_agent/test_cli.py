"""What the node offers and how long it may idle, from the `MODELFORGE_AGENT_*` variables and
the flags that override them: worked out by the CLI (`node_offer`), then seen where it counts,
in a real agent process: the inventory it sends and the claims it holds at once against a real
HTTP server, with the substitute NVML's two GPUs and a real runtime worker at the socket."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from node_agent.cli import node_offer, parse_args
from node_agent.config import AgentSettings
from node_agent.inventory import Overrides
from tests.e2e.node import Node, wait_until
from tests.node_agent.conftest import (
    CLAIM,
    ENROLL,
    ENROLLED,
    INVENTORY,
    Answer,
    Recorded,
    RecordingServer,
)

RESOURCE_VARIABLES = {
    "MODELFORGE_AGENT_PARALLEL": "3",
    "MODELFORGE_AGENT_CPUS": "3",
    "MODELFORGE_AGENT_GPUS": "1",
    "MODELFORGE_AGENT_RAM_MB": "2048",
    "MODELFORGE_AGENT_MAX_IDLE_SECONDS": "600",
}


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The test process's environment with no agent variable but the control plane's URL."""
    for name in list(os.environ):
        if name.startswith("MODELFORGE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MODELFORGE_AGENT_CONTROL_PLANE_URL", "http://127.0.0.1:9")
    return monkeypatch


def _offer(*flags: str) -> tuple[Overrides, int, float]:
    offer = node_offer(parse_args(list(flags)), AgentSettings())  # type: ignore[call-arg]
    return offer.overrides, offer.parallel, offer.max_idle_seconds


def test_unset_everything_is_detected_one_job_at_a_time_never_idle_out(
    environ: pytest.MonkeyPatch,
) -> None:
    assert _offer() == (Overrides(), 1, 0.0)


def test_empty_variables_count_as_unset(environ: pytest.MonkeyPatch) -> None:
    for name in RESOURCE_VARIABLES:  # what Compose passes for `${VAR:-}`
        environ.setenv(name, "")
    assert _offer() == (Overrides(), 1, 0.0)


def test_the_variables_set_what_the_node_offers(environ: pytest.MonkeyPatch) -> None:
    for name, value in RESOURCE_VARIABLES.items():
        environ.setenv(name, value)
    assert _offer() == (Overrides(cpus=3, ram_mb=2048, gpus_variable=1), 3, 600.0)


def test_flags_override_the_variables(environ: pytest.MonkeyPatch) -> None:
    for name, value in RESOURCE_VARIABLES.items():
        environ.setenv(name, value)
    flags = ["--parallel", "2", "--cpus", "5", "--gpus", "0", "--ram-mb", "1000"]
    overrides, parallel, max_idle = _offer(*flags, "--max-idle-seconds", "0")
    # --gpus stands over everything; the variable stays below SLURM_GPUS_ON_NODE.
    assert overrides == Overrides(cpus=5, gpus=0, ram_mb=1000, gpus_variable=1)
    assert (parallel, max_idle) == (2, 0.0)


def test_each_flag_overrides_only_its_own_variable(environ: pytest.MonkeyPatch) -> None:
    for name, value in RESOURCE_VARIABLES.items():
        environ.setenv(name, value)
    assert _offer("--cpus", "8") == (Overrides(cpus=8, ram_mb=2048, gpus_variable=1), 3, 600.0)
    assert _offer("--max-idle-seconds", "2.5")[2] == 2.5
    assert _offer("--parallel", "0")[1] == 1  # as it always was: 0 slots means one


# -- in a real agent ---------------------------------------------------------------------------


class ClaimCounter:
    """Answers a real agent as the control plane would, holding each claim for a while and
    counting how many are held at once."""

    HOLD = 1.5

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0
        self.most_held = 0

    def respond(self, request: Recorded) -> Answer:
        if request.path == ENROLL:
            return 200, ENROLLED
        if request.path == CLAIM:
            with self._lock:
                self.held += 1
                self.most_held = max(self.most_held, self.held)
            time.sleep(self.HOLD)
            with self._lock:
                self.held -= 1
            return 204, {}
        return 200, {"received_at": "2024-01-01T00:00:00Z"}


def _inventory(server: RecordingServer) -> dict[str, object]:
    sent = [r for r in list(server.requests) if r.path == INVENTORY]
    assert sent, "no inventory"
    inventory: dict[str, object] = json.loads(sent[-1].body)
    return inventory


def _run_agent(
    root: Path, nvml_dir: Path, variables: dict[str, str], *flags: str, slots: int
) -> dict[str, object]:
    """Run an agent with `variables` and `flags` until it holds `slots` claims at once (and
    a while longer: no more than that); return the inventory it sent."""
    counter = ClaimCounter()
    server = RecordingServer(respond=counter.respond).start()
    try:
        with Node(
            root,
            server.url,
            token="mfe_test-token-0123456789",
            mode="nvidia",
            nvml_dir=nvml_dir,
            extra_env=variables,
        ) as node:
            node.start_worker().start_agent(*flags)
            wait_until(lambda: counter.most_held >= slots, 30, f"{slots} claims held at once")
            time.sleep(2 * ClaimCounter.HOLD)  # every slot claims again: still no more
            assert node.agent is not None and node.agent.poll() is None, node.log()
            assert counter.most_held == slots, node.log()
            return _inventory(server)
    finally:
        server.stop()


def test_a_real_agent_offers_what_the_variables_say_and_the_flags_override(
    tmp_path: Path, fake_nvml_dir: Path
) -> None:
    variables = dict(RESOURCE_VARIABLES)

    by_variables = _run_agent(tmp_path / "variables", fake_nvml_dir, variables, slots=3)

    assert (by_variables["cpu_count"], by_variables["memory_mb"]) == (3, 2048)
    gpus = by_variables["gpus"]
    assert isinstance(gpus, list) and [gpu["index"] for gpu in gpus] == [0]  # of NVML's two

    flags = ["--parallel", "2", "--cpus", "5", "--ram-mb", "1000", "--gpus", "0"]
    by_flags = _run_agent(tmp_path / "flags", fake_nvml_dir, variables, *flags, slots=2)

    assert (by_flags["cpu_count"], by_flags["memory_mb"], by_flags["gpus"]) == (5, 1000, [])
