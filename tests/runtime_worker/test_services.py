"""Services under a real runtime worker process, driven over its unix socket: started, probed,
restarted with backoff, replaced by a new generation, stopped with all they started, and never
showing a secret."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from modelforge_contracts.ipc import UnixHTTPConnection
from runtime_worker.execution import jobs_directory
from runtime_worker.services import ONNX_HEALTH_PATH, InvalidService, ServiceSpec
from tests.e2e.node import wait_until

SERVE = [sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"]
#: A service that starts a child in its own process group, then serves HTTP.
WITH_CHILD = """
import http.server, os, subprocess, sys
subprocess.Popen(["sleep", "300"])
http.server.test(
    HandlerClass=http.server.SimpleHTTPRequestHandler, port=int(os.environ["PORT"]),
    bind="127.0.0.1",
)
"""


def telling(names: list[str], out: str, then: str = "") -> str:
    """A service that writes what it sees of `names` in its environment to OUT_DIR/`out` as
    JSON, runs `then`, and serves HTTP on its port."""
    return f"""
import http.server, json, os, pathlib
names = {names!r}
pathlib.Path(os.environ["OUT_DIR"], {out!r}).write_text(
    json.dumps({{name: os.environ.get(name) for name in names}})
)
{then}
http.server.test(
    HandlerClass=http.server.SimpleHTTPRequestHandler, port=int(os.environ["PORT"]),
    bind="127.0.0.1",
)
"""


#: A service that records what its secrets are (in OUT_DIR, which the test gives it), prints
#: one of them, then serves HTTP; and one that records which GPUs it may see.
TELLS_SECRETS = telling(
    ["MY_SECRET", "HF_TOKEN"],
    "seen.json",
    then='print("my secret is", os.environ["MY_SECRET"], flush=True)',
)
TELLS_GPUS = telling(["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"], "gpus.json")
FAST_HEALTH = {
    "path": "/",
    "interval_seconds": 0.2,
    "timeout_seconds": 1,
    "failure_threshold": 3,
    "start_period_seconds": 10,
}


def service(generation: int = 1, **overrides: Any) -> dict[str, Any]:
    """A service specification as the agent sends it: http.server on `{port}`."""
    body: dict[str, Any] = {
        "generation": generation,
        "name": "web",
        "command": SERVE,
        "runner": None,
        "weights_path": None,
        "params": {},
        "env": {},
        "secrets": {},
        "assigned_gpus": [],
        "resources": {"cpus": 1, "gpus": 0, "memory_mb": 128},
        "health": FAST_HEALTH,
        "restart": {"initial_backoff_seconds": 0.3, "max_backoff_seconds": 5},
        "agent_socket": "/nonexistent/agent.sock",
        "private_paths": [],
    }
    body.update(overrides)
    return body


@dataclass
class Worker:
    socket: Path
    process: subprocess.Popen[bytes]
    log: Path

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        connection = UnixHTTPConnection(self.socket, timeout=60)
        try:
            payload = None if body is None else json.dumps(body)
            connection.request(method, path, body=payload)
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()

    def put(self, service_id: str, body: dict[str, Any]) -> tuple[int, Any]:
        return self.call("PUT", f"/v1/services/{service_id}", body)

    def status(self, service_id: str) -> dict[str, Any]:
        status, answer = self.call("GET", "/v1/services")
        assert status == 200
        found = [s for s in answer["services"] if s["service_id"] == service_id]
        assert found, f"the worker runs no {service_id}: {answer}"
        return dict(found[0])

    def wait_for(self, service_id: str, what: str, timeout: float = 15, **fields: Any) -> None:
        wait_until(
            lambda: all(self.status(service_id)[k] == v for k, v in fields.items()),
            timeout,
            f"{service_id} {what}: {fields}",
        )

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


def _listening(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    socket_path = tmp_path / "worker.sock"
    log = tmp_path / "worker.log"
    env = dict(os.environ, MODELFORGE_WORKER_SOCKET=str(socket_path), HF_TOKEN="from-the-node")
    with log.open("wb") as handle:
        process = subprocess.Popen([sys.executable, "-m", "runtime_worker"], env=env, stderr=handle)
    try:
        # Listening, not only there: the file exists from bind(), before listen() (a connection
        # in between is refused: seen once in CI).
        wait_until(lambda: _listening(socket_path), 10, "the worker's socket")
        yield Worker(socket_path, process, log)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def group_members(pgid: int) -> list[int]:
    """The processes whose process group is `pgid`, from /proc."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(name))
    return members


def work_dirs(worker: Worker, service_id: str) -> list[Path]:
    root = jobs_directory(worker.socket)
    if not root.exists():
        return []
    return [path for path in root.iterdir() if path.name.startswith(f"{service_id}-")]


