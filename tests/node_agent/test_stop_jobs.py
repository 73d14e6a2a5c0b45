"""An agent told to stop (SIGTERM) while a job runs ends the job with it and reports it, before
it exits: a real agent, runtime worker and control plane process. The job is failed
`JOB_AGENT_STOPPED` at once, not `JOB_CONTACT_LOST` once the control plane's contact timeout
runs out, and it does not go on running on the node (issue 42)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.e2e.node import live_stack, wait_until
from tests.e2e.server import FAST

#: Marks that it started, then, were it left running, that it outlived the agent.
WORK = """
import pathlib, time

def work(started, outlived):
    pathlib.Path(started).write_text("started")
    time.sleep(4)
    pathlib.Path(outlived).write_text("still running")
    time.sleep(300)
"""


def test_a_stopped_agent_kills_its_running_job_and_reports_it_before_it_exits(
    tmp_path: Path,
) -> None:
    started, outlived = tmp_path / "started", tmp_path / "outlived"
    with live_stack(tmp_path, FAST) as (server, node):
        job_id = server.submit_python(WORK, "work", started=str(started), outlived=str(outlived))
        node.start_worker().start_agent()
        wait_until(started.exists, 60, "the job to start")

        assert node.stop_agent(signal.SIGTERM) == 0, node.log()
        stopped = time.monotonic()
        # Reported before the agent exited: no waiting for the contact timeout.
        job = server.get(f"/api/v1/jobs/{job_id}")
        assert job["state"] == "failed", job
        assert job["error"]["code"] == "JOB_AGENT_STOPPED", job
        assert "the node agent stopped" in job["error"]["message"]
        # And the job did not outlive it (it would have written `outlived` 4 s after it began).
        time.sleep(max(0.0, 5 - (time.monotonic() - stopped)))
        assert not outlived.exists(), "the job went on running after its agent stopped"
        assert "the agent is stopping; ending it" in node.log()
