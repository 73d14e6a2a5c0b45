"""Provisioning on a real Slurm cluster over real SSH (PV-1, CR-3), with real processes: a
control plane on Granian whose provisioners.json names this host's single-node Slurm (munge,
slurmctld, slurmd) behind an sshd on 127.0.0.1:2222 (key only, user `mfslurm`; started by
scripts/ensure-slurm). The node agents are started by the generated batch scripts, from a virtual
environment of the agent's locked dependencies that `mfslurm` can read.

- A job whose labels only the Slurm profile carries makes the control plane submit `sbatch` over
  SSH; the agent attaches with a 24 h credential issued by the provisioner, runs the job, goes
  idle and is released after `max_idle_s`: its Slurm job is gone from `squeue`.
- A batch script that never attaches (prerun `sleep 3600`) is cancelled after
  `provision_timeout_s`, and a burst of 50 jobs for its profile never makes more than one
  outstanding request.
- A batch script whose `prerun` fails fails its request as soon as squeue shows its job
  ended, with the job's state and the tail of its output, though its provisioner never times
  out (`provision_timeout_s: 0`).
- The credential is in no process's arguments, no `squeue`/`scontrol show job` output, no log.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.node import wait_until
from tests.e2e.server import LiveServer, free_port
from tests.e2e.slurm import (
    SshLogin,
    agent_profile,
    make_login,
    scancel_all,
    slurm_provisioner,
    squeue_jobs,
)

pytestmark = pytest.mark.e2e

MAX_IDLE_S = 6
TIMEOUT_S = 15
FAST = {
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_TELEMETRY_INTERVAL_SECONDS": "2",
    "MODELFORGE_JOB_PROGRESS_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
}


#: A profile whose job script never starts an agent.
NEVER = {
    "name": "never",
    "cpus": 1,
    "ram_mb": 64,
    "labels": {"site": "stuck"},
    "prerun": ["sleep 3600"],
}

#: A profile whose job script fails before it starts an agent, as a missing module would.
BROKEN = {
    "name": "broken",
    "cpus": 1,
    "ram_mb": 64,
    "labels": {"site": "broken"},
    "prerun": ["echo 'prerun: the module cuda/12.4 is not installed' >&2", "exit 3"],
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, SshLogin]]:
    cpu = agent_profile("cpu", {"site": "slurm"})
    root = tmp_path_factory.mktemp("provisioning")
    login = make_login(root / "ssh")
    port = free_port()
    provisioners = [
        slurm_provisioner(
            login, port, "local", max_idle_s=MAX_IDLE_S, provision_timeout_s=120, profile=cpu
        ),
        slurm_provisioner(
            login, port, "stuck", max_idle_s=0, provision_timeout_s=TIMEOUT_S, profile=NEVER
        ),
        slurm_provisioner(
            login, port, "broken", max_idle_s=0, provision_timeout_s=0, profile=BROKEN
        ),
    ]
    path = root / "provisioners.json"
    path.write_text(json.dumps(provisioners))
    env = {**FAST, "MODELFORGE_PROVISIONERS_FILE": str(path)}
    try:
        with LiveServer(
            root / "cp", f"sqlite:///{root / 'cp.db'}", env_overrides=env, port=port
        ) as server:
            yield server, login
    finally:
        # A clean shutdown cancels every outstanding request (scancel); after a failed test or
        # a server that had to be killed, whatever is left would hold a core of the one-node
        # cluster for the next run: cancel it here, and say so.
        leftovers = [job for job in squeue_jobs() if job["name"].startswith("modelforge-prq_")]
        if leftovers:
            print(f"cancelling Slurm jobs left behind: {leftovers}")
            scancel_all()


def _submit(server: LiveServer, labels: dict[str, str]) -> str:
    body = {
        "entrypoint": {
            "kind": "python",
            "module": "where",
            "function": "where",
            "source": {
                "where.py": "import os\ndef where():\n    return os.environ.get('SLURM_JOB_ID')\n"
            },
        },
        "labels": labels,
        "resources": {"cpus": 1},
    }
    with server.client() as client:
        response = client.post("/api/v1/jobs", headers=server.admin, json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["job_id"])


def _requests(server: LiveServer, name: str) -> list[dict[str, Any]]:
    (provisioner,) = [p for p in server.get("/api/v1/admin/provisioners") if p["name"] == name]
    return list(provisioner["requests"])


def _ours(name_part: str) -> list[dict[str, Any]]:
    return [job for job in squeue_jobs() if name_part in job["name"]]


def _identity_credential(request_id: str) -> str | None:
    # The batch script's state directory: mktemp in the job's TMPDIR (/tmp on this host).
    for path in Path(tempfile.gettempdir()).glob(f"modelforge-{request_id}.*/identity.json"):
        try:
            return str(json.loads(path.read_text())["credential"])
        except (OSError, ValueError, KeyError):
            return None
    return None


def test_a_slurm_node_is_provisioned_runs_the_job_and_is_released_when_idle(
    cluster: tuple[LiveServer, SshLogin],
) -> None:
    server, login = cluster
    job_id = _submit(server, {"site": "slurm"})
    wait_until(lambda: _requests(server, "local"), 30, "a provision request")
    (request,) = _requests(server, "local")
    wait_until(
        lambda: _requests(server, "local")[0]["state"] in ("attached", "failed", "cancelled"),
        120,
        "the agent to attach",
    )
    request = _requests(server, "local")[0]
    assert request["state"] == "attached", request
    assert request["slurm_job_id"] and _ours(request["request_id"])
    ssh_events = [e for e in request["events"] if e["kind"] == "ssh"]
    assert [e["data"]["exit_code"] for e in ssh_events] == [0, 0]

    # The agent holds a 24 h credential the provisioner issued, with the profile's labels.
    (credential,) = server.get(f"/api/v1/admin/credentials?node_id={request['node_id']}")
    assert credential["issuer"] == "provisioner" and credential["labels"] == {"site": "slurm"}
    lifetime = datetime.fromisoformat(credential["expires_at"]) - datetime.fromisoformat(
        credential["issued_at"]
    )
    assert lifetime.total_seconds() == pytest.approx(86400, abs=2)
    node = server.get(f"/api/v1/admin/nodes/{request['node_id']}")
    assert node["inventory"]["slurm"]["job_id"] == request["slurm_job_id"]

    # Nothing shows the credential: not ps, not squeue or scontrol, not the logs.
    secret = _identity_credential(request["request_id"])
    assert secret, "the agent's identity file was not found"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    shown = subprocess.run(
        ["scontrol", "show", "job", request["slurm_job_id"]], capture_output=True, text=True
    ).stdout
    squeue = subprocess.run(["squeue", "-o", "%all"], capture_output=True, text=True).stdout
    for text in (ps, shown, squeue, server.log()):
        assert secret not in text
        assert server.admin["X-ModelForge-Admin-Token"] not in text

    # It runs the job, then goes idle and is released: its Slurm job ends.
    wait_until(lambda: server.get(f"/api/v1/jobs/{job_id}")["state"] == "succeeded", 60, "the job")
    done = server.get(f"/api/v1/jobs/{job_id}")
    assert done["node_id"] == request["node_id"] and done["result"] == request["slurm_job_id"]
    wait_until(
        lambda: _requests(server, "local")[0]["state"] == "released",
        MAX_IDLE_S + 30,
        "the idle node's release",
    )
    wait_until(lambda: not _ours(request["request_id"]), 30, "the Slurm job to end")
    log = Path(f"~{login.login.split('@')[0]}").expanduser() / ".modelforge" / "provision"
    for path in log.glob(f"{request['request_id']}.*"):
        assert secret not in path.read_text(errors="replace")


def test_a_request_that_never_attaches_is_cancelled_and_a_burst_asks_once(
    cluster: tuple[LiveServer, SshLogin],
) -> None:
    server, _ = cluster
    for _ in range(50):
        _submit(server, {"site": "stuck"})
    wait_until(lambda: _requests(server, "stuck"), 30, "a provision request")
    first = _requests(server, "stuck")[0]
    most_outstanding = 0
    deadline = time.monotonic() + TIMEOUT_S + 20
    while time.monotonic() < deadline:
        requests = _requests(server, "stuck")
        outstanding = [r for r in requests if r["state"] in ("submitting", "pending")]
        most_outstanding = max(most_outstanding, len(outstanding))
        slurm_jobs = [job for job in squeue_jobs() if "modelforge-prq_" in job["name"]]
        stuck_jobs = [j for j in slurm_jobs if any(r["request_id"] in j["name"] for r in requests)]
        assert len(stuck_jobs) <= 1, stuck_jobs
        if (
            next(r for r in requests if r["request_id"] == first["request_id"])["state"]
            == "cancelled"
        ):
            break
        time.sleep(0.5)
    assert most_outstanding == 1
    ended = next(r for r in _requests(server, "stuck") if r["request_id"] == first["request_id"])
    assert ended["state"] == "cancelled" and f"{TIMEOUT_S}" in ended["reason"]
    wait_until(lambda: not _ours(first["request_id"]), 30, "scancel to end the Slurm job")

    # The request ends first (one transaction), then scancel runs over SSH and is recorded.
    def scancel_events() -> list[dict[str, Any]]:
        request = next(
            r for r in _requests(server, "stuck") if r["request_id"] == first["request_id"]
        )
        return [
            e for e in request["events"] if e["kind"] == "ssh" and "scancel" in e["data"]["command"]
        ]

    wait_until(scancel_events, 30, "the scancel call's event")
    assert scancel_events()[0]["data"]["exit_code"] == 0


def test_a_job_that_ends_before_its_agent_attaches_fails_its_request_at_once(
    cluster: tuple[LiveServer, SshLogin],
) -> None:
    server, login = cluster
    job_id = _submit(server, {"site": "broken"})
    try:
        wait_until(lambda: _requests(server, "broken"), 30, "a provision request")
        # provision_timeout_s is 0 (never): only the check of its Slurm job can end it.
        wait_until(
            lambda: _requests(server, "broken")[0]["state"] not in ("submitting", "pending"),
            60,
            "the request to end",
        )
    finally:
        with server.client() as client:  # no second request for it 60 s from now
            client.post(f"/api/v1/jobs/{job_id}/cancel", headers=server.admin)
    (request,) = _requests(server, "broken")
    slurm_job = request["slurm_job_id"]
    assert request["state"] == "failed", request
    assert f"Slurm job {slurm_job} ended FAILED (NonZeroExitCode)" in request["reason"], request
    (ended,) = [e["data"] for e in request["events"] if e["kind"] == "slurm"]
    assert ended["job"] == slurm_job and ended["state"] == "FAILED"
    assert "prerun: the module cuda/12.4 is not installed" in ended["output"]
    # Its job ended by itself: nothing to scancel. The credential file went with the script.
    commands = [e["data"]["command"] for e in request["events"] if e["kind"] == "ssh"]
    assert not [c for c in commands if c.startswith("scancel")], commands
    home = Path(f"~{login.login.split('@')[0]}").expanduser()
    assert not (home / ".modelforge" / "provision" / f"{request['request_id']}.json").exists()
    (provisioner,) = [p for p in server.get("/api/v1/admin/provisioners") if p["name"] == "broken"]
    assert not [r for r in provisioner["requests"] if r["state"] in ("submitting", "pending")]


def test_a_clean_shutdown_cancels_the_requests_not_attached_yet(
    cluster: tuple[LiveServer, SshLogin], tmp_path: Path
) -> None:
    _, login = cluster
    port = free_port()
    path = tmp_path / "provisioners.json"
    path.write_text(
        json.dumps(
            [
                slurm_provisioner(
                    login, port, "parting", max_idle_s=0, provision_timeout_s=0, profile=NEVER
                )
            ]
        )
    )
    database = tmp_path / "cp.db"
    with LiveServer(
        tmp_path / "cp",
        f"sqlite:///{database}",
        env_overrides={**FAST, "MODELFORGE_PROVISIONERS_FILE": str(path)},
        port=port,
    ) as server:
        _submit(server, {"site": "stuck"})
        wait_until(
            lambda: [r for r in _requests(server, "parting") if r["state"] == "pending"],
            60,
            "a pending request",
        )
        (request,) = _requests(server, "parting")
        assert _ours(request["request_id"]), "its Slurm job is not queued"
        # provision_timeout_s 0: it would wait for ever; a few rounds later it still does.
        time.sleep(6)
        assert _requests(server, "parting")[0]["state"] == "pending"
        assert server.stop() == 0
    # Nothing of it outlives the control plane: the Slurm job, the credential, the request.
    wait_until(lambda: not _ours(request["request_id"]), 30, "scancel at shutdown")
    with sqlite3.connect(database) as db:
        state, reason = db.execute(
            "SELECT state, reason FROM provision_requests WHERE id = ?", (request["request_id"],)
        ).fetchone()
        (revoked,) = db.execute(
            "SELECT count(*) FROM node_credentials WHERE node_id = ? AND revoked_at IS NOT NULL",
            (request["node_id"],),
        ).fetchone()
    assert state == "cancelled" and "shutting down" in reason, (state, reason)
    assert revoked == 1
    home = Path(f"~{login.login.split('@')[0]}").expanduser()
    assert not (home / ".modelforge" / "provision" / f"{request['request_id']}.json").exists()
