"""The console in real headless Chromium.

The browser tests themselves are JavaScript (`control_plane/console/tests/*.test.mjs`, Playwright
through playwright-core driving Debian's /usr/bin/chromium). This module gives them what they
drive: the real control plane on Granian with a verified-release manifest configured, the
substitute NVML library for the GPU nodes (the GPU health test injects faults through its control
file), a work directory for the node processes, and Slurm
provisioners: the real single-node cluster (its agent attaches) and one that cannot be reached. Set
MODELFORGE_CONSOLE_SCREENSHOTS=docs/img/console to refresh the screenshots in docs/console.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server import FAST, LiveServer, free_port
from tests.e2e.slurm import (
    SshLogin,
    agent_profile,
    make_login,
    scancel_all,
    slurm_provisioner,
)
from tests.factories import ADMIN_TOKEN, write_release_manifest
from tests.nvml_substitute import build_fake_nvml

pytestmark = pytest.mark.e2e

CONSOLE = Path(__file__).resolve().parents[2] / "control_plane" / "console"
CHROMIUM = Path("/usr/bin/chromium")
#: Nothing listens on port 1 of the loopback address (it would need root, and nothing here uses it).
CLOSED_PORT = 1


def _provisioners(root: Path, port: int) -> Path:
    """Two provisioners for a control plane on `port`: `hpc`, the real single-node Slurm
    cluster over SSH (tests/e2e/slurm.py), whose agent attaches, so the provisioning screen
    shows the node a request brought and its credential's expiry; and `down`, whose login host
    refuses connections (a closed loopback port), so it shows a request that failed with ssh's
    exit code and stderr."""
    profile = agent_profile("hpc-cpu", {"site": "hpc"})
    root.mkdir()
    hpc = slurm_provisioner(
        make_login(root / "ssh"),
        port,
        "hpc",
        max_idle_s=900,  # attached for the rest of the run; cancelled after it
        provision_timeout_s=240,
        profile=profile,
    )
    key, known_hosts = root / "id_ed25519", root / "known_hosts"
    key.write_text("a key the login host never gets to see\n")
    key.chmod(0o600)
    known_hosts.write_text(f"[127.0.0.1]:{CLOSED_PORT} ssh-ed25519 AAAA\n")
    down = slurm_provisioner(
        SshLogin(f"mfslurm@127.0.0.1:{CLOSED_PORT}", key, known_hosts),
        port,
        "down",
        max_idle_s=300,
        provision_timeout_s=600,
        profile={
            "name": "down-cpu",
            "cpus": 1,
            "gpus": 0,
            "ram_mb": 512,
            "labels": {"site": "down"},
        },
    )
    path = root / "provisioners.json"
    path.write_text(json.dumps([hpc, down]))
    return path


def test_console_in_headless_chromium(tmp_path: Path) -> None:
    assert (CONSOLE / "dist" / "index.html").is_file(), "the console is not built: run make console"
    assert (CONSOLE / "node_modules" / "playwright-core").is_dir(), "run make console (npm ci)"
    assert CHROMIUM.exists(), "Debian's chromium is missing: run scripts/ensure-chromium"
    node = shutil.which("node")
    assert node, "Node.js is missing: run scripts/ensure-node"
    major = subprocess.run([node, "-p", "process.versions.node"], capture_output=True, text=True)
    assert int(major.stdout.split(".")[0]) >= 20, f"playwright-core needs Node.js 20+: {major}"
    manifest = write_release_manifest(tmp_path / "release-manifest.json")
    port = free_port()
    overrides = {
        **FAST,
        "MODELFORGE_RELEASE_MANIFEST": str(manifest),
        "MODELFORGE_PROVISIONERS_FILE": str(_provisioners(tmp_path / "slurm", port)),
        # A sweep dry run then has something it would delete: an unreferenced artifact.
        # (and only the console's own dry run and sweep look: the periodic sweep is off).
        "MODELFORGE_ARTIFACT_GRACE_SECONDS": "1",
        "MODELFORGE_ARTIFACT_SWEEP_INTERVAL_SECONDS": "0",
        # The GPU node's GPUs are the substitute NVML's: the active check that re-admits one
        # (tests/gpuhealth.test.mjs) runs its model on onnxruntime's CPU provider.
        "MODELFORGE_GPU_CHECK_PROVIDER": "CPUExecutionProvider",
    }
    workdir = tmp_path / "nodes"
    workdir.mkdir()
    # MODELFORGE_CONSOLE_TESTS=tests/flags.test.mjs runs a subset while working on the console.
    selected = os.environ.get("MODELFORGE_CONSOLE_TESTS", "tests/").split()
    screenshots = os.environ.get("MODELFORGE_CONSOLE_SCREENSHOTS", str(tmp_path / "screenshots"))

    database = f"sqlite:///{tmp_path / 'cp.db'}"
    try:
        with LiveServer(tmp_path / "cp", database, overrides, port=port) as server:
            env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
            env.update(
                MODELFORGE_CONSOLE_URL=server.url,
                MODELFORGE_TEST_ADMIN_TOKEN=ADMIN_TOKEN,
                MODELFORGE_TEST_PYTHON=sys.executable,
                MODELFORGE_TEST_WORKDIR=str(workdir),
                MODELFORGE_TEST_MANIFEST=str(manifest),
                MODELFORGE_TEST_NVML_DIR=str(build_fake_nvml(tmp_path / "nvml")),
                MODELFORGE_CONSOLE_SCREENSHOTS=str(Path(screenshots).resolve()),
                PYTHONPATH=str(CONSOLE.parents[1]),
            )
            result = subprocess.run(
                [node, "--test", "--test-concurrency=1", "--test-reporter=spec", *selected],
                cwd=CONSOLE,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
            log = server.log()
    finally:
        # An attached node outlives the control plane (only requests not attached yet are
        # cancelled at shutdown): end the provisioned agent's Slurm job, so that it holds no
        # core of the one-node cluster after this test.
        scancel_all()

    report = result.stdout + result.stderr
    print(report)
    assert result.returncode == 0, report
    assert "# fail 0" in report or "ℹ fail 0" in report, report
    # The control plane never logged the admin token or a revealed enrollment token.
    assert ADMIN_TOKEN not in log
    assert "mfe_" not in log
