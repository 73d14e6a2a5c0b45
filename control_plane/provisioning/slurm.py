"""Talking to a Slurm login host through the system `ssh` client, and the job script a request
submits.

Every call is `ssh` with the provisioner's key, `BatchMode=yes` (never a password or passphrase
prompt), `StrictHostKeyChecking=yes` against the operator's known_hosts (an unknown or changed
host key is refused, never accepted), a connect timeout and an overall timeout. Nothing secret
is ever in an argument: the node's credential travels on `ssh`'s standard input into a file of
mode 0600 in the cluster user's home, which the job script moves into the agent's private state
directory before anything else runs — so it is in no process's argv on either side, in no
`squeue`/`scontrol show job` field (the script arrives on sbatch's standard input; its text
names only the file), and in no log.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import dataclass

from control_plane.provisioning.config import Profile, SlurmProvisioner

#: Where the credential file waits on the cluster, relative to the user's home (shared with the
#: compute nodes, as Slurm clusters' homes are).
SPOOL = ".modelforge/provision"
CONNECT_TIMEOUT_S = 10
CALL_TIMEOUT_S = 30
_TAIL = 2000


@dataclass(frozen=True)
class Outcome:
    """One SSH call: what ran (no secret in it), its exit code, and the tail of its stderr."""

    command: str
    exit_code: int
    stdout: str
    stderr_tail: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def event(self) -> dict[str, object]:
        return {"command": self.command, "exit_code": self.exit_code, "stderr": self.stderr_tail}


def ssh_argv(provisioner: SlurmProvisioner, remote: str) -> list[str]:
    return [
        "ssh",
        # No ssh_config and no global known_hosts: only the operator's key and host file count.
        "-F",
        "/dev/null",
        "-i",
        str(provisioner.ssh_key),
        "-p",
        str(provisioner.port),
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={provisioner.known_hosts}",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "PreferredAuthentications=publickey",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        f"ConnectTimeout={CONNECT_TIMEOUT_S}",
        "-o",
        "LogLevel=ERROR",
        f"{provisioner.user}@{provisioner.host}",
        remote,
    ]


def run(provisioner: SlurmProvisioner, remote: str, stdin: bytes = b"") -> Outcome:
    """Run `remote` on the login host; never raises for the call's own failure."""
    try:
        done = subprocess.run(  # noqa: S603 - a fixed argv, no shell on this side
            ssh_argv(provisioner, remote),
            input=stdin,
            capture_output=True,
            timeout=CALL_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"").decode(errors="replace")[-_TAIL:]
        return Outcome(remote, 124, "", f"timed out after {CALL_TIMEOUT_S} s. {tail}".strip())
    except OSError as exc:
        return Outcome(remote, 127, "", f"cannot run ssh: {exc.strerror}")
    return Outcome(
        remote,
        done.returncode,
        done.stdout.decode(errors="replace"),
        done.stderr.decode(errors="replace")[-_TAIL:],
    )


def credential_path(request_id: str) -> str:
    return f"{SPOOL}/{request_id}.json"


def log_path(request_id: str) -> str:
    """The Slurm job's output, relative to the user's home (sbatch's working directory)."""
    return f"{SPOOL}/{request_id}.log"


def put_credential(
    provisioner: SlurmProvisioner, request_id: str, identity: dict[str, str]
) -> Outcome:
    """Write the agent's identity (node id, control plane URL, credential) to a 0600 file."""
    remote = f"umask 077 && mkdir -p {SPOOL} && cat > {shlex.quote(credential_path(request_id))}"
    return run(provisioner, remote, json.dumps(identity).encode())


def remove_credential(provisioner: SlurmProvisioner, request_id: str) -> Outcome:
    return run(provisioner, f"rm -f {shlex.quote(credential_path(request_id))}")


def submit(provisioner: SlurmProvisioner, profile: Profile, request_id: str) -> Outcome:
    """`sbatch --parsable` with the job script on its standard input."""
    options = [
        f"--job-name=modelforge-{request_id}",
        f"--cpus-per-task={profile.cpus}",
        f"--mem={profile.ram_mb}M",
        # The agent's and the worker's output, for debugging a request that never attaches.
        f"--output={log_path(request_id)}",
        *([f"--gres=gpu:{profile.gpus}"] if profile.gpus else []),
        *profile.sbatch,
    ]
    remote = "sbatch --parsable " + " ".join(shlex.quote(option) for option in options)
    return run(provisioner, remote, job_script(provisioner, profile, request_id).encode())


def cancel(provisioner: SlurmProvisioner, slurm_job_id: str) -> Outcome:
    return run(provisioner, f"scancel {shlex.quote(slurm_job_id)}")


#: Slurm job states after which the job runs no more (squeue's `%T`, sacct's State). Any other
#: (PENDING, RUNNING, COMPLETING, SUSPENDED, REQUEUED, …, or one a later Slurm adds) is taken as
#: not ended: a request is never failed on a state not understood.
ENDED_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)
#: What squeue says when its one `-j` id is one slurmctld no longer holds.
_UNKNOWN_JOB = "Invalid job id specified"


