"""Services on the node (WL-5a): long-running model servers the worker keeps running for as long
as its agent wants them — `PUT`, `DELETE` and `GET` under `/v1/services` (runtime_worker.server).
What a `PUT` asks for is parsed and checked by runtime_worker._service_spec (`ServiceSpec`, or
`InvalidService`, both still importable from here); this module runs and supervises it.

Each start runs under a supervisor of its own (runtime_worker.supervisor, argv mode): the
service's process in a process group of its own, in a fresh work directory, ended with everything
it started when the service is stopped, restarted, or the worker stops or dies — exactly as for a
job. `{port}` in the command becomes a free TCP port chosen at each start (also in `PORT`),
`{grpc_port}` a second one (also in `GRPC_PORT`; the `onnx` runner's gRPC front), `{host}` the
address to listen on (also in `HOST`: `127.0.0.1` unless the node's agent turned direct access
on), `{weights}` the local path of its weights. Its environment is the worker's, filtered as a
job's, then its `env`, its `secrets`, `PORT`, `HOST` and the variables naming exactly its GPUs.

A thread per service keeps it running: it probes `http://127.0.0.1:{port}{health.path}` every
interval (2xx and 3xx are healthy; before the first healthy answer, failures count only after the
start period; a service with a warm-up, the `llama.cpp` runner's one-token completion, is
healthy only once that answered too, and its `ready` event says how long it took), stops a
service that failed `failure_threshold` probes in a row, and starts it
again after any exit, waiting `initial × 2^(n−1)` seconds (at most the maximum) for the n-th
failure in a row; a service healthy for the maximum backoff starts that count again. What
happened is kept as numbered events (the last 100 per service), with the last 50 lines of its
output.

It must never show a secret: values are kept out of `repr()`, events, error messages and this
process's log, and replaced by `[secret]` in the output it keeps.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import os
import secrets
import select
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from modelforge_contracts.text import clean_line
from runtime_worker._service_spec import LLAMA_SERVER, HealthCheck, ServiceSpec
from runtime_worker._service_spec import ONNX_HEALTH_PATH as ONNX_HEALTH_PATH
from runtime_worker._service_spec import InvalidService as InvalidService
from runtime_worker.execution import (
    Redactor,
    hand_over,
    job_environment,
    readable,
    start_supervisor,
    stop_job,
)
from runtime_worker.supervisor import remove_tree

log = logging.getLogger("modelforge.runtime_worker.services")

_EVENTS_KEPT = 100
_LOG_LINES_KEPT = 50
_LINE_LIMIT = 2000
#: How often a running service's thread looks at its process and its orders.
_LOOK_EVERY = 0.1
#: Before the first healthy answer, probes come at least this often.
_FIRST_PROBES_EVERY = 0.5
#: How long a supervisor may take to say what it started.
_REPORT_TIMEOUT = 10.0


class WorkerStopping(Exception):
    """The worker is stopping its services: it starts none."""


def free_port(*, besides: int | None = None) -> int:
    """A TCP port free on this node right now (other than `besides`)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("0.0.0.0", 0))  # noqa: S104 - the port the service will listen on
            port = int(probe.getsockname()[1])
        if port != besides:
            return port


def probe(port: int, check: HealthCheck) -> str | None:
    """None when the service answers its health path with 2xx or 3xx; else what went wrong."""
    answer = _ask(port, "GET", check.path, None, check.timeout)
    if isinstance(answer, str):
        return answer
    return None if 200 <= answer[0] < 400 else f"HTTP {answer[0]}"


#: The longest a service's warm-up request may take (its engine's first run).
_WARM_UP_TIMEOUT = 120.0


def warm_up(port: int, check: HealthCheck) -> str | None:
    """The service's warm-up request (`check.warm_up`), made once before it is called healthy:
    None when it answered 2xx; else what went wrong (the warm-up is tried again at the next
    probe)."""
    if check.warm_up is None:
        return None
    path, body = check.warm_up
    answer = _ask(port, "POST", path, body, _WARM_UP_TIMEOUT)
    if isinstance(answer, str):
        return f"warm-up: {answer}"
    return None if 200 <= answer[0] < 300 else f"warm-up: HTTP {answer[0]}"


