"""Running one job: a supervisor process of its own (runtime_worker.supervisor) that runs it in a
process group of its own, a filtered environment, a fresh work directory, its output and events
collected, its timeout and silence timeout enforced.

A job's secrets (`"secrets": {"NAME": "value"}` in the assignment) reach its process as
environment variables, added after the credential-like filter (runtime_worker.environment_filter),
and nowhere else: they are taken out of the spec before it travels to the supervisor, and any of
their values in what the job writes (its output, events, error messages) is replaced by
`[secret]` before it leaves the worker.

The job ends — everything it started, daemons included — when it finishes, times out, falls
silent, is abandoned by the agent, or the worker stops: the worker asks the supervisor (SIGTERM).
When the worker dies without asking (SIGKILL, a crash), the kernel tells the supervisor, which
ends the job and removes its work directory all the same. A worker starting finds the work
directories of the one before it in its jobs directory and removes what is left.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Generator, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from modelforge_contracts import job_records as records
from runtime_worker.environment_filter import is_removed
from runtime_worker.job_python import (
    PYTHON_UNAVAILABLE,
    helpers_path,
    interpreter_for,
    unavailable,
)
from runtime_worker.supervisor import remove_tree

log = logging.getLogger("modelforge.runtime_worker")
#: How long a supervisor asked to stop may take (its job gets half a second's grace) before it
#: is killed with its process group.
_STOP_TIMEOUT = 10.0
#: The records job code may write to its events pipe.
_FROM_JOB = (records.EventRecord, records.OutputRecord, records.ResultRecord, records.ErrorRecord)

#: What an environment variable delivered to a job or service may be named.
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
REDACTED = "[secret]"

_running: dict[int, subprocess.Popen[bytes]] = {}
_running_lock = threading.Lock()


def check_variables(value: Any, field: str) -> dict[str, str]:
    """`value` as environment variables (name -> text) for a job or service; `TypeError` naming
    `field` and the offending name — never a value, which may be a secret."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{field} must be an object of names to strings")
    variables: dict[str, str] = {}
    for name, text in value.items():
        if not isinstance(name, str) or not _VARIABLE_NAME.fullmatch(name):
            raise TypeError(
                f"{field}: {str(name)[:40]!r} is not a variable name (letters, digits, _)"
            )
        if name.startswith("MODELFORGE_"):
            raise TypeError(f"{field}.{name}: names starting MODELFORGE_ are the node's own")
        if not isinstance(text, str) or "\0" in text:
            raise TypeError(f"{field}.{name} must be a string without NUL characters")
        variables[name] = text
    return variables


class Redactor:
    """Replaces each secret value in text (and in the strings of a JSON value) with `[secret]`,
    longest first; holds the values but never shows them."""

    def __init__(self, secrets: Mapping[str, str] | None = None) -> None:
        values = {value for value in (secrets or {}).values() if value}
        self._values = sorted(values, key=len, reverse=True)

    def __repr__(self) -> str:
        return f"<Redactor of {len(self._values)} secret values>"

    def __call__(self, text: str) -> str:
        for value in self._values:
            text = text.replace(value, REDACTED)
        return text

    def tree(self, value: Any) -> Any:
        """`value` (parsed JSON) with every string redacted."""
        if not self._values:
            return value
        if isinstance(value, str):
            return self(value)
        if isinstance(value, list):
            return [self.tree(item) for item in value]
        if isinstance(value, dict):
            return {self(str(key)): self.tree(item) for key, item in value.items()}
        return value


