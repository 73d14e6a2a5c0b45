"""Jobs end to end with real processes: control plane on Granian, a
cpu-mode node agent and its runtime worker. The model actually runs."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from runtime_worker.execution import jobs_directory
from tests.e2e.node import Node, live_stack, wait_ready, wait_until
from tests.e2e.server import LiveServer
from tests.onnx_models import relu_matmul

pytestmark = pytest.mark.e2e

FAST = {
    "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_TELEMETRY_INTERVAL_SECONDS": "2",
    "MODELFORGE_NODE_STALE_AFTER_SECONDS": "5",
    "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": "10",
    "MODELFORGE_JOB_PROGRESS_INTERVAL_SECONDS": "0.5",
    "MODELFORGE_JOB_CONTACT_TIMEOUT_SECONDS": "3",
    "MODELFORGE_LIVENESS_SWEEP_INTERVAL_SECONDS": "0.2",
}

PIPELINE = """
import os, subprocess, sys
from pathlib import Path
from runtime_worker.job import emit, save_artifact

import helpers


def run(n, text):
    for i in range(n):
        emit({"step": i})
    out = Path("out.txt")
    out.write_text(helpers.shout(text))
    digest = save_artifact(out, name="report")
    return {"digest": digest, "env_has_token": any("TOKEN" in k for k in os.environ)}


def linger():
    child = subprocess.Popen(["sleep", "300"])
    emit({"pids": [os.getpid(), child.pid]})
    child.wait()


def too_long():
    import time
    while True:
        emit({"tick": True})
        time.sleep(0.2)


def quiet():
    import time
    time.sleep(300)


def not_a_number():
    return {"loss": float("nan")}


def colourful_failure():
    raise RuntimeError("\x1b[31mred\x1b[0m \u202eevil\u202c")


def infinite_event():
    emit({"loss": float("inf")})
    return "not reached"


def raw_nan_event():
    # Past the helpers, straight into the events pipe.
    os.write(int(os.environ["MODELFORGE_JOB_EVENTS_FD"]), b'{"kind":"event","data":NaN}\\n')
    return "done"


def careful():
    try:
        emit({"loss": float("nan")})
    except ValueError as exc:
        emit({"refused": str(exc)})
    return "ok"


def traverse(digests):
    from runtime_worker.job import load_artifact

    answers = []
    for digest in digests:
        try:
            answers.append("served " + str(load_artifact(digest)))
        except RuntimeError as exc:
            answers.append(str(exc))
    return answers


def pry(agent_pid, worker_pid, state_dir):
    # Everything a job running as the agent's user might try to get at the credential.
    import ctypes
    import errno

    attempts = {
        "agent environ": f"/proc/{agent_pid}/environ",
        "agent mem": f"/proc/{agent_pid}/mem",
        "agent root": f"/proc/{agent_pid}/root{state_dir}/identity.json",
        "agent cwd": f"/proc/{agent_pid}/cwd",
        "worker root": f"/proc/{worker_pid}/root{state_dir}/identity.json",
        "identity file": f"{state_dir}/identity.json",
    }
    outcome = {}
    for name, path in attempts.items():
        try:
            if os.path.isdir(path):
                outcome[name] = "listed " + ",".join(os.listdir(path))
                continue
            with open(path, "rb") as handle:
                outcome[name] = "opened " + handle.read(1 << 16).decode(errors="replace")
        except OSError as exc:
            outcome[name] = "refused " + errno.errorcode.get(exc.errno or 0, "?")
    libc = ctypes.CDLL(None, use_errno=True)
    ptrace_seize = 0x4206  # does not stop the tracee; it is let go when this job exits
    if libc.ptrace(ptrace_seize, agent_pid, None, None) == 0:
        outcome["agent ptrace"] = "attached"
    else:
        outcome["agent ptrace"] = "refused " + errno.errorcode.get(ctypes.get_errno(), "?")
    return outcome


