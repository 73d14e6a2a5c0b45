"""The Slurm cluster and SSH login host that scripts/ensure-slurm starts, proven as a client
will use them: `sbatch` over the system `ssh` client, in batch mode, with the host key pinned.
A job submitted that way runs on the real cluster and writes its output; a client that does
not know the host's key is refused without a prompt; the login host offers no password."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.e2e.slurm import (
    SshLogin,
    ensure_cluster,
    generate_key,
    known_hosts_line,
    make_login,
    run_ssh,
    squeue_jobs,
    wait_job_gone,
    wait_until_state,
)

pytestmark = pytest.mark.e2e

FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    ensure_cluster()


@pytest.fixture
def login(tmp_path: Path) -> SshLogin:
    return make_login(tmp_path / "client")


@pytest.fixture
def submitted() -> Iterator[list[str]]:
    """Job ids a test submitted; whatever is still queued at the end is cancelled."""
    job_ids: list[str] = []
    yield job_ids
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=20, check=False)


def test_sbatch_over_ssh_runs_a_job(login: SshLogin, submitted: list[str]) -> None:
    result = run_ssh(login, "sbatch --parsable --wrap 'sleep 1; echo ok'")
    assert result.returncode == 0, result.stderr
    # --parsable prints `id` or `id;cluster`.
    job_id = result.stdout.strip().split(";")[0]
    assert job_id.isdigit(), result.stdout
    submitted.append(job_id)

    queued = [job for job in squeue_jobs() if job["job_id"] == job_id]
    assert queued, f"job {job_id} is not in squeue right after sbatch returned"
    assert queued[0]["user"] == "mfslurm"
    assert queued[0]["name"] == "wrap"
    assert queued[0]["state"] in {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING"}

    wait_job_gone(job_id, timeout=60)
    assert wait_until_state(job_id, FINISHED, timeout=10) == "COMPLETED"
    # sbatch ran in mfslurm's home directory, where the job's output lands by default.
    output = run_ssh(login, f"cat slurm-{job_id}.out && rm slurm-{job_id}.out")
    assert output.returncode == 0, output.stderr
    assert output.stdout == "ok\n"


def test_a_login_that_does_not_know_the_host_key_is_refused(
    login: SshLogin, tmp_path: Path
) -> None:
    other_key = tmp_path / "other_host_key"
    generate_key(other_key, comment="not-the-login-host")
    wrong_known_hosts = tmp_path / "wrong_known_hosts"
    wrong_known_hosts.write_text(known_hosts_line(other_key.with_suffix(".pub").read_text()))
    # The same (authorized) client key: only the host key check can refuse it.
    assert run_ssh(login, "true").returncode == 0

    result = run_ssh(replace(login, known_hosts_path=wrong_known_hosts), "echo logged-in")

    assert result.returncode == 255
    assert "Host key verification failed" in result.stderr
    assert "logged-in" not in result.stdout


def test_the_login_host_offers_no_password_authentication(login: SshLogin) -> None:
    result = run_ssh(
        login,
        "echo logged-in",
        options=("-o", "PreferredAuthentications=password,keyboard-interactive",
                 "-o", "PubkeyAuthentication=no"),
    )  # fmt: skip

    assert result.returncode == 255
    # The server lists the methods it would take: public keys and nothing else.
    assert "Permission denied (publickey)" in result.stderr
    assert "logged-in" not in result.stdout