def kinds(status: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [event["data"] for event in status["events"] if event["kind"] == kind]


def test_a_command_service_becomes_healthy_and_is_restarted_after_sigkill(worker: Worker) -> None:
    status, answer = worker.put("web", service())
    assert status == 201 and answer == {"service_id": "web", "generation": 1, "state": "starting"}
    worker.wait_for("web", "healthy", state="healthy")
    first = worker.status("web")
    assert first["restarts"] == 0 and first["last_exit"] is None
    assert isinstance(first["port"], int) and first["pid"] in group_members(first["pid"])

    os.kill(first["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    worker.wait_for("web", "restarted", restarts=1)
    worker.wait_for("web", "healthy again", state="healthy")
    # Back within its backoff (0.3 s) plus the start and a probe, not a long wait.
    assert time.monotonic() - killed_at < 8
    again = worker.status("web")
    assert again["last_exit"]["signal"] == 9 and again["last_exit"]["code"] is None
    assert again["pid"] != first["pid"]
    assert {"code": None, "signal": 9} in kinds(again, "exit")
    assert {"reason": "exit", "backoff_seconds": 0.3} in kinds(again, "restart")
    states = [data["state"] for data in kinds(again, "state")]
    assert states == ["starting", "healthy", "restarting", "starting", "healthy"]
    # Each start's cold start (process start to first healthy answer), once per start.
    cold_starts = [data["cold_start_seconds"] for data in kinds(again, "ready")]
    assert len(cold_starts) == 2 and all(0 < seconds < 30 for seconds in cold_starts)
    seqs = [event["seq"] for event in again["events"]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert any("GET / HTTP/1.1" in line for line in again["log_tail"])


def test_delete_ends_its_process_group_and_removes_its_work_directory(worker: Worker) -> None:
    worker.put("grouped", service(command=[sys.executable, "-c", WITH_CHILD]))
    worker.wait_for("grouped", "healthy", state="healthy")
    pid = worker.status("grouped")["pid"]
    wait_until(lambda: len(group_members(pid)) == 2, 10, "the service and its child")
    assert len(work_dirs(worker, "grouped")) == 1

    status, answer = worker.call("DELETE", "/v1/services/grouped")
    assert (status, answer) == (200, {"stopped": True})
    assert group_members(pid) == []  # gone when the answer came, not later
    assert work_dirs(worker, "grouped") == []
    _, listing = worker.call("GET", "/v1/services")
    assert listing["services"] == []
    status, answer = worker.call("DELETE", "/v1/services/grouped")
    assert status == 404 and answer["error"]["code"] == "SERVICE_NOT_FOUND"


def test_a_new_generation_restarts_it_and_the_same_one_changes_nothing(worker: Worker) -> None:
    worker.put("web", service())
    worker.wait_for("web", "healthy", state="healthy")
    before = worker.status("web")

    status, answer = worker.put("web", service())
    assert status == 200 and answer["generation"] == 1
    time.sleep(0.5)
    same = worker.status("web")
    assert same["pid"] == before["pid"] and same["restarts"] == 0

    status, answer = worker.put("web", service(generation=2))
    assert status == 200 and answer["generation"] == 2
    worker.wait_for("web", "restarted", restarts=1, generation=2)
    worker.wait_for("web", "healthy at generation 2", state="healthy")
    after = worker.status("web")
    assert after["pid"] != before["pid"] and not group_members(before["pid"])
    assert {"reason": "requested", "generation": 2} in kinds(after, "restart")


def test_a_command_that_exits_at_once_backs_off_longer_each_time(worker: Worker) -> None:
    body = service(
        command=[sys.executable, "-c", "raise SystemExit(3)"],
        restart={"initial_backoff_seconds": 0.1, "max_backoff_seconds": 0.4},
    )
    worker.put("crashing", body)
    worker.wait_for("crashing", "four restarts", restarts=4)
    status = worker.status("crashing")
    assert status["state"] in ("restarting", "starting")
    assert status["last_exit"]["code"] == 3 and status["last_exit"]["signal"] is None
    backoffs = [data["backoff_seconds"] for data in kinds(status, "restart")]
    assert backoffs[:4] == [0.1, 0.2, 0.4, 0.4]
    assert "healthy" not in [data["state"] for data in kinds(status, "state")]


def test_an_unhealthy_service_is_stopped_and_restarted_with_few_events(worker: Worker) -> None:
    health = dict(FAST_HEALTH, path="/missing", start_period_seconds=0.5, failure_threshold=3)
    worker.put("sick", service(health=health))
    worker.wait_for("sick", "restarted for failing its checks", restarts=1)
    status = worker.status("sick")
    assert status["last_exit"]["signal"] == 15
    assert "unhealthy" in [data["state"] for data in kinds(status, "state")]
    assert {"reason": "unhealthy", "backoff_seconds": 0.3} in kinds(status, "restart")
    failures = kinds(status, "health")
    # One at the first counted failure, one when the threshold is met: not one per probe.
    assert failures[:2] == [
        {"healthy": False, "problem": "HTTP 404"},
        {"healthy": False, "failures": 3, "problem": "HTTP 404"},
    ]


def test_a_service_that_cannot_start_is_failed_with_the_reason_and_tried_again(
    worker: Worker, tmp_path: Path
) -> None:
    missing = tmp_path / "weights.onnx"
    worker.put("no-weights", service(command=["cat", "{weights}"], weights_path=str(missing)))
    worker.put("no-program", service(command=["/nonexistent/serve", "{port}"]))
    worker.wait_for("no-weights", "failed", state="failed")
    worker.wait_for("no-program", "failed", state="failed")
    wait_until(
        lambda: len(kinds(worker.status("no-weights"), "error")) >= 2, 10, "a second attempt"
    )
    errors = kinds(worker.status("no-weights"), "error")
    assert errors[0]["code"] == "SERVICE_WEIGHTS_MISSING" and str(missing) in errors[0]["message"]
    assert kinds(worker.status("no-program"), "error")[0]["code"] == (
        "SERVICE_COMMAND_NOT_EXECUTABLE"
    )
    assert worker.status("no-weights")["restarts"] == 0  # nothing ran, nothing restarted

    missing.write_bytes(b"weights")  # the next attempt finds them
    wait_until(lambda: worker.status("no-weights")["last_exit"] is not None, 10, "the weights used")
    assert worker.status("no-weights")["last_exit"]["code"] == 0
    assert "weights" in worker.status("no-weights")["log_tail"]


def test_secrets_reach_the_service_and_nothing_else(worker: Worker, tmp_path: Path) -> None:
    value = "s3cr3t-" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:16]
    token = "hf_" + value[::-1]
    body = service(
        command=[sys.executable, "-c", TELLS_SECRETS],
        env={"OUT_DIR": str(tmp_path)},
        secrets={"MY_SECRET": value, "HF_TOKEN": token},
    )
    worker.put("secretive", body)
    worker.wait_for("secretive", "healthy", state="healthy")
    seen = json.loads((tmp_path / "seen.json").read_text())
    # HF_TOKEN from the worker's own environment is filtered; the secret of that name is given.
    assert seen == {"MY_SECRET": value, "HF_TOKEN": token}

    _, listing = worker.call("GET", "/v1/services")
    shown = json.dumps(listing)
    assert value not in shown and token not in shown
    assert "my secret is [secret]" in worker.status("secretive")["log_tail"]
    # A refused specification names the field, never the value.
    status, answer = worker.put("secretive", service(generation=2, secrets={"BAD NAME": value}))
    assert status == 400 and answer["error"]["code"] == "INVALID_SERVICE"
    assert "secrets" in answer["error"]["message"] and value not in json.dumps(answer)
    worker.call("DELETE", "/v1/services/secretive")
    worker.process.send_signal(signal.SIGTERM)
    worker.process.wait(timeout=30)
    assert value not in worker.stderr() and token not in worker.stderr()
    assert "secretive" in worker.stderr()  # the log was written, just without the values


def test_the_worker_stopping_stops_every_service(worker: Worker) -> None:
    worker.put("one", service(command=[sys.executable, "-c", WITH_CHILD]))
    worker.put("two", service())
    worker.wait_for("one", "healthy", state="healthy")
    worker.wait_for("two", "healthy", state="healthy")
    groups = [worker.status(name)["pid"] for name in ("one", "two")]
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(timeout=30) == 0
    assert all(group_members(pgid) == [] for pgid in groups)
    assert not jobs_directory(worker.socket).exists()


def test_a_worker_killed_with_sigkill_leaves_no_service_behind(worker: Worker) -> None:
    worker.put("orphan", service(command=[sys.executable, "-c", WITH_CHILD]))
    worker.wait_for("orphan", "healthy", state="healthy")
    pid = worker.status("orphan")["pid"]
    wait_until(lambda: len(group_members(pid)) == 2, 10, "the service and its child")
    worker.process.kill()
    worker.process.wait(timeout=10)
    # The kernel tells the supervisor; it ends the group and removes the work directory.
    wait_until(lambda: group_members(pid) == [], 10, "the orphaned service's group to end")
    wait_until(lambda: work_dirs(worker, "orphan") == [], 10, "its work directory removed")


JOB_SOURCE = """
import hashlib, os
from pathlib import Path


def check(expected):
    value = os.environ["MY_SECRET"]
    print("the job prints", value, flush=True)
    in_files = [
        str(path) for path in Path.cwd().rglob("*")
        if path.is_file() and value.encode() in path.read_bytes()
    ]
    return {
        "matches": hashlib.sha256(value.encode()).hexdigest() == expected,
        "in_files": in_files,
    }
"""


def test_a_jobs_secrets_reach_its_process_and_no_record(worker: Worker, tmp_path: Path) -> None:
    value = "job-secret-" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
    assignment = {
        "job_id": "job_s",
        "entrypoint": {
            "kind": "python",
            "module": "m",
            "function": "check",
            "source": {"m.py": JOB_SOURCE},
        },
        "params": {"expected": hashlib.sha256(value.encode()).hexdigest()},
        "resources": {"cpus": 1, "gpus": 0, "memory_mb": 64},
        "secrets": {"MY_SECRET": value},
        "agent_socket": str(tmp_path / "agent.sock"),
        "private_paths": [],
    }
    connection = UnixHTTPConnection(worker.socket, timeout=60)
    try:
        connection.request("POST", "/v1/jobs", body=json.dumps(assignment))
        stream = connection.getresponse().read().decode()
    finally:
        connection.close()
    records = [json.loads(line) for line in stream.splitlines()]
    final = records[-1]
    assert final["state"] == "succeeded", stream
    assert final["result"] == {"matches": True, "in_files": []}
    assert value not in stream
    assert {"kind": "log", "data": "the job prints [secret]"} in records


def test_the_onnx_runner_command_and_malformed_specifications() -> None:
    spec = ServiceSpec.from_json(
        {"generation": 1, "name": "relu", "runner": "onnx", "weights_path": "/c/w.onnx"},
        service_id="svc_1",
    )
    assert spec.argv == (
        sys.executable,
        "-m",
        "runtime_worker.onnx_server",
        "--model",
        "/c/w.onnx",
        "--port",
        "{port}",
        "--grpc-port",
        "{grpc_port}",
        "--host",
        "{host}",
        "--name",
        "relu",
    )
    assert spec.host == "127.0.0.1"  # an agent that sends no host: this node only
    assert spec.health.path == ONNX_HEALTH_PATH
    secret = ServiceSpec.from_json(
        {"generation": 1, "name": "n", "command": ["x"], "secrets": {"A": "hidden-value"}},
        service_id="s",
    )
    assert "hidden-value" not in repr(secret)
    bad = {
        "generation": ({"generation": "1", "name": "n", "command": ["x"]}, "generation"),
        "command": ({"generation": 1, "name": "n", "command": []}, "command"),
        "weights": ({"generation": 1, "name": "n", "command": ["x", "{weights}"]}, "{weights}"),
        "onnx": ({"generation": 1, "name": "n", "runner": "onnx"}, "weights_path"),
        "health": (
            {"generation": 1, "name": "n", "command": ["x"], "health": {"interval_seconds": 0}},
            "health.interval_seconds",
        ),
        "gpus": ({"generation": 1, "name": "n", "command": ["x"], "assigned_gpus": "0"}, "gpus"),
        "env": ({"generation": 1, "name": "n", "command": ["x"], "env": {"A": 1}}, "env.A"),
    }
    for case, (body, named) in bad.items():
        with pytest.raises(InvalidService) as caught:
            ServiceSpec.from_json(body, service_id="s")
        assert named in str(caught.value), case


def test_a_malformed_body_is_refused_over_the_socket(worker: Worker) -> None:
    status, answer = worker.put("web", {"generation": 1, "name": "web", "command": "serve"})
    assert status == 400 and answer["error"]["code"] == "INVALID_SERVICE"
    assert "command" in answer["error"]["message"]
    status, answer = worker.put("bad!id", service())
    assert status == 400 and "service_id" in answer["error"]["message"]
    _, listing = worker.call("GET", "/v1/services")
    assert listing["services"] == []


def test_a_service_sees_exactly_the_gpus_it_holds(worker: Worker, tmp_path: Path) -> None:
    held = [{"index": 1, "uuid": "GPU-held-1"}]
    body = service(
        command=[sys.executable, "-c", TELLS_GPUS],
        env={"OUT_DIR": str(tmp_path)},
        assigned_gpus=held,
        resources={"cpus": 1, "gpus": 1, "memory_mb": 128},
    )
    worker.put("on-gpu", body)
    worker.wait_for("on-gpu", "healthy", state="healthy")
    seen = json.loads((tmp_path / "gpus.json").read_text())
    assert seen == {"CUDA_VISIBLE_DEVICES": "GPU-held-1", "NVIDIA_VISIBLE_DEVICES": "GPU-held-1"}
    worker.call("DELETE", "/v1/services/on-gpu")
