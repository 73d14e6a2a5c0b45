"""One job's stream from the runtime worker breaking (issue 24): the job fails
`JOB_WORKER_LOST`, but the worker is called lost only when it does not answer a probe either, so
one broken stream does not degrade the node's health and pause its claims. The agent's own
`WorkRunner` and client against a real HTTP server standing in for the control plane, and a
stand-in runtime worker on a real unix socket."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelforge_contracts.ipc import JsonHandler, UnixHTTPServer, serve_unix
from node_agent.work import WorkRunner
from node_agent.worker_link import WorkerWatch
from tests.e2e.node import wait_until
from tests.node_agent.conftest import (
    CLAIM,
    Answer,
    Recorded,
    RecordingServer,
    control_plane_client,
    no_work,
)

JOB = "job_1"
COMPLETE = f"/api/v1/agent/jobs/{JOB}/complete"
EVENT_LINE = json.dumps({"kind": "event", "data": {"step": 1}}).encode() + b"\n"


class BreakingWorker(JsonHandler):
    """Answers its health; a job's stream sends one event, then breaks: the worker closes the
    connection without reading the job's spec, which the agent reads as a reset connection."""

    def handle(self) -> None:
        first = self.connection.recv(5, socket.MSG_PEEK)
        if first.startswith(b"GET"):
            super().handle()
            return
        self.connection.recv(4)  # "POST": the rest of the request stays unread
        if getattr(self.server, "dies", False):  # the worker goes away with the stream
            Path(self.server.server_address).unlink()  # type: ignore[arg-type]
        self.connection.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n\r\n" + EVENT_LINE
        )
        # Closed here, not shut down for writing first (socketserver would): the agent would
        # read an end of stream, not the reset.
        self.connection.close()

    def do_GET(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's name
        self.send_json(200, {"version": "9.9.9", "protocol_version": 1, "healthy": True})


class OneJobControlPlane:
    """Hands out one job, then none; takes its reports and its outcome."""

    def __init__(self) -> None:
        self.handed = False
        self.outcome: dict[str, Any] | None = None

    def respond(self, request: Recorded) -> Answer:
        if request.path == CLAIM:
            if self.handed:
                return no_work(request)
            self.handed = True
            return 200, {"job_id": JOB, "entrypoint": {}, "progress_interval_seconds": 60}
        if request.path == COMPLETE:
            self.outcome = json.loads(request.body)
            return 200, {"cancel": False}
        return 200, {"cancel": False}


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[Path, UnixHTTPServer]]:
    path = tmp_path / "worker.sock"
    server = serve_unix(path, BreakingWorker, UnixHTTPServer)
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
    ).start()
    try:
        yield path, server
    finally:
        server.shutdown()
        server.server_close()


def _run_one_job(worker_socket: Path, agent_socket: Path) -> tuple[dict[str, Any], WorkerWatch]:
    control_plane = OneJobControlPlane()
    server = RecordingServer(respond=control_plane.respond).start()
    stop = threading.Event()
    watch = WorkerWatch(worker_socket)
    runner = WorkRunner(
        control_plane=control_plane_client(server.url, stop),
        worker_socket=worker_socket,
        agent_socket=agent_socket,
        parallel=1,
        stop=stop,
        worker=watch,
    )
    try:
        runner.start()
        wait_until(lambda: control_plane.outcome is not None, 30, "the job's outcome")
    finally:
        stop.set()
        server.stop()
    assert control_plane.outcome is not None
    assert control_plane.outcome["state"] == "failed"
    assert control_plane.outcome["error"]["code"] == "JOB_WORKER_LOST"
    return control_plane.outcome, watch


def test_one_broken_stream_fails_its_job_but_a_worker_that_answers_is_not_lost(
    worker: tuple[Path, UnixHTTPServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, any error on one job's stream marked the worker lost at once: health degraded,
    claims paused, its services reported down."""
    _, watch = _run_one_job(worker[0], tmp_path / "agent.sock")
    # The worker answered the probe: not lost, nothing logged as a loss.
    assert not watch.lost
    assert watch.report is not None and watch.report["version"] == "9.9.9"
    assert "does not answer" not in caplog.text


def test_a_stream_broken_by_a_worker_that_went_away_reports_it_lost_at_once(
    worker: tuple[Path, UnixHTTPServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker[1].dies = True  # type: ignore[attr-defined]
    _, watch = _run_one_job(worker[0], tmp_path / "agent.sock")
    assert watch.lost  # at once: no periodic watch runs in this test
    lost = [r for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(lost) == 1 and "socket does not exist" in lost[0].getMessage()
