"""A real single-node Slurm cluster and its SSH login host, for end-to-end tests.

`scripts/ensure-slurm` starts both (Slurm on this host, an sshd on 127.0.0.1:2222 that lets in
the unprivileged user `mfslurm` by public key only). Each test brings its own client key with
`make_login`; nothing here holds a key. Every wait is bounded. Adding a key to `mfslurm` needs
root, as the tests run on CI.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.node import wait_until

REPO = Path(__file__).resolve().parents[2]
ENSURE_SLURM = REPO / "scripts" / "ensure-slurm"
SSH_USER = "mfslurm"
SSH_HOST = "127.0.0.1"
SSH_PORT = 2222
#: The login host's own host key, written by scripts/ensure-slurm.
SSHD_HOST_KEY = Path("/etc/ssh/modelforge/ssh_host_ed25519_key.pub")
#: A virtual environment `mfslurm` can run: Debian's python3 and the node agent's locked
#: dependencies; the checkout itself comes in through PYTHONPATH.
VENV_ROOT = Path("/opt/modelforge-slurm")


def ensure_cluster(timeout: float = 240) -> None:
    """Start (or confirm) the cluster and the login host; fail the test with the script's
    output if it cannot. The time allows for installing the packages on a fresh machine."""
    try:
        result = subprocess.run(
            [str(ENSURE_SLURM)], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"{ENSURE_SLURM} ran past {timeout} s:\n{stderr}")
    if result.returncode != 0:
        pytest.fail(
            f"{ENSURE_SLURM} failed (exit {result.returncode}):\n{result.stdout}{result.stderr}"
        )


@dataclass(frozen=True)
class SshLogin:
    """How a client reaches the login host: `user@host:port`, its private key and a
    known_hosts file that pins the host's key (for StrictHostKeyChecking=yes)."""

    login: str
    key_path: Path
    known_hosts_path: Path

    @property
    def user(self) -> str:
        return self.login.split("@", 1)[0]

    @property
    def host(self) -> str:
        return self.login.split("@", 1)[1].rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.login.rsplit(":", 1)[1])


def known_hosts_line(public_key: str, host: str = SSH_HOST, port: int = SSH_PORT) -> str:
    """A known_hosts entry for a non-standard port (`[host]:port keytype base64`)."""
    key_type, key_data = public_key.split()[:2]
    return f"[{host}]:{port} {key_type} {key_data}\n"


