"""The provisioner's demand (PV-1): a node that just attached is not asked for twice. Its round
marks the request `attached` from the node's live heartbeat, while the waiting reasons come from
the scheduler's fleet view, up to a second old, where that node may still look offline
(`NODES_OFFLINE`, a reason a new node would answer). Driven on the control plane's clock
through `Provisioner.tick`; the login host is a closed loopback port, so a request the round
made would end `failed` at once (and still show as a second row)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from control_plane.models import ProvisionRequest
from tests.control_plane.test_jobs import _submit
from tests.control_plane.test_provisioner_limits import _provisioners
from tests.factories import control_plane


def test_a_request_just_attached_is_not_asked_for_again_from_a_stale_fleet_view(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(
        tmp_path / "cp", database_url, provisioners_file=_provisioners(tmp_path)
    ) as cp:
        # The node a request of profile `limited/p` made, its agent not started yet.
        mint = cp.mint(labels={"site": "limited"})
        enrolled = cp.enroll_raw(mint["token"]).json()
        now = cp.clock.now()
        with cp.ctx.session_factory.begin() as session:
            session.add(
                ProvisionRequest(
                    id="prq_first",
                    provisioner="limited",
                    profile="p",
                    state="pending",
                    node_id=enrolled["node_id"],
                    created_at=now,
                    updated_at=now,
                )
            )
        job = _submit(cp, labels={"site": "limited"}, resources={"cpus": 1})
        assert job["state"] == "queued"
        # The fleet view is read (a claim, a job's view): the node has never been heard from.
        before = cp.ctx.scheduler.fleet()
        assert before.by_id[enrolled["node_id"]].state == "offline"

        # Its agent starts: a heartbeat, held in the buffer, which liveness already reads.
        assert cp.heartbeat(enrolled["credential"]).status_code == 200
        cp.ctx.provisioner.tick()  # within the view's second: the view still says offline

        with cp.ctx.session_factory() as session:
            requests = {row.id: row.state for row in session.scalars(select(ProvisionRequest))}
        assert requests == {"prq_first": "attached"}, requests

        # Later rounds, the view fresh: the node is online and the job waits for its claim.
        cp.flush()
        cp.clock.advance(5)
        cp.ctx.provisioner.tick()
        cp.clock.advance(10)
        assert cp.heartbeat(enrolled["credential"]).status_code == 200
        cp.ctx.provisioner.tick()
        with cp.ctx.session_factory() as session:
            assert [row.id for row in session.scalars(select(ProvisionRequest))] == ["prq_first"]