def job_environment(base: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """`base` (the worker's environment) less what `environment_filter` removes, then `extra`."""
    env = {name: value for name, value in base.items() if not is_removed(name)}
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def gpu_environment(spec: dict[str, Any]) -> dict[str, str]:
    """`CUDA_VISIBLE_DEVICES` and `NVIDIA_VISIBLE_DEVICES` naming exactly the GPUs the job was
    assigned, by UUID (an index means another GPU inside a container that sees a subset); both
    empty for a job with none, so a CPU job sees no GPU. An assignment from a control plane
    that sends none leaves the node's own values, unless the job asked for no GPU."""
    assigned = spec.get("assigned_gpus")
    if assigned is None:
        resources = spec.get("resources") or {}
        if int(resources.get("gpus", 0) or 0) > 0:
            return {}
        assigned = []
    if not isinstance(assigned, list) or not all(
        isinstance(gpu, dict) and isinstance(gpu.get("uuid"), str) for gpu in assigned
    ):
        raise TypeError("assigned_gpus must be a list of GPUs with a uuid")
    devices = ",".join(str(gpu["uuid"]) for gpu in assigned)
    return {"CUDA_VISIBLE_DEVICES": devices, "NVIDIA_VISIBLE_DEVICES": devices}


def jobs_directory(socket_path: Path) -> Path:
    """Where this worker's jobs get their work directories: one per worker socket, so that a
    worker starting again on the same socket finds what the one before it left."""
    key = hashlib.sha256(str(socket_path.absolute()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"modelforge-jobs-{key}"


class JobsDirectoryError(Exception):
    """The jobs directory is not this worker's own; the message names it and the cause."""


def prepare_jobs_directory(path: Path) -> int:
    """Create `path` (0700, ours) or empty it of work directories a previous worker left;
    returns how many it removed."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        raise JobsDirectoryError(f"cannot create {path} ({exc.strerror})") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise JobsDirectoryError(
            f"{path} is not a directory owned by this user; remove it, or point TMPDIR elsewhere"
        )
    path.chmod(0o700)
    removed = 0
    for entry in path.iterdir():
        remove_tree(entry)
        removed += 1
    return removed


def start_supervisor(
    *, workdir: Path, env: dict[str, str], inherited_fd: int
) -> subprocess.Popen[bytes]:
    """Start a supervisor (runtime_worker.supervisor) for one job or one service start: in
    `workdir`, with `env`, in a session of its own, its output on one pipe, and `inherited_fd`
    (the write end of a pipe the worker reads) passed on under the same number. Its orders
    follow with `hand_over`. This process's copy of `inherited_fd` is closed here, whether the
    supervisor started or not."""
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "runtime_worker.supervisor"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=env,
            pass_fds=(inherited_fd,),
            start_new_session=True,
        )
    finally:
        os.close(inherited_fd)


def hand_over(process: subprocess.Popen[bytes], envelope: dict[str, Any]) -> None:
    """Give a supervisor its orders: `envelope` as one JSON document on its stdin, then EOF."""
    stdin = process.stdin
    if stdin is None:
        return
    try:
        stdin.write(json.dumps(envelope).encode())
        stdin.close()
    except BrokenPipeError:
        pass  # the supervisor is gone already: its exit status, or missing report, says so


def stop_job(process: subprocess.Popen[bytes]) -> None:
    """Ask the job's supervisor to end it (SIGTERM) and wait; one that does not answer in time
    is killed with its process group."""
    _ask_to_stop(process)
    _await_stop(process)


def stop_all() -> None:
    """The worker is stopping: no job survives it. All are asked at once, then awaited."""
    with _running_lock:
        processes = list(_running.values())
    for process in processes:
        if process.poll() is None:
            _ask_to_stop(process)
    for process in processes:
        _await_stop(process)


def _ask_to_stop(process: subprocess.Popen[bytes]) -> None:
    try:
        process.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass


def _await_stop(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(timeout=_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        log.error("the supervisor of a job did not stop in %.0f s; killing it", _STOP_TIMEOUT)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def readable(path: str) -> bool:
    """Whether this worker's user — and so a job — can read what is at `path`."""
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return False
    return os.access(path, os.X_OK if is_dir else os.R_OK)


def _pump(
    stream: IO[bytes], source: str, out: queue.Queue[records.Record], redact: Redactor
) -> None:
    """Read the job's output (`log`) or its events pipe (`events`) into `out` as records, the
    job's secrets redacted."""
    for raw in iter(stream.readline, b""):
        text = redact(raw.decode(errors="replace").rstrip("\n"))
        if source == "log":
            out.put(records.LogRecord(text))
            continue
        try:
            record = records.decode(raw)
        except records.RecordNotJson as exc:
            message = f"the job wrote a record that is not strict JSON: {exc}"
            out.put(records.job_error(records.RESULT_NOT_JSON, message))
            continue
        except records.RecordError:
            record = records.LogRecord(text)
        if not isinstance(record, _FROM_JOB):
            record = records.LogRecord(text)  # ticks and exits are the worker's to send
        elif isinstance(record, records.EventRecord):
            record = records.EventRecord(redact.tree(record.data))
        elif isinstance(record, records.ResultRecord):
            record = records.ResultRecord(redact.tree(record.value))
        elif isinstance(record, records.ErrorRecord):
            error = record.error
            record = records.job_error(redact(error.code), redact(error.message))
        out.put(record)
    stream.close()


def run_job(
    spec: dict[str, Any],
    *,
    agent_socket: str,
    jobs_dir: Path,
    private_paths: Iterable[str] = (),
    secrets: Mapping[str, str] | None = None,
    python: str | None = None,
    tick: float = 0.25,
) -> Generator[records.Record, None, None]:
    """Start the job and yield its records; the last one is an `ExitRecord`.

    Records: `event`, `log`, `output` as they happen, `tick` at least every `tick` seconds (so
    the caller notices a vanished agent), then `exit` with the state. Closing the generator
    early (the agent went away or cancelled) ends the job and everything it started.
    `private_paths` (the agent's) are hidden from the job when this worker can read them.
    `secrets` (checked with `check_variables`, not part of `spec`) become variables of the job's
    environment only. `python` is the node's Python (runtime_worker.job_python decides whether
    the job runs under it).
    """
    interpreter = interpreter_for(spec, python)
    why = None if interpreter is None else unavailable(interpreter)
    if why is not None:
        yield records.failed(PYTHON_UNAVAILABLE, why)
        return
    jobs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # a tmp cleaner may have pruned it
    workdir = Path(tempfile.mkdtemp(prefix=f"{spec['job_id']}-", dir=jobs_dir))
    hide = [path for path in private_paths if readable(path)]
    redact = Redactor(secrets)
    read_fd, write_fd = os.pipe()
    env = job_environment(
        dict(os.environ),
        {
            **(secrets or {}),
            "MODELFORGE_JOB_ID": spec["job_id"],
            "MODELFORGE_JOB_EVENTS_FD": str(write_fd),
            "MODELFORGE_JOB_INPUTS": json.dumps(spec.get("inputs") or {}),
            "MODELFORGE_AGENT_SOCKET": agent_socket,
            **gpu_environment(spec),
        },
    )
    if interpreter is not None:
        env["PYTHONPATH"] = helpers_path(workdir, env.get("PYTHONPATH"))
    process = start_supervisor(workdir=workdir, env=env, inherited_fd=write_fd)
    with _running_lock:
        _running[process.pid] = process
    pipe: queue.Queue[records.Record] = queue.Queue()
    readers = [
        threading.Thread(target=_pump, args=(process.stdout, "log", pipe, redact), daemon=True),
        threading.Thread(
            target=_pump, args=(os.fdopen(read_fd, "rb"), "events", pipe, redact), daemon=True
        ),
    ]
    for reader in readers:
        reader.start()
    envelope = {"worker_pid": os.getpid(), "hide": hide, "spec": spec, "python": interpreter}
    hand_over(process, envelope)

    started = last_output = time.monotonic()
    timeout = float(spec.get("timeout_seconds") or 3600)
    silence = float(spec.get("silence_timeout_seconds") or 600)
    outcome: records.ResultRecord | records.ErrorRecord | None = None
    outputs: dict[str, str] = {}

    def passed_on(record: records.Record) -> bool:
        """Note an outcome or an output; True when the record goes on to the agent."""
        nonlocal outcome
        if isinstance(record, records.ResultRecord | records.ErrorRecord):
            if not isinstance(outcome, records.ErrorRecord):  # the first failure stands
                outcome = record
            return False
        if isinstance(record, records.OutputRecord):
            outputs[record.name] = record.digest
        return True

    try:
        while True:
            try:
                record: records.Record | None = pipe.get(timeout=tick)
            except queue.Empty:
                record = None
            now = time.monotonic()
            if record is None and process.poll() is not None:
                # The supervisor ended its job's leftovers before exiting: drain.
                for reader in readers:
                    reader.join(timeout=1.0)
                while not pipe.empty():
                    late = pipe.get_nowait()
                    if passed_on(late):
                        yield late
                break
            if record is None:
                yield records.TickRecord()
            else:
                last_output = now
                if passed_on(record):
                    yield record
            if now - started >= timeout:
                stop_job(process)
                yield records.failed("JOB_TIMEOUT", f"ran longer than its timeout of {timeout:g} s")
                return
            if now - last_output >= silence:
                stop_job(process)
                yield records.failed("JOB_SILENT", f"no output or event for {silence:g} s")
                return
        code = process.wait()
        if isinstance(outcome, records.ResultRecord) and code == 0:
            yield records.succeeded(outcome.value, outputs)
        elif isinstance(outcome, records.ErrorRecord):
            yield records.failed(outcome.error.code, outcome.error.message)
        else:
            yield records.failed("JOB_EXITED", f"the job process ended with exit code {code}")
    finally:
        # Normal end, timeout, or the caller closed us (cancel, agent gone): the job goes.
        if process.poll() is None:
            stop_job(process)
        with _running_lock:
            _running.pop(process.pid, None)
        remove_tree(workdir)  # the supervisor's job; this is a backstop