def make_login(tmp_dir: Path) -> SshLogin:
    """A fresh ed25519 client key in `tmp_dir`, authorized for `mfslurm`, and a known_hosts
    file for the login host read from its host key file."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    key_path = tmp_dir / "id_ed25519"
    generate_key(key_path, comment="modelforge-test")
    _authorize(key_path.with_suffix(".pub").read_text())

    known_hosts_path = tmp_dir / "known_hosts"
    known_hosts_path.write_text(known_hosts_line(SSHD_HOST_KEY.read_text()))
    return SshLogin(
        login=f"{SSH_USER}@{SSH_HOST}:{SSH_PORT}",
        key_path=key_path,
        known_hosts_path=known_hosts_path,
    )


def generate_key(path: Path, comment: str) -> None:
    """An ed25519 key pair without a passphrase: `path` (mode 0600) and `path.pub`."""
    args = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)]
    subprocess.run(args, check=True, capture_output=True, timeout=20)
    path.chmod(0o600)


def _authorize(public_key: str) -> None:
    account = pwd.getpwnam(SSH_USER)
    ssh_dir = Path(account.pw_dir) / ".ssh"
    authorized = ssh_dir / "authorized_keys"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    with authorized.open("a") as handle:
        handle.write(public_key.strip() + "\n")
    # sshd's StrictModes refuses keys in a directory or file others could write.
    for path, mode in ((ssh_dir, 0o700), (authorized, 0o600)):
        os.chown(path, account.pw_uid, account.pw_gid)
        path.chmod(mode)


def ssh_command(login: SshLogin, *options: str) -> list[str]:
    """The `ssh` argument list up to (not including) the remote command: batch mode, the
    login's key only, the host key checked against the login's known_hosts file."""
    return [
        "ssh",
        "-i", str(login.key_path),
        "-o", "BatchMode=yes",
        "-o", "IdentitiesOnly=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={login.known_hosts_path}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "ConnectTimeout=10",
        "-F", "/dev/null",
        "-p", str(login.port),
        *options,
        f"{login.user}@{login.host}",
    ]  # fmt: skip


def run_ssh(
    login: SshLogin, command: str, timeout: float = 20, options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Run `command` on the login host as the login's user; never prompts (BatchMode)."""
    return subprocess.run(
        [*ssh_command(login, *options), command],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def squeue_jobs() -> list[dict[str, str]]:
    """The jobs Slurm holds in its queue, read on this host: job id, name, state, user."""
    result = subprocess.run(
        ["squeue", "--noheader", "--format=%i|%j|%T|%u"],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    jobs = []
    for line in result.stdout.splitlines():
        if not line.strip():
            continue
        # Only the name could hold a "|": the id is first, state and user last.
        job_id, rest = line.split("|", 1)
        name, state, user = rest.rsplit("|", 2)
        jobs.append({"job_id": job_id.strip(), "name": name, "state": state, "user": user})
    return jobs


def scancel_all(user: str = SSH_USER) -> None:
    """Cancel every job of `user` (a test's leftovers), without waiting for them to end."""
    subprocess.run(["scancel", f"--user={user}"], capture_output=True, timeout=20, check=True)


def wait_job_gone(job_id: str, timeout: float) -> float:
    """Wait until `job_id` has left the queue (finished, failed or cancelled); the seconds it
    took."""
    return wait_until(
        lambda: all(job["job_id"] != job_id for job in squeue_jobs()),
        timeout,
        f"Slurm job {job_id} to leave the queue",
        interval=0.25,
    )


def job_state(job_id: str) -> str:
    """The job's state as slurmctld reports it (finished jobs stay known for MinJobAge,
    300 s in scripts/ensure-slurm), e.g. COMPLETED."""
    result = subprocess.run(
        ["scontrol", "--oneliner", "show", "job", job_id],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    for field in result.stdout.split():
        if field.startswith("JobState="):
            return field.removeprefix("JobState=")
    raise AssertionError(f"no JobState in scontrol's answer for job {job_id}: {result.stdout}")


def wait_until_state(job_id: str, states: set[str], timeout: float) -> str:
    """Wait until the job is in one of `states`; the state it reached."""
    seen: list[str] = []

    def reached() -> bool:
        seen.append(job_state(job_id))
        return seen[-1] in states

    try:
        wait_until(reached, timeout, f"Slurm job {job_id} to reach {sorted(states)}", 0.25)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (last state {seen[-1] if seen else 'unknown'})") from None
    return seen[-1]


def agent_venv() -> Path:
    """A virtual environment of the node agent's locked dependencies that `mfslurm` can run
    (Debian's python3), made once per lock; the checkout itself comes in through PYTHONPATH."""
    lock = REPO / "locks" / "node-agent.lock"
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()[:16]
    venv = VENV_ROOT / f"venv-{digest}"
    python = venv / "bin" / "python3"
    if not (venv / ".complete").exists():
        VENV_ROOT.mkdir(parents=True, exist_ok=True)
        VENV_ROOT.chmod(0o755)
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--require-hashes", "-r", str(lock)],
            check=True,
            timeout=600,
        )
        (venv / ".complete").touch()
    return venv


def readable_by_everyone(path: Path) -> None:
    """`mfslurm` imports the checkout: every directory above it must let it through."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        assert mode & 0o005 == 0o005, f"{parent} is not readable by other users"


def slurm_provisioner(
    login: SshLogin, port: int, name: str, *, profile: dict[str, Any], **limits: int
) -> dict[str, Any]:
    """A provisioner reached through `login` (the local cluster's, or one that refuses) for a
    control plane on `port`."""
    return {
        "type": "slurm",
        "name": name,
        "login": login.login,
        "ssh_key": str(login.key_path),
        "known_hosts": str(login.known_hosts_path),
        "engine_url": f"http://127.0.0.1:{port}",
        **limits,
        "profiles": [profile],
    }


def agent_profile(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """A profile (1 CPU, 256 MB) whose job runs this checkout's node agent on the cluster, once
    the cluster, the agent's environment and the checkout's permissions are ready."""
    ensure_cluster()
    readable_by_everyone(REPO)
    venv = agent_venv()
    prerun = [f"export PATH={venv}/bin:$PATH", f"export PYTHONPATH={REPO}"]
    return {"name": name, "cpus": 1, "ram_mb": 256, "labels": labels, "prerun": prerun}
