"""A runtime worker whose protocol the control plane refuses is the worker's problem, not the
agent's: the agent stays up and keeps the node online, says once what to upgrade, claims no
work meanwhile, and takes work again once a compatible worker answers. A real agent process, a
real HTTP server standing in for the control plane, and real worker processes at the socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from modelforge_contracts.errors import error_body
from tests.e2e.node import FAKE_WORKER, wait_until
from tests.node_agent.conftest import (
    CLAIM,
    ENROLL,
    ENROLLED,
    HEARTBEAT,
    INVENTORY,
    Answer,
    Recorded,
    agent_against,
    no_work,
)


def _worker_protocol(request: Recorded) -> object:
    return (json.loads(request.body).get("runtime_worker") or {}).get("protocol_version")


def _respond(request: Recorded) -> Answer:
    if request.path == ENROLL:
        return 200, ENROLLED
    if request.path == INVENTORY and _worker_protocol(request) not in (None, 1):
        # What the control plane answers (control_plane.api.agent.inventory).
        return 426, error_body(
            "TOO_NEW",
            "The runtime-worker speaks protocol 99, newer than 1.",
            "Upgrade the control plane to one that accepts it, or run an older runtime-worker.",
            component="runtime-worker",
        )
    if request.path == CLAIM:
        return no_work(request)
    return 200, {"received_at": "2024-01-01T00:00:00Z"}


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:
        return subprocess.Popen(args, env=env, stdout=handle, stderr=subprocess.STDOUT)


def test_an_incompatible_worker_pauses_work_and_a_compatible_one_resumes_it(
    tmp_path: Path,
) -> None:
    socket_path = tmp_path / "worker.sock"  # where agent_env points the agent
    worker_env = dict(os.environ, MODELFORGE_WORKER_SOCKET=str(socket_path))
    workers = [
        _spawn(
            [sys.executable, "-c", FAKE_WORKER, str(socket_path), "99", "9.9.9"],
            worker_env,
            tmp_path / "fake-worker.log",
        )
    ]
    try:
        wait_until(socket_path.exists, 10, "the stand-in worker's socket")
        with agent_against(_respond, tmp_path) as (server, agent):
            wait_until(lambda: INVENTORY in server.paths(), 20, "the first inventory")
            refused_at = next(r.at for r in server.requests if r.path == INVENTORY)
            time.sleep(3.0)
            assert agent.process.poll() is None, agent.log.read_text()
            beats = [r for r in server.requests if r.path == HEARTBEAT and r.at > refused_at]
            assert len(beats) >= 5, f"{len(beats)} heartbeats in 3 s after the refusal"
            assert CLAIM not in server.paths()  # no work for a worker that cannot run it
            # The refused report is not sent again while it stays the same.
            assert [_worker_protocol(r) for r in server.requests if r.path == INVENTORY] == [99]
            text = agent.log.read_text()
            assert text.count("must be upgraded") == 1, text
            assert "runtime worker 9.9.9 (protocol 99)" in text
            assert "TOO_NEW" in text
            assert "refused this agent's protocol" not in text

            # A compatible worker takes its place: reported, accepted, and work is claimed again.
            workers[0].terminate()
            workers[0].wait(timeout=10)
            workers.append(
                _spawn(
                    [sys.executable, "-m", "runtime_worker"], worker_env, tmp_path / "worker.log"
                )
            )
            wait_until(
                lambda: any(
                    r.path == INVENTORY and _worker_protocol(r) == 1 for r in list(server.requests)
                ),
                30,
                "the compatible worker reported",
            )
            accepted_at = next(
                r.at for r in server.requests if r.path == INVENTORY and _worker_protocol(r) == 1
            )
            wait_until(
                lambda: any(r.path == CLAIM and r.at > accepted_at for r in list(server.requests)),
                20,
                "a claim once the worker is compatible",
            )
            assert agent.process.poll() is None, agent.log.read_text()
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.terminate()
                worker.wait(timeout=20)
    assert agent.exit_code == 0, agent.log.read_text()
    text = agent.log.read_text()
    assert "runtime worker" in text and "is compatible" in text


def test_a_refused_inventory_is_sent_again_each_inventory_interval_until_accepted(
    tmp_path: Path,
) -> None:
    """A restarted control plane forgets its refusal (and its mark), an upgraded one may accept
    the worker: the same refused report is asked about again once per inventory interval, never
    faster. Here the stand-in refuses it twice, then accepts it, as an upgraded one would."""
    interval = 0.6
    refusals = 2
    inventories = 0

    def respond(request: Recorded) -> Answer:
        nonlocal inventories
        if request.path == ENROLL:
            return 200, dict(ENROLLED, inventory_interval_seconds=interval)
        if request.path == INVENTORY:
            inventories += 1
            if inventories > refusals:  # the upgraded control plane accepts the worker
                return 200, {"received_at": "2024-01-01T00:00:00Z"}
        return _respond(request)

    socket_path = tmp_path / "worker.sock"  # where agent_env points the agent
    worker = _spawn(
        [sys.executable, "-c", FAKE_WORKER, str(socket_path), "99", "9.9.9"],
        dict(os.environ, MODELFORGE_WORKER_SOCKET=str(socket_path)),
        tmp_path / "fake-worker.log",
    )
    try:
        wait_until(socket_path.exists, 10, "the stand-in worker's socket")
        with agent_against(respond, tmp_path) as (server, agent):
            wait_until(
                lambda: server.paths().count(INVENTORY) > refusals,
                30,
                "the refused inventory sent again until accepted",
            )
            accepted_at = [r.at for r in server.requests if r.path == INVENTORY][refusals]
            wait_until(
                lambda: any(r.path == CLAIM and r.at > accepted_at for r in list(server.requests)),
                20,
                "a claim once the worker is accepted",
            )
            assert agent.process.poll() is None, agent.log.read_text()
    finally:
        worker.terminate()
        worker.wait(timeout=20)
    assert agent.exit_code == 0, agent.log.read_text()
    sent = [r for r in server.requests if r.path == INVENTORY]
    assert {json.dumps(json.loads(r.body), sort_keys=True) for r in sent} == {
        json.dumps(json.loads(sent[0].body), sort_keys=True)
    }  # the same report each time: asked again, not changed
    gaps = [later.at - earlier.at for earlier, later in zip(sent, sent[1:], strict=False)]
    assert min(gaps) >= interval - 0.1  # once per interval, not at every check (every 0.2 s)
    assert not [r for r in server.requests if r.path == CLAIM and r.at < accepted_at]
    text = agent.log.read_text()
    assert text.count("must be upgraded") == 1, text  # said once, not at every refusal
    assert "runtime worker 9.9.9 (protocol 99) is compatible; claiming work again" in text
