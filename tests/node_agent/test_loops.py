"""The agent's loops are independent: a call failing and backing off delays only its own loop,
and an unexpected error in a work thread fails that job and nothing else. A real agent process
against a real HTTP server standing in for the control plane; where work is claimed, a stand-in
runtime worker answers at the socket (an agent claims nothing while no worker answers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from modelforge_contracts.errors import error_body
from tests.e2e.node import FAKE_WORKER, wait_until
from tests.node_agent.conftest import (
    CLAIM,
    ENROLL,
    ENROLLED,
    HEARTBEAT,
    TELEMETRY,
    Answer,
    Recorded,
    agent_against,
    no_work,
)


def test_failing_telemetry_never_delays_heartbeats(tmp_path: Path) -> None:
    """A database outage: telemetry answered 503 for as long as it lasts, heartbeats still 200."""

    def respond(request: Recorded) -> Answer:
        if request.path == ENROLL:
            return 200, dict(
                ENROLLED, heartbeat_interval_seconds=0.2, telemetry_interval_seconds=0.2
            )
        if request.path == TELEMETRY:
            return 503, error_body("SERVICE_UNAVAILABLE", "the database is not answering")
        if request.path == CLAIM:
            return no_work(request)
        return 200, {}

    with agent_against(respond, tmp_path) as (server, agent):
        wait_until(lambda: TELEMETRY in server.paths(), 20, "the first telemetry")
        first_refusal = next(r.at for r in server.requests if r.path == TELEMETRY)
        window = 4.0
        time.sleep(window)
        assert agent.process.poll() is None, agent.log.read_text()
    assert agent.exit_code == 0, agent.log.read_text()
    beats = [r.at for r in server.requests if r.path == HEARTBEAT and r.at >= first_refusal]
    beats = [at for at in beats if at <= first_refusal + window]
    # Every 0.2 s for 4 s would be 20; a loaded machine may lose a few, never the schedule.
    assert len(beats) >= 10, f"{len(beats)} heartbeats while telemetry failed"
    gaps = [later - earlier for earlier, later in zip(beats, beats[1:], strict=False)]
    assert max(gaps) < 1.0, f"a heartbeat waited {max(gaps):.1f} s"
    # Telemetry itself backed off (1 s, then 2 s, ...) rather than hammering.
    refusals = [r for r in server.requests if r.path == TELEMETRY]
    assert 2 <= len(refusals) <= 4
    text = agent.log.read_text()
    assert f"HTTP 503 SERVICE_UNAVAILABLE on POST {TELEMETRY} (backoff 1s…16s)" in text


@contextmanager
def _worker_at(socket_path: Path) -> Iterator[None]:
    """A process answering the worker's health endpoint at `socket_path` (protocol 1)."""
    with (socket_path.parent / "fake-worker.log").open("ab") as log:
        worker = subprocess.Popen(
            [sys.executable, "-c", FAKE_WORKER, str(socket_path), "1", "0.1.0"],
            env=dict(os.environ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(socket_path.exists, 10, "the stand-in worker's socket")
        yield
    finally:
        worker.terminate()
        worker.wait(timeout=20)


def test_an_unexpected_error_in_a_job_fails_it_and_the_slot_keeps_serving(tmp_path: Path) -> None:
    broken = {
        "job_id": "job_1",
        "entrypoint": {"kind": "python", "module": "m", "function": "f", "source": {}},
        "progress_interval_seconds": "not a number",  # the agent cannot run this assignment
    }
    handed_out: list[str] = []

    def respond(request: Recorded) -> Answer:
        if request.path == ENROLL:
            return 200, ENROLLED
        if request.path == CLAIM:
            if not handed_out:
                handed_out.append("job_1")
                return 200, broken
            return no_work(request)
        if request.path.endswith("/complete"):
            return 200, {"cancel": False}
        return 200, {}

    complete = "/api/v1/agent/jobs/job_1/complete"
    with _worker_at(tmp_path / "worker.sock"), agent_against(respond, tmp_path) as (server, agent):
        wait_until(lambda: complete in server.paths(), 20, "the job's completion")
        done = next(r for r in server.requests if r.path == complete)
        wait_until(
            lambda: any(r.path == CLAIM and r.at > done.at for r in server.requests),
            10,
            "a claim after the failed job",
        )
        assert agent.process.poll() is None, agent.log.read_text()
    assert agent.exit_code == 0, agent.log.read_text()
    outcome = json.loads(done.body)
    assert outcome["state"] == "failed"
    assert outcome["error"]["code"] == "JOB_AGENT_ERROR"
    assert agent.log.read_text().count("job job_1: unexpected error in the node agent") == 1


def test_a_refused_claim_pauses_before_the_next(tmp_path: Path) -> None:
    """A claim refused with a 4xx that is neither retried nor terminal is logged, and the slot
    waits before claiming again instead of looping as fast as the server answers."""

    def respond(request: Recorded) -> Answer:
        if request.path == ENROLL:
            return 200, ENROLLED
        if request.path == CLAIM:
            return 400, error_body("INVALID_JSON", "the body could not be parsed")
        return 200, {}

    with _worker_at(tmp_path / "worker.sock"), agent_against(respond, tmp_path) as (server, agent):
        wait_until(lambda: CLAIM in server.paths(), 20, "the first claim")
        time.sleep(3.0)
        assert agent.process.poll() is None, agent.log.read_text()
    claims = [r for r in server.requests if r.path == CLAIM]
    assert 2 <= len(claims) <= 5, f"{len(claims)} claims in about 3 s"
    assert f"HTTP 400 INVALID_JSON on POST {CLAIM}" in agent.log.read_text()