#: The largest metrics page read for an engine's load.
_MAX_METRICS_BYTES = 256 * 1024
#: llama-server's gauges of its load, by what the status calls them.
_LOAD_GAUGES = {
    "llamacpp:requests_processing": "processing",
    "llamacpp:requests_deferred": "waiting",
}


def engine_load(port: int, check: HealthCheck) -> dict[str, int] | None:
    """The requests the engine generates for (`processing`) and holds in its own queue
    (`waiting`), from its Prometheus metrics (`check.load`); None when it has none or they
    cannot be read."""
    if check.load is None:
        return None
    answer = _ask(port, "GET", check.load, None, check.timeout, read=True)
    if isinstance(answer, str) or answer[0] != 200:
        return None
    load: dict[str, int] = {}
    for line in answer[1].decode("utf-8", "replace").splitlines():
        name, _, value = line.partition(" ")
        if name in _LOAD_GAUGES:
            try:
                load[_LOAD_GAUGES[name]] = max(0, int(float(value)))
            except ValueError:
                return None
    return load if len(load) == len(_LOAD_GAUGES) else None


def _ask(
    port: int, method: str, path: str, body: str | None, timeout: float, *, read: bool = False
) -> tuple[int, bytes] | str:
    """One request to the service on this node: its status and (`read`) the first
    `_MAX_METRICS_BYTES` of its body, or what went wrong (the exception's kind and reason,
    never a body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {} if body is None else {"Content-Type": "application/json"}
    try:
        connection.request(method, path, body, headers)
        answer = connection.getresponse()
        return answer.status, answer.read(_MAX_METRICS_BYTES) if read else b""
    except (OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "strerror", None)
        return f"{type(exc).__name__}{f' ({reason})' if reason else ''}"
    finally:
        connection.close()


def service_environment(
    spec: ServiceSpec, port: int, grpc_port: int | None = None
) -> dict[str, str]:
    """The environment a start of `spec` gets (see the module)."""
    env = job_environment(dict(os.environ), {})
    env.update(spec.env)
    env.update(spec.secrets)  # after the filter: a secret named HF_TOKEN reaches it
    env["MODELFORGE_SERVICE_ID"] = spec.service_id
    env["MODELFORGE_SERVICE_PARAMS"] = json.dumps(spec.params)
    if spec.agent_socket is not None:
        env["MODELFORGE_AGENT_SOCKET"] = spec.agent_socket
    env["PORT"] = str(port)
    env["HOST"] = spec.host
    if grpc_port is not None:
        env["GRPC_PORT"] = str(grpc_port)
    env.update(spec.gpu_env)
    return env


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _exit_of(returncode: int) -> dict[str, Any]:
    """The supervisor exits as its service did: with its code, or killed by its signal."""
    if returncode < 0:
        return {"code": None, "signal": -returncode, "at": _now()}
    return {"code": returncode, "signal": None, "at": _now()}


class _StartFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class _Run:
    """One start of a service."""

    process: subprocess.Popen[bytes]
    port: int
    grpc_port: int | None
    workdir: Path
    reader: threading.Thread
    pid: int | None = None


class Service:
    """One service and the thread that keeps it running."""

    def __init__(self, spec: ServiceSpec, *, jobs_dir: Path, next_seq: Any) -> None:
        self._spec = spec
        self._jobs_dir = jobs_dir
        self._next_seq = next_seq
        self._redact = Redactor(spec.secrets)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending: ServiceSpec | None = None
        self._ending = False
        #: Failures (exits, unhealthy stops, failed starts) since it was last healthy for long.
        self._failures = 0
        self.state = "starting"
        self.port: int | None = None
        self.grpc_port: int | None = None
        self.pid: int | None = None
        #: The engine's own load at the last healthy probe (`engine_load`), None unknown.
        self.engine: dict[str, int] | None = None
        self.restarts = 0
        self.last_exit: dict[str, Any] | None = None
        self._events: deque[dict[str, Any]] = deque(maxlen=_EVENTS_KEPT)
        self._log: deque[str] = deque(maxlen=_LOG_LINES_KEPT)
        self._thread = threading.Thread(
            target=self._live, daemon=True, name=f"service-{spec.service_id}"
        )

    def __repr__(self) -> str:
        return f"<Service {self._spec.service_id} generation {self.generation} {self.state}>"

    @property
    def generation(self) -> int:
        """The generation it runs, or is about to run."""
        with self._lock:
            return (self._pending or self._spec).generation

    def start(self) -> None:
        self._event("state", {"state": "starting"})
        self._thread.start()

    def want(self, spec: ServiceSpec) -> bool:
        """Run `spec` from now on; False (nothing changes) when it is the generation already
        running or about to."""
        with self._lock:
            if spec.generation == (self._pending or self._spec).generation:
                return False
            self._pending = spec
        self._wake.set()
        return True

    def end(self) -> None:
        """Ask its thread to stop it; `join` waits."""
        with self._lock:
            self._ending = True
        self._wake.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "service_id": self._spec.service_id,
                "generation": (self._pending or self._spec).generation,
                "state": self.state,
                "port": self.port,
                "grpc_port": self.grpc_port,
                "pid": self.pid,
                "engine": dict(self.engine) if self.engine is not None else None,
                "restarts": self.restarts,
                "last_exit": dict(self.last_exit) if self.last_exit else None,
                "events": [dict(event) for event in self._events],
                "log_tail": list(self._log),
            }

    # -- the thread ---------------------------------------------------------------------------

    def _live(self) -> None:
        while True:
            spec = self._next_spec()
            if spec is None:
                return
            try:
                run = self._start(spec)
            except _StartFailed as exc:
                self._set_state("failed")
                self._event("error", {"code": exc.code, "message": exc.message})
                log.error("service %s could not start: %s", spec.service_id, exc.message)
                self._pause_then("start failed")
                continue
            except Exception:
                log.exception("service %s: unexpected error starting it", spec.service_id)
                self._set_state("failed")
                self._event("error", {"code": "SERVICE_START_FAILED", "message": "worker error"})
                self._pause_then("start failed")
                continue
            try:
                outcome = self._watch(run, spec)
            except Exception:
                log.exception("service %s: unexpected error watching it", spec.service_id)
                outcome = "error"
            finally:
                self._finish(run)
            if outcome in ("ending", "requested"):
                continue  # `_next_spec` ends the thread or takes the new generation
            self._pause_then(outcome)

    def _next_spec(self) -> ServiceSpec | None:
        """The spec to start next: None when the service ends; a new generation counts as a
        restart that was asked for."""
        with self._lock:
            if self._ending:
                return None
            pending, self._pending = self._pending, None
            if pending is not None:
                self._spec = pending
                self._redact = Redactor(pending.secrets)
                self._failures = 0
                self.restarts += 1
            spec = self._spec
        if pending is not None:
            self._event("restart", {"reason": "requested", "generation": spec.generation})
            log.info("service %s: generation %d requested", spec.service_id, spec.generation)
        return spec

    def _orders(self) -> str | None:
        with self._lock:
            if self._ending:
                return "ending"
            return "requested" if self._pending is not None else None

    def _pause_then(self, reason: str) -> None:
        """Wait out the backoff after a failure (state `restarting`, or `failed` after a start
        that failed), or less when ended or given a new generation."""
        with self._lock:
            self._failures += 1
            backoff = self._spec.restart.backoff(self._failures)
            if reason != "start failed":
                self.restarts += 1
        if reason != "start failed":
            self._set_state("restarting")
        self._event("restart", {"reason": reason, "backoff_seconds": backoff})
        deadline = time.monotonic() + backoff
        while self._orders() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wake.wait(left)
            self._wake.clear()

    def _start(self, spec: ServiceSpec) -> _Run:
        if spec.weights_path is not None and not os.path.exists(spec.weights_path):
            raise _StartFailed(
                "SERVICE_WEIGHTS_MISSING",
                f"weights_path {self._redact(spec.weights_path)} does not exist on this node",
            )
        port = free_port()
        wants_grpc = any("{grpc_port}" in arg for arg in spec.argv)
        grpc_port = free_port(besides=port) if wants_grpc else None
        env = service_environment(spec, port, grpc_port)
        executable = spec.argv[0]
        if executable == str(LLAMA_SERVER) and not _executable(executable, env):
            raise _StartFailed(
                "LLAMA_SERVER_MISSING",
                f"the llama.cpp runner's server is not installed at {executable}: build it "
                "with make install (scripts/build-llama-server), or run a worker image that has it",
            )
        if not _executable(executable, env):
            raise _StartFailed(
                "SERVICE_COMMAND_NOT_EXECUTABLE",
                f"{self._redact(executable)!r} is not an executable file on the service's PATH",
            )
        argv = [
            arg.replace("{port}", str(port))
            .replace("{grpc_port}", str(grpc_port))
            .replace("{host}", spec.host)
            for arg in spec.argv
        ]
        self._jobs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix=f"{spec.service_id}-", dir=self._jobs_dir))
        read_fd, write_fd = os.pipe()
        try:
            process = start_supervisor(workdir=workdir, env=env, inherited_fd=write_fd)
        except OSError as exc:
            os.close(read_fd)
            remove_tree(workdir)
            raise _StartFailed(
                "SERVICE_START_FAILED", f"cannot start its supervisor ({exc})"
            ) from None
        reader = threading.Thread(
            target=self._read_output, args=(process.stdout,), daemon=True, name="service-output"
        )
        reader.start()
        run = _Run(process=process, port=port, grpc_port=grpc_port, workdir=workdir, reader=reader)
        envelope = {
            "worker_pid": os.getpid(),
            "hide": [path for path in spec.private_paths if readable(path)],
            "argv": argv,
            "report_fd": write_fd,
        }
        hand_over(process, envelope)
        report = _read_report(read_fd)
        if not isinstance(report.get("pid"), int):
            self._finish(run)
            error = report.get("error")
            if not isinstance(error, dict):
                error = {}
            raise _StartFailed(
                str(error.get("code") or "SERVICE_START_FAILED"),
                self._redact(str(error.get("message") or "its supervisor started nothing")),
            )
        run.pid = int(report["pid"])
        with self._lock:
            self.port, self.grpc_port, self.pid = port, grpc_port, run.pid
        self._set_state("starting")
        log.info(
            "service %s generation %d started: pid %d, port %d",
            spec.service_id,
            spec.generation,
            run.pid,
            port,
        )
        return run

    def _watch(self, run: _Run, spec: ServiceSpec) -> str:
        """Probe and look after a started service until it exits, is unhealthy, or is ordered
        to stop; returns which (`exit`, `unhealthy`, `ending`, `requested`)."""
        check = spec.health
        started = time.monotonic()
        healthy_since: float | None = None
        ever_healthy = False
        failing = 0
        next_probe = started + min(check.interval, _FIRST_PROBES_EVERY)
        while True:
            returncode = run.process.poll()
            if returncode is not None:
                self._exited(spec, _exit_of(returncode))
                return "exit"
            orders = self._orders()
            if orders is not None:
                return orders
            now = time.monotonic()
            if now >= next_probe:
                problem = probe(run.port, check)
                warm_up_seconds = None
                if problem is None and not ever_healthy and check.warm_up is not None:
                    asked = time.monotonic()
                    problem = warm_up(run.port, check)
                    warm_up_seconds = round(time.monotonic() - asked, 3)
                now = time.monotonic()
                if run.process.poll() is not None:
                    continue  # it exited meanwhile: that is the news, not the probe
                if problem is None:
                    if failing:
                        self._event("health", {"healthy": True, "failed_before": failing})
                    failing = 0
                    if not ever_healthy:  # the cold start: process start to first healthy
                        ready: dict[str, Any] = {"cold_start_seconds": round(now - started, 2)}
                        if warm_up_seconds is not None:
                            ready["warm_up_seconds"] = warm_up_seconds
                        self._event("ready", ready)
                    ever_healthy = True
                    if check.load is not None:
                        load = engine_load(run.port, check)
                        with self._lock:
                            self.engine = load
                    if healthy_since is None:
                        healthy_since = now
                        self._set_state("healthy")
                    elif now - healthy_since >= spec.restart.maximum:
                        with self._lock:
                            self._failures = 0
                elif ever_healthy or now - started >= check.start_period:
                    healthy_since = None
                    failing += 1
                    if failing == 1:
                        self._event("health", {"healthy": False, "problem": problem})
                    if failing >= check.failure_threshold:
                        self._set_state("unhealthy")
                        self._event(
                            "health", {"healthy": False, "failures": failing, "problem": problem}
                        )
                        stop_job(run.process)
                        self._exited(spec, {"code": None, "signal": 15, "at": _now()})
                        return "unhealthy"
                interval = check.interval if ever_healthy else min(check.interval, 0.5)
                next_probe = now + interval
            self._wake.wait(max(0.0, min(_LOOK_EVERY, next_probe - now)))
            self._wake.clear()

    def _exited(self, spec: ServiceSpec, last_exit: dict[str, Any]) -> None:
        with self._lock:
            self.last_exit = last_exit
            self.pid = None
            self.engine = None
        self._event("exit", {"code": last_exit["code"], "signal": last_exit["signal"]})
        log.warning(
            "service %s exited (code %s, signal %s)",
            spec.service_id,
            last_exit["code"],
            last_exit["signal"],
        )

    def _finish(self, run: _Run) -> None:
        """The start is over: its supervisor (and so all it started) is gone, its output read,
        its work directory removed."""
        if run.process.poll() is None:
            stop_job(run.process)
        run.reader.join(timeout=2.0)
        remove_tree(run.workdir)  # the supervisor's job; this is a backstop
        with self._lock:
            self.pid = None

    def _read_output(self, stream: IO[bytes] | None) -> None:
        if stream is None:
            return
        for raw in iter(lambda: stream.readline(_LINE_LIMIT), b""):
            line = clean_line(raw.decode(errors="replace").rstrip("\n"))
            with self._lock:
                self._log.append(self._redact(line))
        stream.close()

    def _set_state(self, state: str) -> None:
        with self._lock:
            if self.state == state:
                return
            self.state = state
            service_id = self._spec.service_id
        self._event("state", {"state": state})
        log.info("service %s: %s", service_id, state)

    def _event(self, kind: str, data: dict[str, Any]) -> None:
        with self._lock:
            event = {"seq": 0, "at": _now(), "kind": kind, "data": self._redact.tree(data)}
            event["seq"] = self._next_seq()
            self._events.append(event)


def _executable(executable: str, env: dict[str, str]) -> bool:
    """Whether exec can run `executable`: an absolute path to an executable file, or a name
    found on the service's PATH; a relative path is left to the exec to judge."""
    if os.path.isabs(executable):
        return os.path.isfile(executable) and os.access(executable, os.X_OK)
    if "/" in executable:
        return True
    return shutil.which(executable, path=env.get("PATH", os.defpath)) is not None


