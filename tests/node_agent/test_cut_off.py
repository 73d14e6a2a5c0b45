"""A node cut off from the control plane while the control plane stays up (issue 42): a real
control plane, runtime worker and agent, the agent's every connection (its calls and its tunnel)
through a proxy that drops its traffic (tests/e2e/cut.py).

- A job with `stop_after_disconnect_seconds` is killed on the node once the node has not reached
  the control plane for that long, and reported `JOB_NODE_CUT_OFF` when contact returns.
- After a partition long enough for the control plane to fail a running job
  (`JOB_CONTACT_LOST`) and free the GPU it held (a GPU of the NVML substitute), the node starts
  no new job on that GPU before the old holder is gone, though the job waiting for it is
  claimed at the first call that gets through.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.e2e.cut import CuttableProxy
from tests.e2e.node import Node, wait_until
from tests.e2e.server import FAST, LiveServer
from tests.nvml_substitute import build_fake_nvml

#: Marks that it started, then writes the time into `alive` ten times a second until killed
#: (each time whole: a new file renamed over the old).
ALIVE = """
import os, pathlib, time

def work(started, alive):
    pathlib.Path(started).write_text("started")
    for _ in range(3000):
        pathlib.Path(alive + ".new").write_text(repr(time.time()))
        os.replace(alive + ".new", alive)
        time.sleep(0.1)
"""

#: Writes the time it started.
STARTED_AT = """
import pathlib, time

def work(started_at):
    pathlib.Path(started_at).write_text(repr(time.time()))
"""

#: The agent notices a call that gets no answer within this (seconds).
AGENT = {"MODELFORGE_AGENT_REQUEST_TIMEOUT_SECONDS": "2"}


def _still(alive: Path, quiet: float = 1.0) -> bool:
    """The job writing `alive` has stopped (nothing written for `quiet` seconds)."""
    return alive.exists() and time.time() - float(alive.read_text()) > quiet


def _job(server: LiveServer, job_id: str) -> dict[str, Any]:
    return dict(server.get(f"/api/v1/jobs/{job_id}"))


@contextmanager
def _behind_a_proxy(
    root: Path, settings: dict[str, str], **node_options: Any
) -> Iterator[tuple[LiveServer, CuttableProxy, Node]]:
    """A control plane on SQLite and a node, its processes not started, whose every connection
    to the control plane goes through a proxy that can drop its traffic."""
    with LiveServer(root / "cp", f"sqlite:///{root / 'cp.db'}", settings) as server:
        with CuttableProxy(server.port) as proxy:
            token = server.mint()["token"]
            node = Node(root / "node", proxy.url, token=token, extra_env=AGENT, **node_options)
            with node:
                yield server, proxy, node


def test_a_job_asking_for_it_is_killed_once_its_node_is_cut_off_for_that_long(
    tmp_path: Path,
) -> None:
    started, alive = tmp_path / "started", tmp_path / "alive"
    limit = 30.0  # the figure
    with _behind_a_proxy(tmp_path, FAST) as (server, proxy, node):
        job_id = server.submit_python(
            ALIVE,
            "work",
            job_fields={"stop_after_disconnect_seconds": limit},
            started=str(started),
            alive=str(alive),
        )
        assert _job(server, job_id)["stop_after_disconnect_seconds"] == limit
        node.start_worker().start_agent()
        wait_until(started.exists, 60, "the job to start")
        wait_until(lambda: not _still(alive, 0.5), 10, "the job to write")

        proxy.cut()
        cut = time.monotonic()
        wait_until(lambda: _still(alive), limit + 15, "the job to be killed on the cut-off node")
        killed_after = time.monotonic() - cut - 1.0  # it was still for the last second
        # Its limit counts from the last call that got through (at most a heartbeat, half a
        # second, before the cut); a call timing out (2 s) tells the agent it is cut off.
        assert limit - 1.0 <= killed_after <= limit + 4.0, killed_after
        assert "stop_after_disconnect_seconds: 30); killing it" in node.log()
        # The control plane up all along knows nothing of it yet (its contact timeout: 90 s).
        assert _job(server, job_id)["state"] == "running"

        proxy.mend()
        wait_until(lambda: _job(server, job_id)["state"] == "failed", 30, "the report")
        error = _job(server, job_id)["error"]
        assert error["code"] == "JOB_NODE_CUT_OFF", error
        assert "could not reach the control plane for 30 s" in error["message"]


def test_after_a_partition_no_new_job_starts_before_the_one_the_node_lost_is_gone(
    tmp_path: Path,
) -> None:
    started, alive, b_started = tmp_path / "started", tmp_path / "alive", tmp_path / "b"
    settings = {
        **FAST,
        "MODELFORGE_JOB_CONTACT_TIMEOUT_SECONDS": "3",
        "MODELFORGE_JOB_PROGRESS_INTERVAL_SECONDS": "1",
    }
    one_gpu = {"resources": {"cpus": 0.5, "gpus": 1}}
    nvml = build_fake_nvml(tmp_path / "nvml")
    with _behind_a_proxy(tmp_path, settings, mode="nvidia", nvml_dir=nvml) as (server, proxy, node):
        # A job without stop_after_disconnect_seconds: it runs on through the partition.
        a = server.submit_python(
            ALIVE, "work", job_fields=one_gpu, started=str(started), alive=str(alive)
        )
        # One GPU offered, two slots: B waits for the GPU A holds while a slot claims.
        node.start_worker().start_agent("--parallel", "2", "--gpus", "1")
        wait_until(started.exists, 60, "job A to start")
        b = server.submit_python(STARTED_AT, "work", job_fields=one_gpu, started_at=str(b_started))

        proxy.cut()
        wait_until(lambda: _job(server, a)["state"] == "failed", 30, "A failed by the sweep")
        assert _job(server, a)["error"]["code"] == "JOB_CONTACT_LOST"
        assert not _still(alive, 0.5), "A stopped while the node was cut off"
        assert _job(server, b)["state"] == "queued"

        proxy.mend()
        wait_until(b_started.exists, 60, "job B to start on the node")
        wait_until(lambda: _still(alive), 10, "A to be gone")
        assert float(alive.read_text()) < float(b_started.read_text()), (
            "B started while A still ran on the node"
        )
        wait_until(lambda: _job(server, b)["state"] == "succeeded", 30, "B to end")
        held = [_job(server, job)["assigned_gpus"] for job in (a, b)]
        assert held[0] == held[1] and len(held[0]) == 1, held  # the same GPU, one at a time
