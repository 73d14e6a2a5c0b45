"""A running job's reports while the control plane is away (issue 24): the reader of the job's
stream is never held by it, every event is kept and sent in order once it is back, and the
spool is bounded (a full one holds the reader instead of dropping). The agent's own client
against a real HTTP server standing in for the control plane, which refuses reports with 503
while it is "away"."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from modelforge_contracts.errors import error_body
from node_agent._report_spool import BATCH, ReportSpool
from node_agent.retry import AgentStopped
from tests.e2e.node import wait_until
from tests.node_agent.conftest import Answer, Recorded, RecordingServer, control_plane_client

EVENTS = "/api/v1/agent/jobs/job_1/events"


class AwayControlPlane:
    """Refuses every report (503) while `away` is set; records the batches it accepted."""

    def __init__(self) -> None:
        self.away = threading.Event()
        self.away.set()
        self.refused = 0
        self.accepted: list[list[dict[str, Any]]] = []

    def respond(self, request: Recorded) -> Answer:
        if request.path != EVENTS:
            return 404, error_body("NOT_FOUND", request.path)
        if self.away.is_set():
            self.refused += 1
            return 503, error_body("DATABASE_UNAVAILABLE", "the database is away")
        self.accepted.append(json.loads(request.body)["events"])
        return 200, {"cancel": False}

    def steps(self) -> list[int]:
        return [event["data"]["step"] for batch in self.accepted for event in batch]


@pytest.fixture
def away() -> Iterator[tuple[AwayControlPlane, RecordingServer]]:
    control_plane = AwayControlPlane()
    server = RecordingServer(respond=control_plane.respond).start()
    try:
        yield control_plane, server
    finally:
        control_plane.away.clear()
        server.stop()


def _event(step: int) -> dict[str, Any]:
    return {"kind": "event", "data": {"step": step}}


def test_events_are_kept_while_the_control_plane_is_away_and_sent_in_order(
    away: tuple[AwayControlPlane, RecordingServer],
) -> None:
    control_plane, server = away
    cancelled = threading.Event()
    spool = ReportSpool(
        control_plane=control_plane_client(server.url),
        job_id="job_1",
        progress_every=60,
        on_cancel=cancelled.set,
    ).start()
    steps = 2 * BATCH + 50
    for step in range(steps):
        spool.add(_event(step), 40)  # never held: the spool has room while reports are refused
    wait_until(lambda: control_plane.refused >= 2, 20, "reports refused while away")
    assert control_plane.accepted == []
    control_plane.away.clear()
    spool.close()  # returns once every event is reported
    assert control_plane.steps() == list(range(steps))
    assert all(len(batch) <= BATCH for batch in control_plane.accepted)
    assert not cancelled.is_set()


def test_a_full_spool_holds_the_reader_and_drops_nothing(
    away: tuple[AwayControlPlane, RecordingServer],
) -> None:
    control_plane, server = away
    spool = ReportSpool(
        control_plane=control_plane_client(server.url),
        job_id="job_1",
        progress_every=60,
        on_cancel=lambda: None,
        max_events=10,
    ).start()
    added = 0

    def reader() -> None:
        nonlocal added
        for step in range(25):
            spool.add(_event(step), 40)
            added += 1

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    # The first ten went out in one report (refused, retried); ten more wait; the reader waits.
    wait_until(lambda: control_plane.refused >= 3, 30, "reports refused while away")
    assert added == 20 and thread.is_alive()
    control_plane.away.clear()
    thread.join(timeout=30)
    assert not thread.is_alive()
    spool.close()
    assert control_plane.steps() == list(range(25))


def test_a_spool_whose_sending_ends_stops_the_job_and_the_reader() -> None:
    """The credential revoked (or the agent stopping) ends the sending: before, `add` went on
    accepting events silently, so the reader read the job's stream until the job ended on its
    own. Now the spool stops the job at once and `add` raises what ended the sending."""
    revoked = RecordingServer(
        respond=lambda _request: (401, error_body("CREDENTIAL_REVOKED", "revoked"))
    ).start()
    try:
        stopped = threading.Event()
        spool = ReportSpool(
            control_plane=control_plane_client(revoked.url),
            job_id="job_1",
            progress_every=60,
            on_cancel=stopped.set,
        ).start()
        spool.add(_event(0), 40)
        # The job stops although its stream brings no further record to the reader.
        assert stopped.wait(30), "the job was not stopped"
        with pytest.raises(AgentStopped):
            spool.add(_event(1), 40)
        with pytest.raises(AgentStopped):
            spool.close()
    finally:
        revoked.stop()
