"""`provisioners.json` (PV-1a) is validated at start: an invalid file stops the real
`modelforge-control-plane` before it serves anything, with a message naming the file, the JSON
path and the fix; a valid one is listed by `GET /api/v1/admin/provisioners`."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from control_plane.provisioning.config import load_provisioners
from control_plane.provisioning.slurm import job_script
from tests.e2e.server import control_plane_executable
from tests.factories import ADMIN_TOKEN, control_plane


def _valid(tmp_path: Path) -> list[dict[str, Any]]:
    key, known_hosts = tmp_path / "key", tmp_path / "known_hosts"
    key.write_text("not read at start\n")
    known_hosts.write_text("[127.0.0.1]:2222 ssh-ed25519 AAAA\n")
    return [
        {
            "type": "slurm",
            "name": "hpc",
            "login": "mfslurm@127.0.0.1:2222",
            "ssh_key": str(key),
            "known_hosts": str(known_hosts),
            "engine_url": "http://127.0.0.1:8000",
            "max_idle_s": 600,
            "provision_timeout_s": 600,
            "profiles": [
                {
                    "name": "cpu",
                    "cpus": 1,
                    "gpus": 0,
                    "ram_mb": 512,
                    "labels": {"site": "hpc"},
                    "sbatch": ["--partition=debug"],
                    "prerun": ["echo ready"],
                }
            ],
        }
    ]


def _start(tmp_path: Path, provisioners: Any) -> subprocess.CompletedProcess[str]:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "provisioners.json").write_text(
        provisioners if isinstance(provisioners, str) else json.dumps(provisioners)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env.update(
        MODELFORGE_DATA_DIR=str(data),
        MODELFORGE_ADMIN_TOKEN=ADMIN_TOKEN,
        MODELFORGE_PORT="1",  # never reached: the file is refused first
    )
    return subprocess.run(
        [control_plane_executable()], env=env, capture_output=True, text=True, timeout=60
    )


def _broken(tmp_path: Path, change: Any) -> list[dict[str, Any]]:
    provisioners = copy.deepcopy(_valid(tmp_path))
    change(provisioners)
    return provisioners


@pytest.mark.parametrize(
    ("change", "path", "fix"),
    [
        (lambda p: p[0]["profiles"][0].pop("cpus"), "$[0].profiles[0].cpus", "add it"),
        (lambda p: p[0].update(max_idle_s="ten"), "$[0].max_idle_s", "valid number"),
        (lambda p: p[0]["profiles"][0].update(gpu=1), "$[0].profiles[0].gpu", "not a known key"),
        (lambda p: p[0].update(login="no-user-here"), "$[0].login", "user@host"),
        (
            lambda p: p[0]["profiles"][0].update(sbatch=["--wrap=sleep 1"]),
            "$[0].profiles[0].sbatch",
            "set by ModelForge",
        ),
        (lambda p: p[0].update(ssh_key="/nonexistent/key"), "$[0].ssh_key", "does not exist"),
        # Plain http:// beyond this host: only on a trusted LAN, said so, at a private address.
        (lambda p: p[0].update(engine_url="http://10.1.2.3:8000"), "$[0]", "allow_insecure_http"),
        (
            lambda p: p[0].update(engine_url="http://cp.lan:8000", allow_insecure_http=True),
            "$[0]",
            "private IP address",
        ),
        (
            lambda p: p[0].update(engine_url="http://8.8.8.8:8000", allow_insecure_http=True),
            "$[0]",
            "private IP address",
        ),
        (
            lambda p: p[0].update(engine_url="https://10.1.2.3:8000", allow_insecure_http=True),
            "$[0]",
            "remove allow_insecure_http",
        ),
    ],
)
def test_an_invalid_file_refuses_the_start_naming_the_path(
    tmp_path: Path, change: Any, path: str, fix: str
) -> None:
    result = _start(tmp_path, _broken(tmp_path, change))
    assert result.returncode == 2, result.stderr
    assert "provisioners.json" in result.stderr and "not starting" in result.stderr
    assert path in result.stderr and fix in result.stderr, result.stderr
    assert "ModelForge control plane on" not in result.stderr


def test_not_json_and_not_a_list_are_refused(tmp_path: Path) -> None:
    for content, words in (("[{", "not valid JSON"), ('{"type": "slurm"}', "must be a list")):
        result = _start(tmp_path, content)
        assert result.returncode == 2 and words in result.stderr, result.stderr


def test_a_valid_file_is_listed(tmp_path: Path, database_url: str) -> None:
    path = tmp_path / "provisioners.json"
    path.write_text(json.dumps(_valid(tmp_path)))
    with control_plane(tmp_path / "cp", database_url, provisioners_file=path) as cp:
        listed = cp.client.get("/api/v1/admin/provisioners", headers=cp.admin).json()
        (hpc,) = listed
        assert hpc["name"] == "hpc" and hpc["login"] == "mfslurm@127.0.0.1:2222"
        assert hpc["profiles"][0]["name"] == "cpu" and hpc["profiles"][0]["outstanding"] == 0
        assert hpc["requests"] == []
        metrics = cp.client.get("/metrics", headers=cp.admin).text
        assert (
            'modelforge_provision_requests_outstanding{profile="cpu",provisioner="hpc"} 0.0'
            in metrics
        )


def test_a_trusted_lan_provisioner_starts_agents_that_accept_plain_http(tmp_path: Path) -> None:
    lan = _valid(tmp_path)
    lan[0].update(engine_url="http://192.168.20.5:8000", allow_insecure_http=True)
    path = tmp_path / "provisioners.json"
    path.write_text(json.dumps(lan + [_valid(tmp_path)[0] | {"name": "local"}]))
    trusted, local = load_provisioners(path)
    profile = trusted.profiles[0]
    script = job_script(trusted, profile, "prq_1")
    assert "export MODELFORGE_AGENT_CONTROL_PLANE_URL=http://192.168.20.5:8000\n" in script
    assert "export MODELFORGE_AGENT_ALLOW_INSECURE_HTTP=true\n" in script
    # Loopback (and https://) needs no opt-in, and gets none.
    assert "ALLOW_INSECURE_HTTP" not in job_script(local, local.profiles[0], "prq_2")
