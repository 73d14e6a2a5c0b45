"""Running one job: a process group of its own, a filtered environment,
its output and events collected, its timeout and silence timeout enforced. The group is killed
when the job ends, times out, falls silent, is abandoned by the agent, or the worker stops —
nothing a job started outlives it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Generator
from pathlib import Path
from typing import IO, Any

from modelforge_contracts import job_records as records

#: Variables that look like credentials never reach job code.
_CREDENTIAL_LIKE = re.compile(
    r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|ACCESS_?KEY|PRIVATE|AUTH|COOKIE|SESSION|CERT",
    re.IGNORECASE,
)
_KILL_GRACE = 0.5
#: The records job code may write to its events pipe.
_FROM_JOB = (records.EventRecord, records.OutputRecord, records.ResultRecord, records.ErrorRecord)

_running: dict[int, subprocess.Popen[bytes]] = {}
_running_lock = threading.Lock()


def job_environment(base: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    env = {
        name: value
        for name, value in base.items()
        if not _CREDENTIAL_LIKE.search(name) and not name.startswith("MODELFORGE_")
    }
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the whole group, SIGKILL what is left after a short grace."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + _KILL_GRACE
    while time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.02)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def kill_all() -> None:
    """The worker is stopping: no job survives it."""
    with _running_lock:
        processes = list(_running.values())
    for process in processes:
        kill_group(process)


def _pump(stream: IO[bytes], source: str, out: queue.Queue[records.Record]) -> None:
    """Read the job's output (`log`) or its events pipe (`events`) into `out` as records."""
    for raw in iter(stream.readline, b""):
        text = raw.decode(errors="replace").rstrip("\n")
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
        out.put(record)
    stream.close()


def run_job(
    spec: dict[str, Any], *, agent_socket: str, tick: float = 0.25
) -> Generator[records.Record, None, None]:
    """Start the job and yield its records; the last one is an `ExitRecord`.

    Records: `event`, `log`, `output` as they happen, `tick` at least every `tick` seconds (so
    the caller notices a vanished agent), then `exit` with the state. Closing the generator
    early (the agent went away or cancelled) kills the job's process group.
    """
    workdir = Path(tempfile.mkdtemp(prefix=f"modelforge-{spec['job_id']}-"))
    read_fd, write_fd = os.pipe()
    env = job_environment(
        dict(os.environ),
        {
            "MODELFORGE_JOB_ID": spec["job_id"],
            "MODELFORGE_JOB_EVENTS_FD": str(write_fd),
            "MODELFORGE_JOB_INPUTS": json.dumps(spec.get("inputs") or {}),
            "MODELFORGE_AGENT_SOCKET": agent_socket,
        },
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "runtime_worker.job_host"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=workdir,
        env=env,
        pass_fds=(write_fd,),
        start_new_session=True,
    )
    os.close(write_fd)
    with _running_lock:
        _running[process.pid] = process
    pipe: queue.Queue[records.Record] = queue.Queue()
    readers = [
        threading.Thread(target=_pump, args=(process.stdout, "log", pipe), daemon=True),
        threading.Thread(
            target=_pump, args=(os.fdopen(read_fd, "rb"), "events", pipe), daemon=True
        ),
    ]
    for reader in readers:
        reader.start()
    stdin = process.stdin
    if stdin is not None:
        stdin.write(json.dumps(spec).encode())
        stdin.close()

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
                # The job process ended: leftovers in its group go too, then drain.
                if _group_alive(process.pid):
                    kill_group(process)
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
                kill_group(process)
                yield records.failed("JOB_TIMEOUT", f"ran longer than its timeout of {timeout:g} s")
                return
            if now - last_output >= silence:
                kill_group(process)
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
        # Normal end, timeout, or the caller closed us (cancel, agent gone): the group goes.
        if process.poll() is None or _group_alive(process.pid):
            kill_group(process)
        with _running_lock:
            _running.pop(process.pid, None)
        shutil.rmtree(workdir, ignore_errors=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
