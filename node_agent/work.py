"""Running work: `--parallel` slots each hold a long-poll claim; a claimed job is handed to the
local runtime worker, whose stream of records is relayed to the control plane in order, through
a bounded spool that keeps them while the control plane is away (node_agent._report_spool). A watch
long-poll learns of cancellations at once; cancelling — or this agent dying — closes the stream
to the worker, which ends the job and everything it started. The assignment goes to the worker
as the control plane sent it, with the GPUs the job holds (`assigned_gpus`), which the worker
makes the only ones the job sees. With each job the agent names its private files
(`private_paths`), which the worker hides from the job, and the node's Python (`python`, when
the operator set one: node_agent.job_python), which the worker runs a Python job under.

While the control plane refuses the runtime worker's protocol the slots claim nothing (the
agent clears `worker_compatible`); they resume when it is set again. Nor do they claim while the
worker is lost (`WorkerWatch`): a job claimed then could only fail. A job whose stream from the
worker breaks fails `JOB_WORKER_LOST` and has the watch ask the worker at once: a worker that
does not answer is reported lost at once, one that answers is not (one stream broke).

A record that is not strict JSON fails its job (`JOB_RESULT_NOT_JSON`) instead of reaching the
control plane. A work thread never ends on an unexpected error: it logs it with the job id and
keeps serving. Only a terminal outcome (`AgentStopped`) or the agent stopping ends it.

An agent stopping (SIGTERM, SIGINT, its idle exit) ends its jobs itself (`stop_jobs`): it closes
each stream, so the worker kills the job's process group, and reports each job failed
`JOB_AGENT_STOPPED` before it exits — one attempt each, within a few seconds — rather than
leaving the control plane to fail it `JOB_CONTACT_LOST` a minute and a half later.

A node cut off from the control plane (issue 42): a job whose assignment carries
`stop_after_disconnect_seconds` is killed by the agent once no call has reached the control
plane for that long (`_guard`, on a thread of its own, as every other thread may be waiting on
the control plane), and reported failed `JOB_NODE_CUT_OFF` when contact returns; a job without
it runs on. After any loss of contact the agent reconciles before it starts new work
(`_reconcile`, on the watch thread): it asks which of its running jobs are still its own, ends
those that are not (the control plane may have failed them `JOB_CONTACT_LOST` meanwhile and
handed their GPUs to others), and waits for them to be gone; until then no slot claims, and a
job claimed as contact returned waits. So a GPU never has two holders.
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
from pathlib import Path
from typing import Any

from modelforge_contracts import job_records as records
from modelforge_contracts.ipc import UnixHTTPConnection
from node_agent._report_spool import ReportSpool
from node_agent.client import ControlPlane
from node_agent.idle import Activity
from node_agent.retry import AgentStopped, ControlPlaneError, Interrupted
from node_agent.worker_link import WorkerWatch

log = logging.getLogger("modelforge.node_agent.work")
#: Long-poll hold: short enough that a control plane stopping gracefully (it finishes in-flight
#: requests first) is not held up for long; a wake-up ends the hold early anyway.
_HOLD = 8.0
_WATCH_HOLD = 5.0
#: After an unexpected error outside a job, a slot waits this long before claiming again.
_PAUSE_AFTER_ERROR = 1.0
#: How often the guard compares the time without the control plane with the jobs' limits.
_GUARD_EVERY = 0.25
#: After a reconnection, how long between two log lines while jobs that are no longer this
#: node's are still ending (no new work starts meanwhile).
_RECONCILE_LOG_EVERY = 30.0


@dataclass
class _Running:
    job_id: str
    #: Killed after this long without the control plane (the job's field; None: never).
    stop_after: float | None = None
    #: Set when the guard killed it for that.
    cut_off: bool = False
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


def outcome_body(final: records.ExitRecord) -> dict[str, Any]:
    """The `complete` request for an exit record: the record without its `kind`."""
    body = records.to_json(final)
    del body["kind"]
    return body


def report_event(record: records.Record) -> dict[str, Any] | None:
    """The event the control plane records for a stream record, if it records one."""
    if isinstance(record, records.EventRecord | records.LogRecord):
        return records.to_json(record)
    if isinstance(record, records.OutputRecord):
        return records.to_json(
            records.EventRecord({"output": record.name, "digest": record.digest})
        )
    return None


class WorkRunner:
    def __init__(
        self,
        *,
        control_plane: ControlPlane,
        worker_socket: Path,
        agent_socket: Path,
        parallel: int,
        stop: threading.Event,
        worker_compatible: threading.Event | None = None,
        private_paths: list[str] | None = None,
        worker: WorkerWatch | None = None,
        activity: Activity | None = None,
        job_python: Path | None = None,
    ) -> None:
        self.control_plane = control_plane
        #: The node's Python (node_agent.job_python), named in each job; None: the worker's own.
        self.job_python = job_python
        #: Whether the worker is there (the agent's watch); None: always assumed.
        self.worker = worker
        #: Told of each job in hand, for the idle exit.
        self.activity = activity or Activity()
        self.worker_socket = worker_socket
        self.agent_socket = agent_socket
        self.parallel = parallel
        self.stop = stop
        #: The agent's files no job may read: the worker hides them from each job.
        self.private_paths = list(private_paths or [])
        self.worker_compatible = worker_compatible or threading.Event()
        if worker_compatible is None:
            self.worker_compatible.set()
        self._active: dict[str, _Running] = {}
        self._lock = threading.Lock()
        #: Set by `stop_jobs`: a job ended by a closed stream was ended by the agent stopping.
        self._stopping = False
        #: Jobs ended whose outcome is being reported; notified as each is done (or given up).
        self._reporting: set[str] = set()
        self._ended = threading.Condition(self._lock)
        self._changed = threading.Event()
        #: The count of contact losses (`RetryRule.losses`) the last reconciliation covered.
        self._reconciled = 0
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        targets: list[Callable[[], None]] = [self._slot] * self.parallel + [
            self._watch,
            self._guard,
        ]
        for index, target in enumerate(targets):
            thread = threading.Thread(target=target, daemon=True, name=f"work-{index}")
            thread.start()
            self.threads.append(thread)

    # -- claiming ---------------------------------------------------------------------------

    def _slot(self) -> None:
        while not self.stop.is_set():
            if not self.worker_compatible.is_set() or (self.worker and self.worker.lost):
                # No claim for a worker the control plane refused, or that is not there.
                self.stop.wait(_PAUSE_AFTER_ERROR)
                continue
            try:
                if not self._await_reconciled():
                    return
                assignment = self.control_plane.claim(_HOLD)
                if assignment:
                    self.activity.job_claimed()
                    try:
                        # Claimed as contact returned: it starts once the jobs the node lost
                        # are gone.
                        if not self._await_reconciled():
                            return
                        self._serve(assignment)
                    finally:
                        self.activity.job_ended()
            except (AgentStopped, Interrupted):
                return  # the agent stops; the retry rule recorded why
            except ControlPlaneError as exc:
                log.error("%s; no job claimed, next claim in %.0f s", exc, _PAUSE_AFTER_ERROR)
                self.stop.wait(_PAUSE_AFTER_ERROR)
            except Exception:
                if self.stop.is_set():
                    return  # shutting down: the client may already be closed
                log.exception("unexpected error while claiming work; this slot keeps serving")
                self.stop.wait(_PAUSE_AFTER_ERROR)

    def _serve(self, assignment: dict[str, Any]) -> None:
        """Run one job; an unexpected error fails it, logged once, and the slot goes on."""
        job_id = str(assignment.get("job_id"))
        try:
            self._run(job_id, assignment)
        except (AgentStopped, Interrupted):
            raise
        except Exception as exc:
            log.exception("job %s: unexpected error in the node agent; the job is failed", job_id)
            final = records.failed(
                "JOB_AGENT_ERROR", f"the node agent failed running it ({type(exc).__name__})"
            )
            self.control_plane.complete(job_id, outcome_body(final))

    # -- cancellations ----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self.stop.is_set():
            try:
                self._reconcile()
                self._watch_once()
            except (AgentStopped, Interrupted):
                return
            except Exception:
                if self.stop.is_set():
                    return
                log.exception("unexpected error while watching for cancellations; watching on")
                self.stop.wait(_PAUSE_AFTER_ERROR)

    def _watch_once(self) -> None:
        with self._lock:
            job_ids = list(self._active)
        if not job_ids:
            self._changed.wait(1.0)
            self._changed.clear()
            return
        for job_id in self.control_plane.watch(job_ids, _WATCH_HOLD):
            with self._lock:
                running = self._active.get(job_id)
            if running is not None and not running.cancelled.is_set():
                log.info("job %s was cancelled (or is no longer ours): stopping it", job_id)
                running.cancel()

    # -- a node cut off ---------------------------------------------------------------------

    def _guard(self) -> None:
        """Kill each job that asked for it once the control plane has been out of reach for
        its `stop_after_disconnect_seconds`."""
        while not self.stop.wait(_GUARD_EVERY):
            cut_off_for = self.control_plane.retry.cut_off_for()
            if cut_off_for <= 0:
                continue
            with self._lock:
                running = list(self._active.values())
            for job in running:
                limit = job.stop_after
                if limit is None or cut_off_for < limit or job.cancelled.is_set():
                    continue
                log.warning(
                    "job %s: the control plane has been out of reach for %.0f s (its "
                    "stop_after_disconnect_seconds: %g); killing it",
                    job.job_id,
                    cut_off_for,
                    limit,
                )
                job.cut_off = True
                job.cancel()

    def _reconcile(self) -> None:
        """After a loss of contact: end the running jobs the control plane no longer counts as
        this node's and wait until they are gone, before any slot starts new work."""
        losses = self.control_plane.retry.losses
        if losses == self._reconciled:
            return
        with self._lock:
            job_ids = list(self._active)
        # Answered once the control plane is reachable again (the call waits until then).
        stop = set(self.control_plane.watch(job_ids, 0)) if job_ids else set()
        for job_id in sorted(stop):
            with self._lock:
                running = self._active.get(job_id)
            if running is not None and not running.cancelled.is_set():
                log.info("job %s is no longer this node's (failed while out of contact)", job_id)
                running.cancel()
        with self._ended:
            while stop & set(self._active) and not self.stop.is_set():
                if not self._ended.wait(_RECONCILE_LOG_EVERY):
                    log.warning(
                        "waiting for %s to end before this node starts new work",
                        ", ".join(sorted(stop & set(self._active))),
                    )
            self._reconciled = losses
            self._ended.notify_all()
        if stop:
            log.info("reconciled after a loss of contact: %d job(s) ended", len(stop))

    def _await_reconciled(self) -> bool:
        """Wait until every loss of contact so far is reconciled; False: the agent stops."""
        with self._ended:
            while self._reconciled != self.control_plane.retry.losses:
                if self.stop.is_set():
                    return False
                self._ended.wait(_GUARD_EVERY)
        return not self.stop.is_set()

    # -- stopping ---------------------------------------------------------------------------

    def stop_jobs(self, timeout: float) -> list[str]:
        """The agent stops: end every running job (its stream closed, so the worker kills its
        process group) and wait, at most `timeout` seconds, for each to be reported failed
        `JOB_AGENT_STOPPED`. Returns the jobs still unreported when the time ran out."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._stopping = True
            running = list(self._active.values())
        for job in running:
            log.info("job %s: the agent is stopping; ending it", job.job_id)
            job.cancel()
        with self._ended:
            while (self._active or self._reporting) and (left := deadline - time.monotonic()) > 0:
                self._ended.wait(left)
            return sorted({*self._active, *self._reporting})

    # -- running ----------------------------------------------------------------------------

    def _run(self, job_id: str, assignment: dict[str, Any]) -> None:
        log.info("running job %s", job_id)
        progress_every = float(assignment.get("progress_interval_seconds", 10.0))
        spec = json.dumps(
            dict(
                assignment,
                agent_socket=str(self.agent_socket),
                private_paths=self.private_paths,
                **({"python": str(self.job_python)} if self.job_python is not None else {}),
            )
        )
        connection = UnixHTTPConnection(self.worker_socket)
        stop_after = assignment.get("stop_after_disconnect_seconds")
        running = _Running(job_id, float(stop_after) if stop_after is not None else None)
        with self._lock:
            self._active[job_id] = running
        self._changed.set()
        final: records.ExitRecord | None = None
        # The reports go on their own thread: reading the stream never waits for the control
        # plane, also while it is away (node_agent._report_spool).
        spool = ReportSpool(
            control_plane=self.control_plane,
            job_id=job_id,
            progress_every=progress_every,
            on_cancel=running.cancel,
        ).start()
        try:
            connection.request(
                "POST", "/v1/jobs", body=spec, headers={"Content-Type": "application/json"}
            )
            running.sock = connection.sock
            response = connection.getresponse()
            if response.status != 200:
                final = records.failed(
                    "JOB_WORKER_REFUSED", f"runtime worker answered {response.status}"
                )
            while final is None:
                line = response.readline()
                if not line:
                    break
                try:
                    record = records.decode(line)
                except records.RecordNotJson as exc:
                    running.cancel()  # the worker kills the job
                    final = records.failed(
                        records.RESULT_NOT_JSON, f"the job produced a value that is not JSON: {exc}"
                    )
                    break
                if isinstance(record, records.ExitRecord):
                    final = record
                    break
                event = report_event(record)
                if event is not None:
                    spool.add(event, len(line))
        except (OSError, http.client.HTTPException, records.RecordError) as exc:
            if not running.cancelled.is_set():
                final = records.failed(
                    "JOB_WORKER_LOST",
                    f"lost the runtime worker while running ({type(exc).__name__})",
                )
                if self.worker is not None and isinstance(exc, OSError):
                    # One stream may break alone: the worker is lost only if it does not answer
                    # either (then the watch tells everyone at once, in one log line).
                    self.worker.watch_once()
        finally:
            connection.close()
            with self._lock:
                self._active.pop(job_id, None)
                self._reporting.add(job_id)
        try:
            spool.close()  # every event is reported before the outcome
            if final is None:
                final = self._ended_without_result(running)
            self.control_plane.complete(job_id, outcome_body(final))
            log.info("job %s ended: %s", job_id, final.state)
        finally:
            with self._ended:
                self._reporting.discard(job_id)
                self._ended.notify_all()

    def _ended_without_result(self, running: _Running) -> records.ExitRecord:
        if running.cut_off:
            return records.failed(
                "JOB_NODE_CUT_OFF",
                f"the node could not reach the control plane for {running.stop_after:g} s (the "
                "job's stop_after_disconnect_seconds): its agent killed the job",
            )
        if running.cancelled.is_set() and self._stopping:
            return records.failed(
                "JOB_AGENT_STOPPED",
                "the node agent stopped (SIGTERM, SIGINT or its idle exit) while it ran: the "
                "job was killed",
            )
        if running.cancelled.is_set():
            return records.failed("JOB_KILLED", "stopped on cancellation")
        return records.failed(
            "JOB_WORKER_LOST", "the runtime worker ended the job without a result"
        )
