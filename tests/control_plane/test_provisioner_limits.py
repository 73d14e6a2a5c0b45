"""The provisioner's limits (PV-1): a request not attached within `provision_timeout_s` is
cancelled and an attached node idle for `max_idle_s` released, and `0` disables either. Driven
on the control plane's clock through `Provisioner.tick`; the login host is a closed loopback
port, so each SSH call the rounds make really runs `ssh` and fails at once (exit 255)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy import select

from control_plane.models import ProvisionEvent, ProvisionRequest
from control_plane.provisioning import slurm
from control_plane.provisioning.config import load_provisioners
from tests.e2e.server import free_port
from tests.e2e.slurm import SshLogin, slurm_provisioner
from tests.factories import control_plane, heartbeat_body


def _provisioners(tmp_path: Path) -> Path:
    key, known_hosts = tmp_path / "key", tmp_path / "known_hosts"
    key.write_text("never read: nothing listens on the port\n")
    known_hosts.write_text("[127.0.0.1]:2222 ssh-ed25519 AAAA\n")

    def one(name: str, limit: int) -> dict[str, Any]:
        return slurm_provisioner(
            SshLogin(f"mfslurm@127.0.0.1:{free_port()}", key, known_hosts),
            8000,
            name,
            max_idle_s=limit,
            provision_timeout_s=limit,
            profile={"name": "p", "cpus": 1, "ram_mb": 64, "labels": {"site": name}},
        )

    path = tmp_path / "provisioners.json"
    path.write_text(json.dumps([one("forever", 0), one("limited", 600)]))
    return path


def test_zero_disables_the_attach_timeout_and_the_idle_release(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(
        tmp_path / "cp", database_url, provisioners_file=_provisioners(tmp_path)
    ) as cp:
        nodes = {name: cp.ready_node() for name in ("forever", "limited")}
        now = cp.clock.now()
        with cp.ctx.session_factory.begin() as session:
            for name, node in nodes.items():
                for state, node_id in (("pending", None), ("attached", node.node_id)):
                    session.add(
                        ProvisionRequest(
                            id=f"prq_{name}_{state}",
                            provisioner=name,
                            profile="p",
                            state=state,
                            node_id=node_id,
                            created_at=now,
                            updated_at=now,
                            attached_at=now if node_id else None,
                        )
                    )

        cp.clock.advance(599)
        cp.ctx.provisioner.tick()
        cp.clock.advance(7 * 86400)  # a week later: the zero limits still never fire
        cp.ctx.provisioner.tick()

        with cp.ctx.session_factory() as session:
            states = {
                row.id: (row.state, row.reason) for row in session.scalars(select(ProvisionRequest))
            }
            events = list(session.scalars(select(ProvisionEvent).order_by(ProvisionEvent.id)))
        assert states == {
            "prq_forever_pending": ("pending", None),
            "prq_forever_attached": ("attached", None),
            "prq_limited_pending": ("cancelled", "did not attach within 600 s"),
            "prq_limited_attached": ("released", "idle for 600 s"),
        }
        # Ending a request revokes its credential: the released node is refused, the other not.
        for name, status in (("limited", 403), ("forever", 200)):
            response = cp.client.post(
                "/api/v1/agent/heartbeat", headers=nodes[name].headers, json=heartbeat_body()
            )
            assert response.status_code == status, response.text
        # The cancelled one's credential file was removed over SSH: tried, and the failure kept.
        (removal,) = [e.data for e in events if e.kind == "ssh"]
        assert removal["command"].startswith("rm -f ") and removal["exit_code"] == 255


def test_ssh_trusts_only_the_operators_key_and_known_hosts(tmp_path: Path) -> None:
    (provisioner,) = [p for p in load_provisioners(_provisioners(tmp_path)) if p.name == "limited"]
    argv = slurm.ssh_argv(provisioner, "squeue")
    options = {argv[i + 1] for i, arg in enumerate(argv) if arg == "-o"}
    assert argv[:3] == ["ssh", "-F", "/dev/null"]  # no ssh_config of the user or the system
    assert {
        "BatchMode=yes",
        "StrictHostKeyChecking=yes",
        f"UserKnownHostsFile={provisioner.known_hosts}",
        "GlobalKnownHostsFile=/dev/null",
        "IdentitiesOnly=yes",
        "PreferredAuthentications=publickey",
        f"ConnectTimeout={slurm.CONNECT_TIMEOUT_S}",
    } <= options
    assert argv[argv.index("-i") + 1] == str(provisioner.ssh_key)
    # A refused connection is an outcome with its exit code and stderr, not an exception.
    outcome = slurm.run(provisioner, "squeue")
    assert outcome.exit_code == 255 and outcome.stderr_tail