@dataclass(frozen=True)
class JobState:
    """A Slurm job's state as squeue or sacct gave it: `state` (`%T`; sacct's first word) and
    `detail` (squeue's reason, or sacct's exit code)."""

    state: str
    detail: str

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES

    def describe(self) -> str:
        return f"{self.state} ({self.detail})" if self.detail else self.state


def job_states(
    provisioner: SlurmProvisioner, job_ids: list[str]
) -> tuple[dict[str, JobState], list[Outcome]]:
    """The state of each of `job_ids` Slurm can still tell: squeue for the jobs slurmctld holds
    (pending, running, and ended ones for its `MinJobAge`), then sacct for those squeue no longer
    lists. A job both leave out is `GONE` (ended, purged, and no accounting records it). A call
    that fails decides nothing: its jobs are left out, and its outcome is returned."""
    failed: list[Outcome] = []
    ids = ",".join(shlex.quote(job_id) for job_id in job_ids)
    queued = run(provisioner, f"squeue --noheader --states=all --format='%i|%T|%r' --jobs={ids}")
    unknown_one = len(job_ids) == 1 and _UNKNOWN_JOB in queued.stderr_tail
    if not queued.ok and not unknown_one:
        return {}, [queued]
    states: dict[str, JobState] = {}
    for line in queued.stdout.splitlines():
        job_id, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if job_id in job_ids and state:
            states[job_id] = JobState(state.strip(), "" if reason == "None" else reason.strip())
    missing = [job_id for job_id in job_ids if job_id not in states]
    if not missing:
        return states, failed
    accounted = run(
        provisioner,
        "sacct --noheader --parsable2 --allocations --format=JobID,State,ExitCode "
        f"--jobs={','.join(shlex.quote(job_id) for job_id in missing)}",
    )
    if accounted.ok:
        for line in accounted.stdout.splitlines():
            job_id, _, rest = line.strip().partition("|")
            state, _, exit_code = rest.partition("|")
            if job_id in missing and state:
                # sacct writes "CANCELLED by 1000": the state is the first word.
                states[job_id] = JobState(state.split()[0], f"exit code {exit_code.strip()}")
    elif "accounting storage is disabled" not in accounted.stderr_tail:
        failed.append(accounted)
        return states, failed
    for job_id in missing:
        states.setdefault(job_id, JobState("GONE", "no longer known to squeue or sacct"))
    return states, failed


def output_tail(provisioner: SlurmProvisioner, request_id: str) -> str:
    """The last `_TAIL` characters of the request's Slurm job output (its `--output` file), or
    why they could not be read."""
    read = run(provisioner, f"tail -c {_TAIL} {shlex.quote(log_path(request_id))}")
    if not read.ok:
        return f"(its output could not be read: exit {read.exit_code}: {read.stderr_tail})"
    return read.stdout


def parse_job_id(stdout: str) -> str | None:
    """`sbatch --parsable` prints `<id>` or `<id>;<cluster>`."""
    job_id = stdout.strip().split(";", 1)[0]
    return job_id if job_id.isdigit() else None


def job_script(provisioner: SlurmProvisioner, profile: Profile, request_id: str) -> str:
    """The batch script: installs nothing; moves the credential file into a private state
    directory, runs the profile's `prerun` lines, then the runtime worker and the node agent
    (which knows it runs under Slurm from SLURM_* and reports the allocation). When the agent
    ends — released (scancel), its credential revoked or expired — the worker stops and the
    state directory is removed."""
    mode = "nvidia" if profile.gpus else "cpu"
    credential = shlex.quote(credential_path(request_id))
    prerun = "\n".join(profile.prerun)
    # A trusted LAN's plain http:// (config.py checked the address is a private one).
    insecure = (
        "export MODELFORGE_AGENT_ALLOW_INSECURE_HTTP=true\n"
        if provisioner.allow_insecure_http
        else ""
    )
    return f"""#!/bin/bash
# ModelForge provision request {request_id} ({provisioner.name}/{profile.name})
set -uo pipefail
state=$(mktemp -d "${{TMPDIR:-/tmp}}/modelforge-{request_id}.XXXXXX")
chmod 700 "$state"
cleanup() {{ kill "${{worker:-}}" 2>/dev/null; wait 2>/dev/null; rm -rf "$state"; }}
trap cleanup EXIT
trap 'kill -TERM "${{agent:-}}" 2>/dev/null' TERM INT
if ! mv "$HOME"/{credential} "$state/identity.json"; then
  echo "modelforge: the credential file of request {request_id} is missing" >&2
  exit 1
fi
{prerun}
export MODELFORGE_AGENT_CONTROL_PLANE_URL={shlex.quote(provisioner.engine_url.rstrip("/"))}
{insecure}export MODELFORGE_AGENT_STATE_VOLUME="$state"
export MODELFORGE_AGENT_ACCELERATOR_MODE={mode}
export MODELFORGE_AGENT_WORKER_SOCKET="$state/worker.sock"
export MODELFORGE_WORKER_SOCKET="$state/worker.sock"
export MODELFORGE_AGENT_SOCKET="$state/agent.sock"
export MODELFORGE_ARTIFACT_CACHE="$state/cache"
python3 -m runtime_worker &
worker=$!
python3 -m node_agent &
agent=$!
wait "$agent"
wait "$agent" 2>/dev/null  # a trapped TERM ends the first wait early; let the agent finish
"""
