"""The idle exit: `Activity` counts the time with no job in hand and no service (by a clock the
test moves), and a real agent with `MODELFORGE_AGENT_MAX_IDLE_SECONDS` against a real control
plane process and a real runtime worker stays while its job runs, then exits with 0 and says
why once the node has been idle that long."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from node_agent.idle import Activity
from tests.e2e.node import live_stack, wait_until
from tests.e2e.server import FAST


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_idle_is_counted_from_the_start_with_nothing_to_do(clock: ManualClock) -> None:
    activity = Activity(clock=clock)
    clock.now += 4.5
    assert activity.idle_for() == 4.5


def test_a_job_in_hand_is_not_idle_and_idle_counts_again_from_its_end(clock: ManualClock) -> None:
    activity = Activity(clock=clock)
    clock.now += 10
    activity.job_claimed()
    activity.job_claimed()
    clock.now += 60
    assert activity.idle_for() == 0
    activity.job_ended()  # one of two: still busy
    clock.now += 5
    assert activity.idle_for() == 0
    activity.job_ended()
    clock.now += 3
    assert activity.idle_for() == 3


def test_services_keep_the_node_busy_until_there_are_none(clock: ManualClock) -> None:
    activity = Activity(clock=clock)
    activity.services(2)
    clock.now += 30
    assert activity.idle_for() == 0
    activity.job_claimed()
    activity.services(0)  # a job is still in hand
    clock.now += 30
    assert activity.idle_for() == 0
    activity.job_ended()
    activity.services(0)  # told again: idle since the job ended, not since now
    clock.now += 2
    assert activity.idle_for() == 2


NAP = """
import time

def nap(seconds):
    time.sleep(seconds)
    return "rested"
"""


def test_the_agent_exits_with_0_once_idle_for_its_maximum_not_while_a_job_runs(
    tmp_path: Path,
) -> None:
    max_idle = 4.0
    with live_stack(
        tmp_path, FAST, extra_env={"MODELFORGE_AGENT_MAX_IDLE_SECONDS": str(max_idle)}
    ) as (server, node):
        # Queued before the agent starts: its first claim takes it, at once.
        job_id = server.submit_python(NAP, "nap", seconds=2 * max_idle)
        node.start_worker().start_agent()
        node.node_id()

        def state() -> str:
            return str(server.get(f"/api/v1/jobs/{job_id}")["state"])

        wait_until(lambda: state() == "running", 30, "the job running")
        wait_until(lambda: state() in ("succeeded", "failed"), 60, "the job's end")
        ended = time.monotonic()
        assert state() == "succeeded", server.get(f"/api/v1/jobs/{job_id}")
        assert node.agent is not None and node.agent.poll() is None, node.log()  # busy all along

        code = node.wait_agent_exit(timeout=max_idle + 20)
        exited = time.monotonic()

        assert code == 0, node.log()
        # Idle counted from the job's end (its outcome reached the control plane just before
        # `ended`), not from the start: the job alone ran for twice the maximum.
        assert exited - ended >= max_idle - 1.5, node.log()
        log = node.log()
        assert "(maximum idle time 4 s, MODELFORGE_AGENT_MAX_IDLE_SECONDS): stopping" in log, log
        assert "received SIGTERM" not in log
        node.agent = None  # exited: nothing left to stop
