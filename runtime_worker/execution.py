"""Running one job (WL-3, WL-4, WL-6): a process group of its own, a filtered environment,
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

#: WL-6: variables that look like credentials never reach job code.
_CREDENTIAL_LIKE = re.compile(
    r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|ACCESS_?KEY|PRIVATE|AUTH|COOKIE|SESSION|CERT",
    re.IGNORECASE,
)
_KILL_GRACE = 0.5

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


def _pump(stream: IO[bytes], kind: str, out: queue.Queue[dict[str, Any]]) -> None:
    for raw in iter(stream.readline, b""):
        if kind == "log":
            out.put({"kind": "log", "data": raw.decode(errors="replace").rstrip("\n")})
            continue
        try:
            out.put(json.loads(raw))
        except ValueError:
            out.put({"kind": "log", "data": raw.decode(errors="replace").rstrip("\n")})
    stream.close()


def run_job(
    spec: dict[str, Any], *, agent_socket: str, tick: float = 0.25
) -> Generator[dict[str, Any], None, None]:
    """Start the job and yield its records; the last one has kind `exit`.

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
    records: queue.Queue[dict[str, Any]] = queue.Queue()
    readers = [
        threading.Thread(target=_pump, args=(process.stdout, "log", records), daemon=True),
        threading.Thread(
            target=_pump, args=(os.fdopen(read_fd, "rb"), "events", records), daemon=True
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
    outcome: dict[str, Any] | None = None
    outputs: dict[str, str] = {}
    try:
        while True:
            try:
                record: dict[str, Any] | None = records.get(timeout=tick)
            except queue.Empty:
                record = None
            now = time.monotonic()
            if record is None and process.poll() is not None:
                # The job process ended: leftovers in its group go too, then drain.
                if _group_alive(process.pid):
                    kill_group(process)
                for reader in readers:
                    reader.join(timeout=1.0)
                while not records.empty():
                    late = records.get_nowait()
                    if late.get("kind") in ("result", "error"):
                        outcome = late
                    else:
                        if late.get("kind") == "output":
                            outputs[str(late["name"])] = str(late["digest"])
                        yield late
                break
            if record is None:
                yield {"kind": "tick"}
            else:
                last_output = now
                kind = record.get("kind")
                if kind in ("result", "error"):
                    outcome = record
                else:
                    if kind == "output":
                        outputs[str(record["name"])] = str(record["digest"])
                    yield record
            if now - started >= timeout:
                kill_group(process)
                yield _failed("JOB_TIMEOUT", f"ran longer than its timeout of {timeout:g} s")
                return
            if now - last_output >= silence:
                kill_group(process)
                yield _failed("JOB_SILENT", f"no output or event for {silence:g} s")
                return
        code = process.wait()
        if outcome is not None and outcome.get("kind") == "result" and code == 0:
            yield {
                "kind": "exit",
                "state": "succeeded",
                "result": outcome.get("value"),
                "outputs": outputs,
            }
        elif outcome is not None and outcome.get("kind") == "error":
            yield _failed(str(outcome.get("code")), str(outcome.get("message")))
        else:
            yield _failed("JOB_EXITED", f"the job process ended with exit code {code}")
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


def _failed(code: str, message: str) -> dict[str, Any]:
    return {"kind": "exit", "state": "failed", "error": {"code": code, "message": message}}
