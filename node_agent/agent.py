"""The agent's life after the preflight: enroll once (or load the persisted identity), then run
its loops until stopped, each on its own thread and schedule:

- heartbeats, every interval the control plane gives;
- the inventory, checked at the same interval and sent when it changed, and at least every
  inventory interval the control plane gives even unchanged (readiness judges its age);
- telemetry, every telemetry interval;
- on a node with NVIDIA GPUs, each offered GPU's health (node_agent.gpu_health): a watch thread
  on NVML's XID events and counters, and a sender that reports every GPU's judgement at once when
  one changes, and again every 60 s;
- the work slots and the cancellation watch (node_agent.work), once the node has reported itself;
- beside them the services this node must run (node_agent.services), synced with the control
  plane every poll interval it gives and kept in line on the runtime worker;
- the tunnel, always open while the agent runs: the control plane's gateway reaches this
  node's replicas through it, on their local ports (node_agent.tunnel's relay process);
- with a maximum idle time (`MODELFORGE_AGENT_MAX_IDLE_SECONDS`), the idle watch: once the
  node has had no job and no service for that long since the slots started (node_agent.idle),
  it logs why and stops the agent, which exits with 0;
- the runtime worker watch (node_agent.worker_link), asking the worker every second whether it
  is there. A lost worker is reported at once: the heartbeat and the inventory are sent then,
  not at their next interval (health `degraded`, naming the worker; no worker in the
  inventory), the services sync reports its services `failed`, and the slots claim nothing
  until it answers again.

A runtime worker whose protocol the control plane refuses (426 naming `runtime-worker` on the
inventory) is not the agent's failure: the agent logs once what to upgrade, keeps heartbeating
(the node stays online, marked Needs upgrade), claims no work and keeps no services, and reports
the inventory again as soon as the worker's answer changes, and the same refused one again once
every inventory interval (a restarted or upgraded control plane judges it afresh: a restart
clears the mark); once it is accepted, the slots claim again and the services are synced again.

A loop retrying a failing call (node_agent.retry: backoff 1 s…16 s) delays only itself: a
control plane that refuses telemetry for minutes still receives every heartbeat on time. A
terminal answer to any call stops every loop; the agent then exits with that outcome's code.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from modelforge_contracts.protocol import PROTOCOL_VERSION
from node_agent.artifact_cache import ArtifactCache, ArtifactError
from node_agent.client import ControlPlane
from node_agent.config import AgentSettings, ConfigError, group_id
from node_agent.hardening import private_paths, share_socket
from node_agent.identity import Identity, IdentityStore
from node_agent.idle import Activity
from node_agent.inventory import (
    Overrides,
    collect_inventory,
    collect_telemetry,
    machine_id,
    offered_gpus,
    slurm_allocation,
)
from node_agent.local_api import serve_local_api
from node_agent.preflight import PreflightResult
from node_agent.retry import EXIT_CONFIG, AgentStopped, ControlPlaneError, Interrupted
from node_agent.services import ServiceKeeper
from node_agent.tunnel import RELAY, NativeTunnel, replica_ports
from node_agent.work import WorkRunner
from node_agent.worker_link import WorkerWatch, wait_or_wake

if TYPE_CHECKING:
    from node_agent.nvml import Nvml

log = logging.getLogger("modelforge.node_agent")
#: How often the runtime worker watch asks the worker whether it is there.
_WORKER_WATCH_EVERY = 1.0
#: How often the idle watch looks: an idle exit comes at most this late.
_IDLE_WATCH_EVERY = 0.5
#: How long a stopping agent waits for its jobs to end and be reported: the worker kills a job's
#: process group at once, and each report is one call (Docker's stop grace is 10 s).
_STOP_JOBS_SECONDS = 5.0
#: The control plane takes a health message of at most this many characters.
_HEALTH_MESSAGE_MAX = 500


class Agent:
    def __init__(
        self,
        *,
        settings: AgentSettings,
        preflight: PreflightResult,
        store: IdentityStore,
        control_plane: ControlPlane,
        overrides: Overrides,
        stop: threading.Event,
        parallel: int = 1,
        max_idle_seconds: float = 0.0,
    ) -> None:
        self.settings = settings
        self.preflight = preflight
        self.store = store
        self.control_plane = control_plane
        self.overrides = overrides
        self.stop = stop
        self.parallel = parallel
        #: 0: never idle out.
        self.max_idle_seconds = max_idle_seconds
        #: Jobs in hand and services; its clock starts over when the slots start.
        self.activity = Activity()
        self.heartbeat_interval = 10.0
        self.telemetry_interval = 15.0
        self.inventory_interval = 900.0
        self._last_inventory: dict[str, Any] | None = None
        #: The inventory whose runtime worker the control plane refused; sent again as is only
        #: once every inventory interval.
        self._refused_inventory: dict[str, Any] | None = None
        #: Cleared while the control plane refuses the runtime worker: the slots claim nothing.
        self.worker_compatible = threading.Event()
        self.worker_compatible.set()
        self._inventory_sent_at = 0.0
        self._health_message: str | None = None
        #: Whether the runtime worker is there: the one judgement every loop reads.
        self.worker = WorkerWatch(settings.worker_socket)

    # -- enrollment -----------------------------------------------------------------------------

    def identity(self) -> Identity:
        identity = self.store.load()
        token = self.settings.read_enrollment_token()
        if identity is not None:
            if identity.control_plane_url != self.settings.control_plane_url:
                raise AgentStopped(
                    EXIT_CONFIG,
                    f"the identity in {self.store.root} belongs to {identity.control_plane_url}, "
                    f"not {self.settings.control_plane_url}; point the agent back at it, or "
                    "remove identity.json and enroll again",
                )
            if token:
                log.info(
                    "identity of node %s loaded; the enrollment token in the environment is "
                    "ignored (recreate the container without it)",
                    identity.node_id,
                )
            return identity
        if not token:
            raise AgentStopped(
                EXIT_CONFIG,
                "no identity in the state volume and no MODELFORGE_AGENT_ENROLLMENT_TOKEN; mint "
                "an enrollment token and start the agent with it",
            )
        # Persisted before the claim: a retry after a lost answer gets the same node back.
        nonce = self.store.claim_nonce(token)
        fingerprint = {
            "machine_id": machine_id(),
            "gpu_uuids": [g.uuid for g in self.preflight.gpus],
        }
        answer = self.control_plane.enroll(
            token=token,
            claim_nonce=nonce,
            hostname=self.settings.hostname,
            fingerprint=fingerprint,
        )
        identity = Identity(
            node_id=str(answer["node_id"]),
            control_plane_url=self.settings.control_plane_url,
            credential=str(answer["credential"]),
        )
        self.store.save(identity)
        self._apply_intervals(answer)
        log.info("enrolled as node %s", identity.node_id)
        return identity

    def _apply_intervals(self, answer: dict[str, Any]) -> None:
        self.heartbeat_interval = float(
            answer.get("heartbeat_interval_seconds", self.heartbeat_interval)
        )
        self.telemetry_interval = float(
            answer.get("telemetry_interval_seconds", self.telemetry_interval)
        )
        self.inventory_interval = float(
            answer.get("inventory_interval_seconds", self.inventory_interval)
        )

    # -- the loops ------------------------------------------------------------------------------

    def run(self) -> None:
        """Run until stopped; raises `AgentStopped` when a terminal answer stopped the agent."""
        try:
            self._run()
        except Interrupted:
            pass
        stopped = self.control_plane.stopped
        if stopped is not None:
            raise stopped

    def _run(self) -> None:
        identity = self.identity()
        self.control_plane.use_credential(identity.credential)
        # With a group for the sockets (a worker of its own user), the cache is that group's too.
        group = self.settings.socket_group
        cache = ArtifactCache(
            self.settings.artifact_cache,
            self.settings.artifact_cache_bytes,
            group=group_id(group) if group is not None else None,
        )
        try:
            cache.prepare()  # private, and an older agent's wider cache tightened
        except ArtifactError as exc:
            raise ConfigError(f"MODELFORGE_ARTIFACT_CACHE: {exc}") from None
        local = serve_local_api(self.settings.socket, cache=cache, control_plane=self.control_plane)
        if self.settings.socket_group is not None:
            try:
                self._share_socket(self.settings.socket_group)
            except ConfigError:
                local.server_close()
                raise
        threading.Thread(target=local.serve_forever, daemon=True, name="local-api").start()
        nvml: Nvml | None = None
        if self.preflight.mode == "nvidia":
            from node_agent.nvml import Nvml  # only nvidia mode loads the NVML bindings

            nvml = Nvml().__enter__()
        try:
            self.worker.watch_once()  # the first heartbeat and inventory say whether it is there
            self._heartbeat()  # the first one alone: a terminal answer stops everything here
            self._loop("runtime worker watch", self._watch_worker, lambda: _WORKER_WATCH_EVERY)
            self._loop(
                "heartbeats",
                self._heartbeat,
                lambda: self.heartbeat_interval,
                wake=self.worker.wake_on_change(),
            )
            inventory_tried = threading.Event()

            def inventory() -> None:
                self._inventory_if_changed()
                inventory_tried.set()

            self._loop(
                "inventory",
                inventory,
                lambda: self.heartbeat_interval,
                first=True,
                wake=self.worker.wake_on_change(),
            )
            self._loop(
                "telemetry",
                lambda: self._telemetry(nvml),
                lambda: self.telemetry_interval,
                first=True,
            )
            if nvml is not None:
                self._watch_gpu_health()
            # Claim only once the node has reported itself.
            while not inventory_tried.wait(0.1):
                if self.stop.is_set():
                    return
            hidden = private_paths(self.settings.state_volume, self.settings.enrollment_token_file)
            # Idle is counted from here: time spent enrolling or waiting for the control plane
            # is not time the node could have worked.
            self.activity = Activity()
            runner = WorkRunner(
                control_plane=self.control_plane,
                worker_socket=self.settings.worker_socket,
                agent_socket=self.settings.socket,
                parallel=self.parallel,
                stop=self.stop,
                worker_compatible=self.worker_compatible,
                private_paths=hidden,
                worker=self.worker,
                activity=self.activity,
                job_python=self.settings.python,
            )
            runner.start()
            control_plane = self.control_plane
            keeper = ServiceKeeper(
                control_plane=control_plane,
                worker_socket=self.settings.worker_socket,
                agent_socket=self.settings.socket,
                fetch_weights=lambda digest: cache.fetch(digest, control_plane.download_artifact),
                stop=self.stop,
                worker_compatible=self.worker_compatible,
                private_paths=hidden,
                service_host=self.settings.service_host,
                worker=self.worker,
                activity=self.activity,
            )
            keeper.start()
            tunnel = NativeTunnel(
                binary=RELAY,  # there: the agent's start checked (tunnel.check_relay)
                control_plane_url=self.settings.control_plane_url,
                credential=identity.credential,
                ports=lambda: replica_ports(keeper.worker_view()),
                stop=self.stop,
                tls_verify=self.settings.tls_verify,
                ca_cert_path=self.settings.ca_cert_path,
            )
            keeper.in_flight = tunnel.in_flight  # a draining replica's drain ends at 0
            tunnel.start()
            if self.max_idle_seconds > 0:
                self._loop("idle watch", self._idle_watch, lambda: _IDLE_WATCH_EVERY)
            while not self.stop.wait(1.0):
                pass
            # Stopping: the jobs it runs end with it, reported as such (work.py).
            unreported = runner.stop_jobs(_STOP_JOBS_SECONDS)
            if unreported:
                log.warning(
                    "stopping without reporting the end of %d job(s) (%s): the control plane "
                    "fails them JOB_CONTACT_LOST once they stop reporting",
                    len(unreported),
                    ", ".join(unreported),
                )
        finally:
            local.shutdown()
            local.server_close()
            self.settings.socket.unlink(missing_ok=True)
            if nvml is not None:
                nvml.__exit__(None, None, None)

    def _share_socket(self, group: str) -> None:
        gid = group_id(group)
        try:
            if gid is None:
                raise LookupError(f"no group {group!r}")
            share_socket(self.settings.socket, gid)
        except (OSError, LookupError) as exc:
            self.settings.socket.unlink(missing_ok=True)
            raise ConfigError(
                f"MODELFORGE_AGENT_SOCKET_GROUP: cannot give group {group!r} the agent's socket "
                f"{self.settings.socket} ({exc}); the agent's user must be a member of it"
            ) from None

    def _loop(
        self,
        name: str,
        step: Callable[[], None],
        interval: Callable[[], float],
        *,
        first: bool = False,
        wake: threading.Event | None = None,
    ) -> None:
        """Run `step` on a thread of its own, every `interval()` seconds after the last ended
        (the first at once when `first`), and at once when `wake` is set."""

        def forever() -> None:
            if not first and wait_or_wake(self.stop, interval(), wake):
                return
            while not self.stop.is_set():
                try:
                    step()
                except (AgentStopped, Interrupted):
                    return  # the agent stops; the retry rule recorded why
                except Exception:
                    if self.stop.is_set():
                        return  # shutting down: the client may already be closed
                    log.exception("unexpected error in the %s loop; it goes on", name)
                if wait_or_wake(self.stop, interval(), wake):
                    return

        threading.Thread(target=forever, daemon=True, name=name).start()

    def _watch_gpu_health(self) -> None:
        """Watch the GPUs this node offers, and report their health from a thread of its own."""
        from node_agent.gpu_health import REFRESH_SECONDS, GpuHealthReporter, GpuWatcher

        gpus = offered_gpus(self.preflight.gpus, self.overrides, slurm_allocation())
        if not gpus:
            return
        reporter = GpuHealthReporter(self.control_plane.report_gpu_health)
        watcher = GpuWatcher(
            on_change=reporter.offer,
            poll_seconds=self.settings.gpu_health_poll_seconds,
            gpus={gpu.index: gpu.uuid for gpu in gpus},
        )
        threading.Thread(
            target=watcher.run, args=(self.stop,), daemon=True, name="GPU health watch"
        ).start()
        self._loop(
            "GPU health reports",
            reporter.send_latest,
            lambda: REFRESH_SECONDS,
            wake=reporter.wake,
        )

    def _idle_watch(self) -> None:
        idle = self.activity.idle_for()
        if idle >= self.max_idle_seconds:
            log.info(
                "no job and no service for %.0f s (maximum idle time %g s, "
                "MODELFORGE_AGENT_MAX_IDLE_SECONDS): stopping",
                idle,
                self.max_idle_seconds,
            )
            self.stop.set()

    def _watch_worker(self) -> None:
        self.worker.watch_once()

    def _heartbeat(self) -> None:
        problems = [m for m in (self.worker.problem(), self._health_message) if m]
        health: dict[str, Any] = {
            "status": "degraded" if problems else "healthy",
            "preflight": "passed",
        }
        if problems:
            health["message"] = "; ".join(problems)[:_HEALTH_MESSAGE_MAX]
        answer = self.control_plane.heartbeat(health)
        if answer:
            self._apply_intervals(answer)

    def _inventory_if_changed(self) -> None:
        inventory = collect_inventory(
            hostname=self.settings.hostname,
            mode=self.preflight.mode,
            gpus=self.preflight.gpus,
            overrides=self.overrides,
            runtime_worker=self._runtime_worker(),
        )
        if (
            inventory == self._refused_inventory
            and time.monotonic() - self._inventory_sent_at < self.inventory_interval
        ):
            # The same worker, refused: asked about again only at the inventory interval, so a
            # restarted control plane judges it again (and marks the node) without being hammered.
            return
        changed = inventory != self._last_inventory
        if not changed and time.monotonic() - self._inventory_sent_at < self.inventory_interval:
            return
        try:
            sent = self.control_plane.put_inventory(inventory)
        except ControlPlaneError as refusal:  # the runtime worker's protocol, not the agent's
            self._worker_refused(inventory, refusal)
            return
        if sent:
            self._refused_inventory = None
            self._last_inventory = inventory
            self._inventory_sent_at = time.monotonic()
            if not self.worker_compatible.is_set():
                worker = inventory.get("runtime_worker")
                if worker is None:
                    log.info("the refused runtime worker no longer answers; claiming work again")
                else:
                    log.info("%s is compatible; claiming work again", _describe_worker(worker))
                self.worker_compatible.set()
            if not changed:
                log.debug("inventory sent again, unchanged")
                return
            log.info(
                "inventory sent (%d CPUs, %d MB, %d GPUs, runtime worker %s)",
                inventory["cpu_count"],
                inventory["memory_mb"],
                len(inventory["gpus"]),
                (inventory.get("runtime_worker") or {}).get("version", "absent"),
            )

    def _worker_refused(self, inventory: dict[str, Any], refusal: ControlPlaneError) -> None:
        """The control plane refused the runtime worker's protocol: stop claiming, say so once
        per worker, and send this inventory again when the worker's answer changes, or else at
        the next inventory interval."""
        self.worker_compatible.clear()
        again = inventory == self._refused_inventory
        self._refused_inventory = inventory
        self._last_inventory = None  # the last accepted report no longer stands
        self._inventory_sent_at = time.monotonic()
        if again:
            log.debug("the refused runtime worker was refused again (%s)", refusal.code)
            return
        log.error(
            "%s at %s was refused by the control plane (%s): the runtime worker must be upgraded "
            "to this agent's release (protocol %d, see docs/COMPATIBILITY.md). The node stays "
            "online and takes no work until a compatible runtime worker answers",
            _describe_worker(inventory.get("runtime_worker")),
            self.settings.worker_socket,
            refusal.code,
            PROTOCOL_VERSION,
        )

    def _runtime_worker(self) -> dict[str, Any] | None:
        """The worker's last report, None while it is lost (the watch tolerates a busy
        moment: one missed answer)."""
        return self.worker.report

    def _telemetry(self, nvml: Nvml | None) -> None:
        telemetry = collect_telemetry(nvml, self.preflight.gpus)
        missing = [g["index"] for g in telemetry["gpus"] if "utilization_percent" not in g]
        self._health_message = (
            f"NVML returned no utilisation for GPU(s) {missing}" if missing else None
        )
        self.control_plane.post_telemetry(telemetry)


def _describe_worker(report: dict[str, Any] | None) -> str:
    if report is None:
        return "the runtime worker"
    return (
        f"runtime worker {report.get('version', 'unknown')} "
        f"(protocol {report.get('protocol_version')})"
    )
