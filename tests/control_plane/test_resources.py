"""`GET /api/v1/admin/resources` (issue 29): every node's total, held and free capacity, who holds
which GPU, its running jobs and the queued work it could take, the fleet's sums and the
provisioners' outstanding requests, matching what is placed. SQLite and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy import update

from control_plane.background.service_placement import place_services
from control_plane.models import Node, ProvisionRequest
from control_plane.scheduling.placement import free_capacity
from tests.control_plane.test_gpu_assignment import _complete
from tests.control_plane.test_jobs import _claim, _node, _submit
from tests.e2e.server import free_port
from tests.e2e.slurm import SshLogin, slurm_provisioner
from tests.factories import ADMIN_TOKEN, ControlPlane, control_plane, heartbeat_body

RESOURCES = "/api/v1/admin/resources"
GPU_POOL = {"pool": "gpu"}


def _resources(cp: ControlPlane, **params: Any) -> dict[str, Any]:
    response = cp.client.get(RESOURCES, headers=cp.admin, params=params)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _by_name(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {node["name"]: node for node in view["nodes"]}


def _deploy(cp: ControlPlane, **body: Any) -> dict[str, Any]:
    payload = {"name": "web", "command": ["python3", "-m", "http.server", "{port}"], **body}
    response = cp.client.post("/api/v1/services", headers=cp.admin, json=payload)
    assert response.status_code == 201, response.text
    return dict(response.json())


def _named(cp: ControlPlane, node: dict[str, str], name: str) -> None:
    """`_node` names every node gpu-1: rename through the display name the view shows."""
    with cp.ctx.session_factory.begin() as session:
        session.execute(update(Node).where(Node.id == node["node_id"]).values(display_name=name))


def test_the_view_matches_what_is_placed(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        big = _node(cp, labels=GPU_POOL, cpus=16, gpus=2)
        small = _node(cp, labels=GPU_POOL, cpus=2, gpus=0)
        _named(cp, big, "big")
        _named(cp, small, "small")
        gpu0, gpu1 = (f"GPU-{big['node_id']}-{i}" for i in range(2))

        # A 1-GPU job on the 2-GPU node, and a 1-GPU service beside it.
        held_job = _submit(cp, labels=GPU_POOL, resources={"cpus": 2, "gpus": 1, "memory_mb": 1000})
        claimed = _claim(cp, big)
        assert claimed is not None and claimed["job_id"] == held_job["job_id"]
        assert [gpu["uuid"] for gpu in claimed["assigned_gpus"]] == [gpu0]
        service = _deploy(cp, labels=GPU_POOL, resources={"cpus": 1, "gpus": 1, "memory_mb": 2000})
        assert place_services(cp.ctx) == 1
        # Queued: a 1-GPU job (the big node could run it once a GPU is free; the small one never
        # can), a CPU job either may take, and one no node carries the labels of.
        gpu_job = _submit(cp, labels=GPU_POOL, resources={"cpus": 1, "gpus": 1})
        cpu_job = _submit(cp, labels=GPU_POOL, resources={"cpus": 1})
        _submit(cp, labels={"pool": "elsewhere"}, resources={"cpus": 1})

        view = _resources(cp)
        nodes = _by_name(view)
        assert list(nodes) == ["big", "small"]
        got = nodes["big"]
        assert got["node_id"] == big["node_id"] and got["state"] == "online"
        assert got["labels"] == GPU_POOL and got["schedulable"] is True
        assert got["needs_upgrade"] is False
        assert got["capacity"] == {
            "total": {"cpus": 16, "memory_mb": 64000, "gpus": 2},
            "held": {"cpus": 3, "memory_mb": 3000, "gpus": 2},
            "free": {"cpus": 13, "memory_mb": 61000, "gpus": 0},
        }
        job_ref = {"kind": "job", "id": held_job["job_id"], "name": held_job["job_id"]}
        service_ref = {"kind": "service", "id": service["service_id"], "name": "web"}
        assert got["gpus"] == [
            {"index": 0, "uuid": gpu0, "model": "G", "health": "healthy", "held_by": job_ref},
            {"index": 1, "uuid": gpu1, "model": "G", "health": "healthy", "held_by": service_ref},
        ]
        assert sorted(got["holders"], key=lambda holder: holder["kind"]) == [
            {**job_ref, "cpus": 2, "memory_mb": 1000, "gpus": [0]},
            {**service_ref, "cpus": 1, "memory_mb": 2000, "gpus": [1]},
        ]
        # A service takes no work slot; the agent's number of slots is not known here.
        assert got["slots"] == {"in_use": 1, "total": None}
        assert got["could_take"] == {
            "jobs": 2,
            "job_ids": [gpu_job["job_id"], cpu_job["job_id"]],
            "services": 0,
            "service_ids": [],
        }
        other = nodes["small"]
        assert other["capacity"]["held"] == {"cpus": 0, "memory_mb": 0, "gpus": 0}
        assert other["capacity"]["free"] == {"cpus": 2, "memory_mb": 64000, "gpus": 0}
        assert other["gpus"] == [] and other["holders"] == []
        assert other["slots"] == {"in_use": 0, "total": None}
        assert other["could_take"]["job_ids"] == [cpu_job["job_id"]]  # not the 1-GPU job

        # The free counts are the scheduler's own.
        with cp.ctx.session_factory() as session:
            inventories = {
                node["node_id"]: cp.node(node["node_id"])["inventory"] for node in (big, small)
            }
            free = free_capacity(session, inventories)
        assert got["capacity"]["free"]["cpus"] == free[big["node_id"]].cpus
        assert [gpu["uuid"] for gpu in got["gpus"] if gpu["held_by"] is None] == [
            gpu["uuid"] for gpu in free[big["node_id"]].gpus
        ]

        fleet = view["fleet"]
        assert fleet["nodes"] == 2
        assert fleet["nodes_by_state"] == {"online": 2, "stale": 0, "offline": 0}
        assert fleet["needs_upgrade"] == 0
        assert fleet["capacity"] == {
            "total": {"cpus": 18, "memory_mb": 128000, "gpus": 2},
            "held": {"cpus": 3, "memory_mb": 3000, "gpus": 2},
            "free": {"cpus": 15, "memory_mb": 125000, "gpus": 0},
        }
        assert fleet["schedulable"] == fleet["capacity"]
        assert fleet["slots_in_use"] == 1
        assert fleet["queued_jobs"] == 3 and fleet["pending_services"] == 0
        assert view["provisioning"] == []

        # The job ends: its GPU is free again, and the queued 1-GPU job is what fits there.
        _complete(cp, big, held_job["job_id"])
        after = _by_name(_resources(cp, queued_ids=1))["big"]
        assert after["gpus"][0]["held_by"] is None and after["gpus"][1]["held_by"] == service_ref
        assert after["capacity"]["free"] == {"cpus": 15, "memory_mb": 62000, "gpus": 1}
        assert after["slots"]["in_use"] == 0
        assert after["could_take"] == {
            "jobs": 2,
            "job_ids": [gpu_job["job_id"]],
            "services": 0,
            "service_ids": [],
        }


def test_an_offline_node_counts_in_the_fleet_but_not_as_schedulable(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        kept = _node(cp, cpus=8, gpus=1)
        _node(cp, cpus=4)
        cp.clock.advance(cp.ctx.settings.node_offline_after_seconds + 1)
        beat = cp.client.post(
            "/api/v1/agent/heartbeat", headers=_agent(kept), json=heartbeat_body()
        )
        assert beat.is_success, beat.text

        fleet = _resources(cp)["fleet"]
        assert fleet["nodes_by_state"] == {"online": 1, "stale": 0, "offline": 1}
        assert fleet["capacity"]["total"] == {"cpus": 12, "memory_mb": 128000, "gpus": 1}
        assert fleet["schedulable"]["free"] == {"cpus": 8, "memory_mb": 64000, "gpus": 1}


def _agent(node: dict[str, str]) -> dict[str, str]:
    return {"Authorization": node["Authorization"]}


def test_pending_services_and_the_provisioners_outstanding_requests(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(
        tmp_path / "cp", database_url, provisioners_file=_provisioners(tmp_path)
    ) as cp:
        node = _node(cp, labels=GPU_POOL, cpus=4)
        # A service waiting for a GPU the node does not have: pending, and not for this node.
        _deploy(cp, labels=GPU_POOL, resources={"cpus": 1, "gpus": 1})
        cpu_service = _deploy(cp, name="cpu-web", labels=GPU_POOL, resources={"cpus": 1})
        now = cp.clock.now()
        with cp.ctx.session_factory.begin() as session:
            for request_id, state, node_id in (
                ("prq_pending", "pending", None),
                ("prq_attached", "attached", node["node_id"]),
                ("prq_failed", "failed", None),
            ):
                session.add(
                    ProvisionRequest(
                        id=request_id,
                        provisioner="hpc",
                        profile="p",
                        state=state,
                        node_id=node_id,
                        created_at=now,
                        updated_at=now,
                    )
                )
        cp.clock.advance(30)

        view = _resources(cp)
        (got,) = view["nodes"]
        assert got["could_take"] == {
            "jobs": 0,
            "job_ids": [],
            "services": 1,
            "service_ids": [cpu_service["service_id"]],
        }
        assert view["fleet"]["pending_services"] == 2
        hpc, idle = view["provisioning"]
        assert hpc["name"] == "hpc" and hpc["type"] == "slurm"
        assert hpc["outstanding"] == 1 and hpc["attached"] == 1
        (request,) = hpc["requests"]
        assert request["request_id"] == "prq_pending" and request["state"] == "pending"
        assert request["profile"] == "p" and request["age_seconds"] == 30
        assert idle == {
            "name": "idle",
            "type": "slurm",
            "outstanding": 0,
            "attached": 0,
            "requests": [],
        }


def _provisioners(tmp_path: Path) -> Path:
    key, known_hosts = tmp_path / "key", tmp_path / "known_hosts"
    key.write_text("never read: nothing listens on the port\n")
    known_hosts.write_text("[127.0.0.1]:2222 ssh-ed25519 AAAA\n")
    path = tmp_path / "provisioners.json"
    path.write_text(
        json.dumps(
            [
                slurm_provisioner(
                    SshLogin(f"mfslurm@127.0.0.1:{free_port()}", key, known_hosts),
                    8000,
                    name,
                    max_idle_s=0,
                    provision_timeout_s=0,
                    profile={"name": "p", "cpus": 1, "ram_mb": 64, "labels": {"site": name}},
                )
                for name in ("hpc", "idle")
            ]
        )
    )
    return path


def test_refused_without_the_admin_token_and_read_with_a_console_session(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        missing = cp.client.get(RESOURCES)
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "ADMIN_TOKEN_MISSING"
        assert set(missing.json()["error"]) == {"code", "message", "next_step"}
        wrong = cp.client.get(RESOURCES, headers={"X-ModelForge-Admin-Token": "mfa_wrong_x" * 3})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "ADMIN_TOKEN_INVALID"

        signed_in = cp.client.post("/api/v1/console/session", json={"admin_token": ADMIN_TOKEN})
        assert signed_in.status_code == 201, signed_in.text
        read = cp.client.get(RESOURCES)
        assert read.status_code == 200, read.text
        assert read.json()["nodes"] == [] and read.json()["fleet"]["nodes"] == 0


def test_a_bad_queued_ids_is_refused_with_its_code(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        for bad in ("-1", "51", "many"):
            response = cp.client.get(RESOURCES, headers=cp.admin, params={"queued_ids": bad})
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert error["code"] == "INVALID_REQUEST" and "queued_ids" in error["message"]
