"""Running work (WL-2..WL-4): `--parallel` slots each hold a long-poll claim; a claimed job is
handed to the local runtime worker, whose stream of records is relayed to the control plane in
order. A watch long-poll learns of cancellations at once; cancelling — or this agent dying —
closes the stream to the worker, which kills the job's process group.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from modelforge_ipc import UnixHTTPConnection
from node_agent import client as api

log = logging.getLogger("modelforge.node_agent.work")
#: Long-poll hold: short enough that a control plane stopping gracefully (it finishes in-flight
#: requests first) is not held up for long; a wake-up ends the hold early anyway.
_HOLD = 8.0
_BATCH = 200
_REPORT_EVERY = 0.5


@dataclass
class _Running:
    job_id: str
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: The stream's socket, kept here: http.client hands it to the response and forgets it.
    sock: socket.socket | None = None

    def cancel(self) -> None:
        """Close the stream: the worker notices and kills the job's process group."""
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class WorkRunner:
    def __init__(
        self,
        *,
        http: httpx.Client,
        credential: str,
        worker_socket: Path,
        agent_socket: Path,
        parallel: int,
        stop: threading.Event,
        publish: Callable[[str, str, Callable[[], Any]], Any],
    ) -> None:
        self.http = http
        self.credential = credential
        self.worker_socket = worker_socket
        self.agent_socket = agent_socket
        self.parallel = parallel
        self.stop = stop
        self.publish = publish
        self._active: dict[str, _Running] = {}
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self.threads: list[threading.Thread] = []
        self.failure: BaseException | None = None

    @property
    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.credential}"}

    def start(self) -> None:
        targets = [self._slot] * self.parallel + [self._watch]
        for index, target in enumerate(targets):
            thread = threading.Thread(
                target=self._guard, args=(target,), daemon=True, name=f"work-{index}"
            )
            thread.start()
            self.threads.append(thread)

    def _guard(self, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # e.g. AgentStopped: the whole agent stops
            self.failure = self.failure or exc
            self.stop.set()

    # -- claiming ---------------------------------------------------------------------------

    def _slot(self) -> None:
        while not self.stop.is_set():
            assignment = self.publish("POST", "/api/v1/agent/work/claim", self._claim)
            if assignment:
                self._run(assignment)

    def _claim(self) -> dict[str, Any] | None:
        response = self.http.post(
            "/api/v1/agent/work/claim",
            json={"hold_seconds": _HOLD},
            headers=self._auth,
            timeout=httpx.Timeout(_HOLD + 15, connect=10.0),
        )
        if response.status_code == 204:
            return None
        if response.status_code >= 400:
            raise api.error_from(response, "POST", "/api/v1/agent/work/claim")
        data: dict[str, Any] = response.json()
        return data

    # -- cancellations ----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self.stop.is_set():
            with self._lock:
                job_ids = list(self._active)
            if not job_ids:
                self._changed.wait(1.0)
                self._changed.clear()
                continue
            answer = self.publish(
                "POST", "/api/v1/agent/jobs/watch", partial(self._watch_once, job_ids)
            )
            for job_id in (answer or {}).get("cancel", []):
                with self._lock:
                    running = self._active.get(job_id)
                if running is not None and not running.cancelled.is_set():
                    log.info("job %s was cancelled (or is no longer ours): stopping it", job_id)
                    running.cancel()

    def _watch_once(self, job_ids: list[str]) -> dict[str, Any]:
        response = self.http.post(
            "/api/v1/agent/jobs/watch",
            json={"job_ids": job_ids, "hold_seconds": 5.0},
            headers=self._auth,
            timeout=httpx.Timeout(20.0, connect=10.0),
        )
        if response.status_code >= 400:
            raise api.error_from(response, "POST", "/api/v1/agent/jobs/watch")
        data: dict[str, Any] = response.json()
        return data

    # -- running ----------------------------------------------------------------------------

    def _run(self, assignment: dict[str, Any]) -> None:
        job_id = str(assignment["job_id"])
        log.info("running job %s", job_id)
        connection = UnixHTTPConnection(self.worker_socket)
        running = _Running(job_id)
        with self._lock:
            self._active[job_id] = running
        self._changed.set()
        final: dict[str, Any] | None = None
        pending: list[dict[str, Any]] = []
        last_report = time.monotonic()
        progress_every = float(assignment.get("progress_interval_seconds", 10.0))
        try:
            spec = dict(assignment, agent_socket=str(self.agent_socket))
            connection.request(
                "POST",
                "/v1/jobs",
                body=json.dumps(spec),
                headers={"Content-Type": "application/json"},
            )
            running.sock = connection.sock
            response = connection.getresponse()
            if response.status != 200:
                final = _failed("JOB_WORKER_REFUSED", f"runtime worker answered {response.status}")
            while final is None:
                line = response.readline()
                if not line:
                    break
                record = json.loads(line)
                kind = record.get("kind")
                if kind == "exit":
                    final = record
                    break
                if kind in ("event", "log"):
                    pending.append({"kind": kind, "data": record.get("data")})
                elif kind == "output":
                    pending.append(
                        {
                            "kind": "event",
                            "data": {"output": record.get("name"), "digest": record.get("digest")},
                        }
                    )
                now = time.monotonic()
                due = now - last_report >= (_REPORT_EVERY if pending else progress_every)
                if due or len(pending) >= _BATCH:
                    if self._report(job_id, pending):
                        running.cancel()
                    pending, last_report = [], now
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if not running.cancelled.is_set():
                final = _failed(
                    "JOB_WORKER_LOST",
                    f"lost the runtime worker while running ({type(exc).__name__})",
                )
        finally:
            connection.close()
            with self._lock:
                self._active.pop(job_id, None)
        if pending:
            self._report(job_id, pending)
        if final is None:
            final = (
                _failed("JOB_KILLED", "stopped on cancellation")
                if running.cancelled.is_set()
                else _failed("JOB_WORKER_LOST", "the runtime worker ended the job without a result")
            )
        self._complete(job_id, final)

    def _report(self, job_id: str, events: list[dict[str, Any]]) -> bool:
        path = f"/api/v1/agent/jobs/{job_id}/events"

        def call() -> dict[str, Any]:
            response = self.http.post(path, json={"events": events}, headers=self._auth)
            if response.status_code in (404, 409):
                return {"cancel": True}  # not ours or not running any more: stop it
            if response.status_code >= 400:
                raise api.error_from(response, "POST", path)
            data: dict[str, Any] = response.json()
            return data

        answer = self.publish("POST", path, call)
        return bool((answer or {}).get("cancel"))

    def _complete(self, job_id: str, final: dict[str, Any]) -> None:
        path = f"/api/v1/agent/jobs/{job_id}/complete"
        body: dict[str, Any] = {"state": final.get("state", "failed")}
        if body["state"] == "succeeded":
            body["result"] = final.get("result")
            body["outputs"] = final.get("outputs") or {}
        else:
            body["error"] = final.get("error") or {"code": "JOB_FAILED", "message": ""}

        def call() -> None:
            response = self.http.post(path, json=body, headers=self._auth)
            if response.status_code in (404, 409):
                return  # already ended by the control plane (cancelled, contact lost)
            if response.status_code >= 400:
                raise api.error_from(response, "POST", path)

        self.publish("POST", path, call)
        log.info("job %s ended: %s", job_id, body["state"])


def _failed(code: str, message: str) -> dict[str, Any]:
    return {"kind": "exit", "state": "failed", "error": {"code": code, "message": message}}
