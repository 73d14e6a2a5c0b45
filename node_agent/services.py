"""Services on this node (WL-5a), kept in line with what the control plane wants.

Every poll interval (the control plane's answer sets it; 2 s until it does) the `ServiceKeeper`
asks the runtime worker what it runs (`GET /v1/services`), reports that to the control plane
(`POST /api/v1/agent/services/sync`: each service's state, ports, restarts, last exit, the events
not reported before and the tail of its output; for one the last answer said was draining, its
requests in flight through the tunnel, `in_flight`, so its drain can end once none is left)
and gets back the services this node must run.
Each is run and reported by the id the control plane sends, its `replica_id` (a service's
replicas are apart, and may share a node), or the service's id from a control plane older than
replicas. Then it reconciles: a wanted service the worker does not run, or runs at another
generation, has its weights fetched through the node's artifact cache and is handed to the
worker (`PUT /v1/services/{id}`, with the agent's socket and private paths as for a job); a
service the worker runs that is not wanted is stopped (`DELETE`). Weights that cannot be fetched
make the service `failed`, reported once with a `WEIGHTS_UNAVAILABLE` error event, and are tried
again at the next poll. Each is told where to listen (`host`): `127.0.0.1`, where the agent's
tunnel reaches it, unless the node turned direct access on by naming its `service_host`
(`MODELFORGE_AGENT_SERVICE_HOST`): then every interface, `0.0.0.0`, for clients that dial a
replica's URL.

It runs only while the control plane accepts the runtime worker (`worker_compatible`). A failed
sync is logged once per streak and tried again; nothing is reconciled without both answers. A
worker that does not answer is the agent's `WorkerWatch` to judge and log (once per loss); while
it is lost every service this node should run is reported `failed` with one
`RUNTIME_WORKER_LOST` event (node_agent._worker_loss), within a poll interval or at once when the
watch wakes the keeper, and when a worker answers again they are handed to it as any service it
lacks. Stopping the agent leaves the services running (the worker's
own shutdown stops them); a keeper that starts again finds them and reconciles.

It never logs a secret or a sync body, and never puts a secret in the agent's environment: the
values go from the control plane's answer straight into the worker's request.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from modelforge_contracts.ipc import UnixHTTPConnection
from node_agent._worker_loss import ServicesDown
from node_agent.artifact_cache import ArtifactError
from node_agent.client import ControlPlane
from node_agent.idle import Activity
from node_agent.retry import AgentStopped, ControlPlaneError, Interrupted
from node_agent.worker_link import WorkerWatch, wait_or_wake

log = logging.getLogger("modelforge.node_agent.services")

DEFAULT_POLL_INTERVAL = 2.0
_MIN_POLL_INTERVAL = 0.2
_MAX_POLL_INTERVAL = 300.0
#: What the worker accepts as a service id; nothing else becomes part of a worker path.
_SERVICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
#: A DELETE waits while the worker stops the service and everything it started.
_WORKER_TIMEOUT = 60.0
#: Where a service listens: this node only, or (direct access) every interface.
LOOPBACK_HOST = "127.0.0.1"
EVERY_INTERFACE = "0.0.0.0"  # noqa: S104 - only when the node turned direct access on
#: What a report carries of a service's status, as the worker gives it.
_REPORTED = ("service_id", "generation", "state", "port", "restarts", "last_exit", "log_tail")


class WorkerUnavailable(Exception):
    """The runtime worker did not answer as it should; the message says how (`busy`: it may
    only be slow)."""

    def __init__(self, message: str, *, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


class _Streak:
    """A trouble logged once when it starts (or changes), and once when it is over."""

    def __init__(self, over: str) -> None:
        self._over = over
        self._current: str | None = None

    def trouble(self, message: str) -> None:
        if message != self._current:
            log.error("%s", message)
            self._current = message

    def fine(self) -> None:
        if self._current is not None:
            log.info("%s", self._over)
            self._current = None


class ServiceKeeper:
    def __init__(
        self,
        *,
        control_plane: ControlPlane | None,
        worker_socket: Path,
        agent_socket: Path,
        fetch_weights: Callable[[str], Path],
        stop: threading.Event,
        worker_compatible: threading.Event | None = None,
        private_paths: list[str] | None = None,
        service_host: str | None = None,
        worker: WorkerWatch | None = None,
        activity: Activity | None = None,
    ) -> None:
        self.control_plane = control_plane
        #: Told how many services this node has, for the idle exit.
        self.activity = activity or Activity()
        #: The services the worker ran, and those the control plane wanted here, when last told.
        self._ran: set[str] = set()
        self._wanted: set[str] = set()
        #: Those the control plane said drain (out of the gateway's rotation), and how many
        #: requests are in flight to a replica through the tunnel (set by the agent: the
        #: tunnel's count): reported for the draining ones, whose drain ends when none is left.
        self._draining: set[str] = set()
        #: Those whose engine's own load is reported (`engine`: the spec said `engine_load`).
        self._engine_load: set[str] = set()
        self.in_flight: Callable[[str], int] | None = None
        self.worker_socket = worker_socket
        self.agent_socket = agent_socket
        #: The local path of an artifact digest (the agent: its cache, filled from the control
        #: plane); raises when it cannot be had.
        self.fetch_weights = fetch_weights
        self.stop = stop
        self.worker_compatible = worker_compatible or threading.Event()
        if worker_compatible is None:
            self.worker_compatible.set()
        self.private_paths = list(private_paths or [])
        self.service_host = service_host
        #: Direct access (a `service_host` named): replicas listen on every interface.
        self.listen_host = EVERY_INTERFACE if service_host else LOOPBACK_HOST
        self.interval = DEFAULT_POLL_INTERVAL
        #: The worker process the event numbers below belong to (they start over with it).
        self._instance: str | None = None
        #: Service id -> the highest event number reported.
        self._reported: dict[str, int] = {}
        #: Service id -> what keeps the generation it must run from the worker:
        #: `{"generation", "code", "message", "reported"}`.
        self._problems: dict[str, dict[str, Any]] = {}
        self._sync_streak = _Streak("services sync with the control plane works again")
        #: Whether the worker is there (the agent's one watch; a keeper alone has its own).
        self.worker = worker or WorkerWatch(worker_socket)
        self._worker_changed = self.worker.wake_on_change()
        self._services_down = ServicesDown(worker_socket)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._loop, daemon=True, name="services")
        thread.start()
        return thread

    def _loop(self) -> None:
        while not self.stop.is_set():
            if not self.worker_compatible.is_set():
                self.stop.wait(1.0)  # no services for a worker the control plane refused
                continue
            try:
                self.sync_once()
            except (AgentStopped, Interrupted):
                return  # the agent stops; the retry rule recorded why
            except Exception:
                if self.stop.is_set():
                    return  # shutting down: the client may already be closed
                log.exception("unexpected error keeping the node's services; keeping on")
            if wait_or_wake(self.stop, self.interval, self._worker_changed):
                return

    # -- one round ------------------------------------------------------------------------------

    def sync_once(self) -> None:
        """Report to the control plane, learn what to run, reconcile the worker with it."""
        if self.control_plane is None:
            raise RuntimeError("a ServiceKeeper without a control plane cannot sync")
        try:
            view: dict[str, Any] | None = self.worker_view()
            self.worker.answered()
        except WorkerUnavailable as exc:
            view = None
            self.worker.unanswered(str(exc), busy=exc.busy)
        if view is not None:
            self._ran = _service_ids(view.get("services"))
            self.activity.services(len(self._ran | self._wanted))
        body, delivered = self.report(view)
        try:
            answer = self.control_plane.sync_services(body)
        except ControlPlaneError as exc:
            self._sync_streak.trouble(
                f"{exc}; the node's services are not synced, tried again every {self.interval:g} s"
            )
            return
        delivered()
        self._sync_streak.fine()
        self.interval = _interval(answer.get("poll_interval_seconds"))
        desired = answer.get("services")
        if not isinstance(desired, list):
            return
        desired = [_keyed(spec) for spec in desired]
        self._wanted = _service_ids(desired)
        self._draining = _service_ids([spec for spec in desired if _draining(spec)])
        self._engine_load = _service_ids([s for s in desired if _flag(s, "engine_load")])
        self.activity.services(len(self._ran | self._wanted))
        self._services_down.want(desired)
        if view is not None:
            self.reconcile(desired, view)

    def worker_view(self) -> dict[str, Any]:
        """The worker's `GET /v1/services` answer; `WorkerUnavailable` when it gives none."""
        status, answer = self._worker("GET", "/v1/services")
        if status != 200 or not isinstance(answer.get("services"), list):
            raise WorkerUnavailable(f"GET /v1/services answered {status}", busy=True)
        return answer

    def report(self, view: dict[str, Any] | None) -> tuple[dict[str, Any], Callable[[], None]]:
        """The sync body for what the worker runs (`view`) and the problems met, with the
        events not reported yet; and what to call once the control plane took it."""
        instance = None if view is None else view.get("instance")
        reported = self._reported if instance == self._instance else {}
        if view is not None:
            self._services_down.worker_answers(instance)
        marks: dict[str, int] = {}
        entries: dict[str, dict[str, Any]] = {}
        for status in (view or {}).get("services", []):
            if not isinstance(status, dict) or not isinstance(status.get("service_id"), str):
                continue
            service_id = status["service_id"]
            last = reported.get(service_id, 0)
            fresh = [
                event
                for event in status.get("events") or []
                if isinstance(event, dict) and isinstance(event.get("seq"), int)
                if event["seq"] > last
            ]
            marks[service_id] = max([last, *(event["seq"] for event in fresh)])
            entry = {key: status.get(key) for key in _REPORTED}
            entry["restarts"] = entry["restarts"] or 0
            entry["log_tail"] = entry["log_tail"] or []
            # Only when there is one: a control plane older than gRPC ports refuses the field.
            if isinstance(grpc_port := status.get("grpc_port"), int):
                entry["grpc_port"] = grpc_port
            entry["events"] = [
                {"at": event.get("at"), "kind": event.get("kind"), "data": event.get("data")}
                for event in fresh
            ]
            if self.in_flight is not None and service_id in self._draining:
                entry["in_flight"] = self.in_flight(service_id)
            if service_id in self._engine_load:
                entry["engine"] = _engine(status.get("engine"))
            entries[service_id] = self._services_down.counted(service_id, entry)
        down = self._services_down.entries() if view is None and self.worker.lost else {}
        entries.update(down)
        problems = [(service_id, dict(problem)) for service_id, problem in self._problems.items()]
        for service_id, problem in problems:
            entry = entries.setdefault(
                service_id,
                {
                    "service_id": service_id,
                    "port": None,
                    "restarts": 0,
                    "last_exit": None,
                    "events": [],
                    "log_tail": [],
                },
            )
            entry["generation"], entry["state"] = problem["generation"], "failed"
            if not problem["reported"]:
                entry["events"].append(
                    {
                        "at": problem["at"],
                        "kind": "error",
                        "data": {"code": problem["code"], "message": problem["message"]},
                    }
                )
        body = {"service_host": self.service_host, "services": list(entries.values())}

        def delivered() -> None:
            self._services_down.delivered(list(down))
            if view is not None:
                self._instance = instance
                self._reported = {**reported, **marks}
            for service_id, problem in problems:
                if self._problems.get(service_id, {}).get("message") == problem["message"]:
                    self._problems[service_id]["reported"] = True

        return body, delivered

    def reconcile(self, desired: list[Any], view: dict[str, Any] | None = None) -> None:
        """Make the worker run exactly the `desired` services (the control plane's answer):
        start or replace what it lacks, stop what is not wanted."""
        if view is None:
            view = self.worker_view()
        running = {
            status["service_id"]: status
            for status in view.get("services", [])
            if isinstance(status, dict) and isinstance(status.get("service_id"), str)
        }
        wanted: set[str] = set()
        for spec in desired:
            service_id = spec.get("service_id") if isinstance(spec, dict) else None
            if not isinstance(service_id, str) or not _SERVICE_ID.fullmatch(service_id):
                log.error("the control plane named a service id this node cannot use; skipped")
                continue
            wanted.add(service_id)
            current = running.get(service_id)
            if current is not None and current.get("generation") == spec.get("generation"):
                self._problems.pop(service_id, None)
                continue
            self._hand_over(service_id, spec)
        for service_id in running:
            if service_id not in wanted:
                self._stop(service_id)
        for service_id in list(self._problems):
            if service_id not in wanted:
                del self._problems[service_id]

    # -- the worker -----------------------------------------------------------------------------

    def _hand_over(self, service_id: str, spec: dict[str, Any]) -> None:
        generation = spec.get("generation")
        weights_path: str | None = None
        digest = spec.get("weights")
        if digest is not None:
            try:
                weights_path = str(self.fetch_weights(str(digest)))
            except (ArtifactError, ControlPlaneError, ValueError, OSError) as exc:
                message = f"cannot fetch its weights {str(digest)[:80]} ({exc})"
                self._problem(service_id, generation, "WEIGHTS_UNAVAILABLE", message)
                return
        body = {
            "service_id": service_id,
            "generation": generation,
            "name": spec.get("name"),
            "command": spec.get("command"),
            "runner": spec.get("runner"),
            "weights_path": weights_path,
            "params": spec.get("params") or {},
            "env": spec.get("env") or {},
            "secrets": spec.get("secrets") or {},
            "assigned_gpus": spec.get("assigned_gpus"),
            "resources": spec.get("resources") or {},
            "health": spec.get("health") or {},
            "restart": spec.get("restart") or {},
            "agent_socket": str(self.agent_socket),
            "private_paths": self.private_paths,
            "host": self.listen_host,
        }
        try:
            status, answer = self._worker("PUT", f"/v1/services/{service_id}", body)
        except WorkerUnavailable as exc:
            log.error("service %s: the runtime worker did not take it (%s)", service_id, exc)
            return
        if status >= 400:
            error = answer.get("error")
            if not isinstance(error, dict):
                error = {}
            message = f"the runtime worker refused it: {error.get('message', status)}"
            self._problem(service_id, generation, str(error.get("code") or "REFUSED"), message)
            return
        self._problems.pop(service_id, None)
        log.info("service %s generation %s handed to the runtime worker", service_id, generation)

    def _stop(self, service_id: str) -> None:
        try:
            status, _ = self._worker("DELETE", f"/v1/services/{service_id}")
        except WorkerUnavailable as exc:
            log.error("service %s: the runtime worker did not stop it (%s)", service_id, exc)
            return
        if status in (200, 404):
            self._reported.pop(service_id, None)
            log.info("service %s is no longer this node's: stopped", service_id)

    def _problem(self, service_id: str, generation: Any, code: str, message: str) -> None:
        """Report the service `failed` with an error event, once per distinct message."""
        known = self._problems.get(service_id)
        if known is not None and (known["generation"], known["message"]) == (generation, message):
            return
        self._problems[service_id] = {
            "generation": generation,
            "code": code,
            "message": message,
            "at": datetime.now(UTC).isoformat(),
            "reported": False,
        }
        log.error("service %s: %s", service_id, message)

    def _worker(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        connection = UnixHTTPConnection(self.worker_socket, timeout=_WORKER_TIMEOUT)
        try:
            payload = None if body is None else json.dumps(body)
            headers = {} if body is None else {"Content-Type": "application/json"}
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            answer = json.loads(response.read() or b"{}")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            busy = isinstance(exc, TimeoutError)
            raise WorkerUnavailable(f"{type(exc).__name__} on {method} {path}", busy=busy) from None
        finally:
            connection.close()
        return response.status, answer if isinstance(answer, dict) else {}


def _service_ids(services: Any) -> set[str]:
    """The ids in a list of services (the worker's statuses, or the control plane's specs)."""
    if not isinstance(services, list):
        return set()
    return {
        entry["service_id"]
        for entry in services
        if isinstance(entry, dict) and isinstance(entry.get("service_id"), str)
    }


def _draining(spec: Any) -> bool:
    return _flag(spec, "draining")


def _flag(spec: Any, name: str) -> bool:
    return isinstance(spec, dict) and spec.get(name) is True


def _engine(load: Any) -> dict[str, int] | None:
    """The worker's `engine` of a replica, as the control plane takes it (None: unknown)."""
    if not isinstance(load, dict):
        return None
    counts = {key: load.get(key) for key in ("processing", "waiting")}
    if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values()):
        return counts  # type: ignore[return-value]
    return None


def _keyed(spec: Any) -> Any:
    """A spec keyed by the id this node runs it by: its `replica_id` (issue 27: a service's
    replicas may share a node); from a control plane before replicas, its `service_id`. The
    worker's service id and every report carry that id."""
    if isinstance(spec, dict) and isinstance(spec.get("replica_id"), str):
        return {**spec, "service_id": spec["replica_id"]}
    return spec


def _interval(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return DEFAULT_POLL_INTERVAL
    return float(min(max(value, _MIN_POLL_INTERVAL), _MAX_POLL_INTERVAL))