def _read_report(fd: int) -> dict[str, Any]:
    """The supervisor's one report line; `{}` when it said nothing in time."""
    try:
        ready, _, _ = select.select([fd], [], [], _REPORT_TIMEOUT)
        raw = os.read(fd, 65536) if ready else b""
    finally:
        os.close(fd)
    try:
        report = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return report if isinstance(report, dict) else {}


class Services:
    """Every service of this worker, by id."""

    def __init__(self, jobs_dir: Path) -> None:
        self.jobs_dir = jobs_dir
        #: Names this worker process: an agent seeing another knows event numbers started over.
        self.instance = secrets.token_hex(8)
        self._services: dict[str, Service] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()
        self._closed = False

    def _next_seq(self) -> int:
        with self._seq_lock:
            return next(self._seq)

    def put(self, service_id: str, body: Any) -> tuple[bool, dict[str, Any]]:
        """Run the service as `body` says: (started, answer); `InvalidService` when malformed,
        `WorkerStopping` once `stop_all` began."""
        spec = ServiceSpec.from_json(body, service_id=service_id)
        with self._lock:
            if self._closed:
                raise WorkerStopping
            service = self._services.get(service_id)
            created = service is None
            if service is None:
                service = Service(spec, jobs_dir=self.jobs_dir, next_seq=self._next_seq)
                self._services[service_id] = service
                service.start()
            else:
                service.want(spec)
        status = service.status()
        return created, {
            "service_id": service_id,
            "generation": status["generation"],
            "state": status["state"],
        }

    def delete(self, service_id: str) -> bool:
        """Stop the service and everything it started, and wait; False when unknown."""
        with self._lock:
            service = self._services.pop(service_id, None)
        if service is None:
            return False
        service.end()
        service.join()
        log.info("service %s stopped", service_id)
        return True

    def statuses(self) -> dict[str, Any]:
        with self._lock:
            services = list(self._services.values())
        return {"instance": self.instance, "services": [s.status() for s in services]}

    def stop_all(self) -> None:
        """The worker stops: every service is asked at once, then awaited."""
        with self._lock:
            self._closed = True
            services = list(self._services.values())
            self._services.clear()
        for service in services:
            service.end()
        for service in services:
            service.join()
