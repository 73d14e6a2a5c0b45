"""The agent resends its inventory, unchanged, at the interval the control plane gives, so that
readiness can judge the inventory's age: a real agent process against a real HTTP server."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.node import wait_until
from tests.node_agent.conftest import (
    CLAIM,
    ENROLL,
    ENROLLED,
    INVENTORY,
    Answer,
    Recorded,
    agent_against,
    no_work,
)


def test_an_unchanged_inventory_is_sent_again_at_the_given_interval(tmp_path: Path) -> None:
    def respond(request: Recorded) -> Answer:
        if request.path == ENROLL:
            return 200, dict(ENROLLED, inventory_interval_seconds=0.6)
        if request.path == CLAIM:
            return no_work(request)
        return 200, {"received_at": "2026-01-01T00:00:00Z"}

    with agent_against(respond, tmp_path) as (server, agent):
        wait_until(
            lambda: server.paths().count(INVENTORY) >= 3, 30, "the inventory sent three times"
        )
        assert agent.process.poll() is None, agent.log.read_text()
    assert agent.exit_code == 0, agent.log.read_text()
    sent = [r for r in server.requests if r.path == INVENTORY]
    bodies = {json.dumps(json.loads(r.body), sort_keys=True) for r in sent}
    assert len(bodies) == 1  # the same inventory each time: resent, not changed
    gaps = [later.at - earlier.at for earlier, later in zip(sent, sent[1:], strict=False)]
    assert min(gaps) >= 0.5  # at the interval, not at every check (every 0.2 s)
    assert agent.log.read_text().count("inventory sent (") == 1  # logged once, when it changed