def daemonise():
    # A grandchild that detaches itself (double fork, setsid), then the job waits.
    import time

    read_end, write_end = os.pipe()
    first = os.fork()
    if first == 0:
        try:
            os.setsid()
            if os.fork() > 0:
                os._exit(0)
            os.chdir("/")
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.write(write_end, str(os.getpid()).encode())
            os.closerange(3, 4096)
            time.sleep(300)
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(first, 0)
    daemon = int(os.read(read_end, 32))
    emit({"daemon": daemon, "job": os.getpid(), "workdir": os.getcwd()})
    time.sleep(300)
"""
HELPERS = "def shout(text):\n    return text.upper() + '!'\n"
SOURCE = {"pipeline.py": PIPELINE, "helpers.py": HELPERS}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Node]]:
    with live_stack(tmp_path_factory.mktemp("jobs"), FAST) as (server, node):
        node_id = node.start_worker().start_agent("--parallel", "2").node_id()
        wait_ready(server, node_id, 30)
        yield server, node


def _submit(server: LiveServer, function: str, **extra: Any) -> dict[str, Any]:
    body = {
        "entrypoint": {
            "kind": "python",
            "module": "pipeline",
            "function": function,
            "source": SOURCE,
        },
        **extra,
    }
    with server.client() as client:
        response = client.post("/api/v1/jobs", headers=server.admin, json=body)
    assert response.status_code == 201, response.text
    return dict(response.json())


def _job(server: LiveServer, job_id: str) -> dict[str, Any]:
    return dict(server.get(f"/api/v1/jobs/{job_id}"))


def _wait_state(
    server: LiveServer, job_id: str, states: set[str], timeout: float
) -> dict[str, Any]:
    wait_until(lambda: _job(server, job_id)["state"] in states, timeout, f"job {states}")
    return _job(server, job_id)


def _events(server: LiveServer, job_id: str) -> list[dict[str, Any]]:
    return list(server.get(f"/api/v1/jobs/{job_id}/events"))


def test_python_job_from_submitted_source(stack: tuple[LiveServer, Node]) -> None:
    server, _ = stack
    job = _submit(server, "run", params={"n": 5, "text": "hello"})
    done = _wait_state(server, job["job_id"], {"succeeded", "failed"}, 30)
    assert done["state"] == "succeeded", done
    steps = [
        e["data"]["step"]
        for e in _events(server, job["job_id"])
        if e["kind"] == "event" and "step" in (e["data"] or {})
    ]
    assert steps == [0, 1, 2, 3, 4]
    digest = done["result"]["digest"]
    assert done["outputs"] == {"report": digest}
    assert done["result"]["env_has_token"] is False  # credential-like variables filtered
    with server.client() as client:
        content = client.get(f"/api/v1/artifacts/{digest}", headers=server.admin).content
    assert content == b"HELLO!"
    assert "sha256:" + hashlib.sha256(content).hexdigest() == digest


def test_onnx_model_runs_on_the_node(stack: tuple[LiveServer, Node], tmp_path: Path) -> None:
    server, _ = stack
    weights = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    model_bytes = relu_matmul(weights)
    x = np.random.default_rng(7).standard_normal((5, 4)).astype(np.float32)
    feed = io.BytesIO()
    np.savez(feed, x=x)
    with server.client() as client:
        model_digest = client.post(
            "/api/v1/artifacts", headers=server.admin, content=model_bytes
        ).json()["digest"]
        tensors = client.post(
            "/api/v1/artifacts", headers=server.admin, content=feed.getvalue()
        ).json()["digest"]
        job = client.post(
            "/api/v1/jobs",
            headers=server.admin,
            json={
                "entrypoint": {"kind": "onnx", "model": model_digest},
                "inputs": {"tensors": tensors},
            },
        ).json()
    done = _wait_state(server, job["job_id"], {"succeeded", "failed"}, 60)
    assert done["state"] == "succeeded", done
    assert done["result"]["provider"] == "CPUExecutionProvider"
    with server.client() as client:
        outputs = client.get(
            f"/api/v1/artifacts/{done['outputs']['outputs']}", headers=server.admin
        ).content
    expected = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]
    with np.load(io.BytesIO(outputs)) as result:
        np.testing.assert_allclose(result["y"], expected, rtol=1e-6)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes; read its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _pids(server: LiveServer, job_id: str) -> list[int]:
    for event in _events(server, job_id):
        if event["kind"] == "event" and "pids" in (event["data"] or {}):
            return list(event["data"]["pids"])
    return []


def test_cancel_kills_the_whole_group(stack: tuple[LiveServer, Node]) -> None:
    server, _ = stack
    job = _submit(server, "linger")
    wait_until(lambda: len(_pids(server, job["job_id"])) == 2, 30, "the job's pids")
    pids = _pids(server, job["job_id"])
    assert all(_alive(pid) for pid in pids)
    with server.client() as client:
        client.post(f"/api/v1/jobs/{job['job_id']}/cancel", headers=server.admin)
    started = time.monotonic()
    wait_until(lambda: not any(_alive(pid) for pid in pids), 2, "job and grandchild gone")
    assert time.monotonic() - started <= 2
    final = _wait_state(server, job["job_id"], {"cancelled"}, 10)
    assert final["error"]["code"] == "JOB_CANCELLED"


def test_timeout_and_silence_have_distinct_codes(stack: tuple[LiveServer, Node]) -> None:
    server, _ = stack
    timed = _submit(server, "too_long", timeout_seconds=2, silence_timeout_seconds=60)
    silent = _submit(server, "quiet", timeout_seconds=60, silence_timeout_seconds=2)
    timed_out = _wait_state(server, timed["job_id"], {"failed", "succeeded"}, 20)
    went_silent = _wait_state(server, silent["job_id"], {"failed", "succeeded"}, 20)
    assert timed_out["error"]["code"] == "JOB_TIMEOUT"
    assert went_silent["error"]["code"] == "JOB_SILENT"


def test_agent_killed_mid_job_fails_it_and_leaves_nothing(tmp_path: Path) -> None:
    with live_stack(tmp_path, FAST) as (server, node):
        node_id = node.start_worker().start_agent().node_id()
        wait_ready(server, node_id, 30)
        job = _submit(server, "linger")
        wait_until(lambda: len(_pids(server, job["job_id"])) == 2, 30, "the job's pids")
        pids = _pids(server, job["job_id"])
        assert node.stop_agent(signal.SIGKILL) == -signal.SIGKILL
        # The worker notices its agent is gone and kills the group.
        wait_until(lambda: not any(_alive(pid) for pid in pids), 5, "job processes gone")
        failed = _wait_state(server, job["job_id"], {"failed"}, 15)
        assert failed["error"]["code"] == "JOB_CONTACT_LOST"
        assert node.worker is not None and node.worker.poll() is None  # the worker lives on


def _event_with(server: LiveServer, job_id: str, key: str) -> dict[str, Any] | None:
    for event in _events(server, job_id):
        if event["kind"] == "event" and key in (event["data"] or {}):
            return dict(event["data"])
    return None


def test_job_code_cannot_make_the_agent_touch_files_outside_its_cache(
    stack: tuple[LiveServer, Node],
) -> None:
    """A "digest" with slashes or `..` names no file: the agent's local socket refuses it with
    INVALID_DIGEST, touches nothing and asks the control plane nothing."""
    server, node = stack
    victim = node.root / "victim.txt"
    victim.write_text("not an artifact")
    os.utime(victim, (1_000_000, 1_000_000))
    relative = os.path.relpath(victim, node.root / "cache")
    padded = "." + "/" * (64 - 1 - len(relative)) + relative  # 64 characters, like a digest
    assert len(padded) == 64
    digests = [
        "sha256:" + padded,
        "sha256:" + "../" * 21 + "x",
        "sha256:" + "A" * 64,  # hex, but not lowercase
        "sha256:" + "a" * 63 + "\n",
    ]
    job = _submit(server, "traverse", params={"digests": digests})
    done = _wait_state(server, job["job_id"], {"succeeded", "failed"}, 30)
    assert done["state"] == "succeeded", done["error"]
    for digest, answer in zip(digests, done["result"], strict=True):
        assert answer.startswith("INVALID_DIGEST: "), (digest, answer)
        assert "64 lowercase hex" in answer
    assert victim.stat().st_mtime == 1_000_000  # not touched
    assert victim.read_text() == "not an artifact"


def test_job_code_cannot_read_the_node_credential(stack: tuple[LiveServer, Node]) -> None:
    """Jobs run as the agent's user: the agent's environment, memory and state directory stay
    out of their reach (the agent is not dumpable; the job's view hides the state directory)."""
    server, node = stack
    assert node.agent is not None and node.worker is not None
    identity = (node.state / "identity.json").read_text()
    credential = json.loads(identity)["credential"]
    job = _submit(
        server,
        "pry",
        params={
            "agent_pid": node.agent.pid,
            "worker_pid": node.worker.pid,
            "state_dir": str(node.state),
        },
    )
    done = _wait_state(server, job["job_id"], {"succeeded", "failed"}, 30)
    assert done["state"] == "succeeded", done["error"]
    outcome = done["result"]
    leaks = {name: result for name, result in outcome.items() if not result.startswith("refused")}
    assert set(outcome) >= {"agent environ", "agent mem", "agent ptrace", "identity file"}
    assert leaks == {}, outcome
    everything = json.dumps(done) + json.dumps(_events(server, job["job_id"]))
    assert credential not in everything
    assert node.token is not None and node.token not in everything
    # The agent is unharmed and the job's helpers still work.
    after = _submit(server, "run", params={"n": 1, "text": "fine"})
    assert _wait_state(server, after["job_id"], {"succeeded", "failed"}, 30)["state"] == "succeeded"


def test_worker_killed_leaves_no_job_process_and_no_work_directory(tmp_path: Path) -> None:
    """SIGKILL gives the runtime worker no chance to clean up: the job's processes, a daemonised
    grandchild included, end anyway, and its work directory does not outlive the worker."""
    with live_stack(tmp_path, FAST) as (server, node):
        node_id = node.start_worker().start_agent().node_id()
        wait_ready(server, node_id, 30)
        job = _submit(server, "daemonise")
        wait_until(
            lambda: _event_with(server, job["job_id"], "daemon") is not None,
            30,
            "the daemonised grandchild",
        )
        seen = _event_with(server, job["job_id"], "daemon")
        assert seen is not None
        worker = node.worker
        assert worker is not None
        pids = {seen["job"], seen["daemon"]} | _ancestors_below(seen["job"], worker.pid)
        workdir = Path(seen["workdir"])
        assert all(_alive(pid) for pid in pids) and workdir.is_dir()
        assert _parent(seen["daemon"]) != 1  # not left to init while its job runs

        assert node.stop_worker(signal.SIGKILL) == -signal.SIGKILL
        wait_until(lambda: not any(_alive(pid) for pid in pids), 5, "the job's processes gone")
        failed = _wait_state(server, job["job_id"], {"failed"}, 15)
        assert failed["error"]["code"] in ("JOB_WORKER_LOST", "JOB_CONTACT_LOST"), failed

        node.start_worker()
        wait_until(lambda: not workdir.exists(), 10, "the work directory removed")
        # The restarted worker runs jobs again.
        wait_ready(server, node_id, 30, "node readiness after the restart")
        after = _submit(server, "run", params={"n": 1, "text": "again"})
        done = _wait_state(server, after["job_id"], {"succeeded", "failed"}, 30)
        assert done["state"] == "succeeded", done


def test_without_user_namespaces_a_job_that_could_read_the_credential_does_not_run(
    tmp_path: Path,
) -> None:
    """Agent and worker as one user on a host that refuses user namespaces: the worker cannot
    hide the agent's state directory, so the job fails with JOB_ISOLATION_UNAVAILABLE, saying
    what to do, instead of running next to a readable credential."""
    with live_stack(tmp_path, FAST) as (server, node):
        node_id = node.start_worker_without_user_namespaces().start_agent().node_id()
        wait_ready(server, node_id, 30)
        job = _submit(server, "run", params={"n": 3, "text": "never"})
        failed = _wait_state(server, job["job_id"], {"failed", "succeeded"}, 30)
        assert failed["state"] == "failed", failed
        assert failed["error"]["code"] == "JOB_ISOLATION_UNAVAILABLE", failed["error"]
        message = failed["error"]["message"]
        assert str(node.state) in message and "docs/nodes.md" in message
        assert not [e for e in _events(server, job["job_id"]) if e["kind"] == "event"]
        assert node.agent is not None and node.agent.poll() is None


def test_a_worker_start_removes_work_directories_left_behind(tmp_path: Path) -> None:
    """A supervisor killed together with its worker cannot clean up: the next worker on the
    same socket removes what is left in its jobs directory, unwritable parts included."""
    node = Node(tmp_path / "node", "http://127.0.0.1:9")
    jobs = jobs_directory(node.socket)
    left = jobs / "job_gone-abc123"
    (left / "src" / "locked").mkdir(parents=True)
    (left / "src" / "locked" / "weights.bin").write_bytes(b"x" * 1000)
    (left / "src" / "locked").chmod(0)
    try:
        with node:
            node.start_worker()
            wait_until(lambda: not left.exists(), 10, "the leftover work directory removed")
            assert jobs.is_dir() and stat.S_IMODE(jobs.stat().st_mode) == 0o700
            assert list(jobs.iterdir()) == []
            wait_until(
                lambda: (
                    "removed 1 work directories a previous runtime worker left" in node.worker_log()
                ),
                5,
                "the log line",
            )
    finally:
        if left.exists():
            (left / "src" / "locked").chmod(0o700)
        shutil.rmtree(jobs, ignore_errors=True)


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _ancestors_below(pid: int, top: int) -> set[int]:
    """The processes between `pid` and its ancestor `top` (the worker), both excluded."""
    found: set[int] = set()
    parent = _parent(pid)
    while parent not in (top, 0, 1):
        found.add(parent)
        parent = _parent(parent)
    return found


def test_values_that_are_not_json_fail_their_job_and_the_agent_serves_on(
    stack: tuple[LiveServer, Node],
) -> None:
    """NaN or Infinity in a result or an event fails that job with JOB_RESULT_NOT_JSON; the
    agent stays up and runs the next job."""
    server, node = stack
    for function in ("not_a_number", "infinite_event", "raw_nan_event"):
        job = _submit(server, function)
        done = _wait_state(server, job["job_id"], {"succeeded", "failed"}, 30)
        assert done["state"] == "failed", (function, done)
        assert done["error"]["code"] == "JOB_RESULT_NOT_JSON", (function, done["error"])
        assert node.agent is not None and node.agent.poll() is None, node.log()
    refused = _wait_state(server, _submit(server, "infinite_event")["job_id"], {"failed"}, 30)
    assert "emit()" in refused["error"]["message"]

    # emit() refuses at the call: a job that handles it carries on.
    careful = _submit(server, "careful")
    done = _wait_state(server, careful["job_id"], {"succeeded", "failed"}, 30)
    assert done["state"] == "succeeded" and done["result"] == "ok", done
    data = [e["data"] for e in _events(server, careful["job_id"]) if e["kind"] == "event"]
    assert any("not strict JSON" in str((d or {}).get("refused")) for d in data), data

    after = _submit(server, "run", params={"n": 1, "text": "still here"})
    done = _wait_state(server, after["job_id"], {"succeeded", "failed"}, 30)
    assert done["state"] == "succeeded", done
    assert "Traceback" not in node.log()


def test_a_failure_message_with_escapes_is_reported_cleaned(stack: tuple[LiveServer, Node]) -> None:
    """A job's exception carrying ANSI colours and bidi controls still fails its job at once
    (the control plane refuses such text, so the node cleans it before reporting)."""
    server, node = stack
    job = _submit(server, "colourful_failure")
    done = _wait_state(server, job["job_id"], {"succeeded", "failed"}, 30)
    assert done["state"] == "failed", done
    assert done["error"]["code"] == "JOB_EXCEPTION"
    message = done["error"]["message"]
    assert "red" in message and "evil" in message
    assert "\x1b" not in message and "\u202e" not in message
    assert node.agent is not None and node.agent.poll() is None, node.log()
