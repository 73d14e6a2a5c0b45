"""The agent's life after the preflight: enroll once (or load the persisted identity), then
heartbeat, inventory-on-change and telemetry loops until stopped.

Transient failures retry with exponential backoff 1 s…16 s (AG-5) and are logged as
`ConnectError on POST /api/v1/agent/heartbeat (backoff 1s…16s)` with the time since the last
success. A revoked credential or a protocol refusal stops the agent with an explanation and its
own exit code: retrying cannot fix either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from tenacity import Retrying, retry_if_exception, wait_exponential

from node_agent import client as api
from node_agent.artifact_cache import ArtifactCache
from node_agent.config import AgentSettings
from node_agent.identity import Identity, IdentityStore
from node_agent.inventory import Overrides, collect_inventory, collect_telemetry, machine_id
from node_agent.local_api import serve_local_api
from node_agent.preflight import PreflightResult
from node_agent.work import WorkRunner
from node_agent.worker_link import query_runtime_worker

if TYPE_CHECKING:
    from node_agent.nvml import Nvml

log = logging.getLogger("modelforge.node_agent")
T = TypeVar("T")

EXIT_CONFIG = 2
EXIT_CREDENTIAL = 4
EXIT_PROTOCOL = 5
EXIT_ENROLLMENT = 6

_BACKOFF = "(backoff 1s…16s)"
_PROTOCOL_CODES = {"TOO_OLD", "TOO_NEW", "UNKNOWN"}


class AgentStopped(Exception):
    def __init__(self, exit_code: int, explanation: str) -> None:
        super().__init__(explanation)
        self.exit_code = exit_code
        self.explanation = explanation


class _Interrupted(Exception):
    pass


def _terminal(exc: api.ControlPlaneError) -> AgentStopped | None:
    if exc.status == 426 or exc.code in _PROTOCOL_CODES:
        return AgentStopped(
            EXIT_PROTOCOL,
            f"the control plane refused this agent's protocol ({exc.code}); upgrade the "
            "component it names (see docs/COMPATIBILITY.md) and start the agent again",
        )
    if exc.code == "CREDENTIAL_REVOKED":
        return AgentStopped(
            EXIT_CREDENTIAL,
            "the node credential was revoked by an administrator (or the signing key was "
            "rotated); this agent stops publishing. To bring the node back, remove identity.json "
            "from the state volume and enroll again with a new token",
        )
    if exc.status in (401, 403) and exc.code.startswith("CREDENTIAL"):
        return AgentStopped(
            EXIT_CREDENTIAL,
            f"the control plane does not accept this node's credential ({exc.code}); check that "
            "MODELFORGE_AGENT_CONTROL_PLANE_URL is the control plane that enrolled this node",
        )
    if exc.code.startswith("ENROLLMENT_TOKEN"):
        return AgentStopped(
            EXIT_ENROLLMENT,
            f"enrollment refused ({exc.code}); mint a new enrollment token and start the agent "
            "with it",
        )
    return None


class Agent:
    def __init__(
        self,
        *,
        settings: AgentSettings,
        preflight: PreflightResult,
        store: IdentityStore,
        http: httpx.Client,
        overrides: Overrides,
        stop: threading.Event,
        parallel: int = 1,
    ) -> None:
        self.settings = settings
        self.preflight = preflight
        self.store = store
        self.http = http
        self.overrides = overrides
        self.stop = stop
        self.parallel = parallel
        self.heartbeat_interval = 10.0
        self.telemetry_interval = 15.0
        self._last_success: float | None = None
        self._last_inventory: dict[str, Any] | None = None
        self._health_message: str | None = None
        self._last_worker: dict[str, Any] | None = None
        self._worker_misses = 0

    # -- publishing with retries ----------------------------------------------------------------

    def _publish(self, method: str, path: str, call: Callable[[], T]) -> T | None:
        """Run `call` until it succeeds, a terminal answer arrives, or the agent is stopped.

        Returns None when the control plane rejected this one publication (a 4xx that is neither
        retryable nor terminal): it is logged and dropped rather than retried forever.
        """

        def sleep(seconds: float) -> None:
            if self.stop.wait(seconds):
                raise _Interrupted

        def before_sleep(state: Any) -> None:
            exc = state.outcome.exception()
            since = (
                "never succeeded"
                if self._last_success is None
                else f"last success {time.monotonic() - self._last_success:.0f}s ago"
            )
            log.warning(
                "%s %s; next attempt in %.0fs; %s",
                api.describe(exc, method, path),
                _BACKOFF,
                state.upcoming_sleep,
                since,
            )
            problem = api.certificate_problem(exc)
            if problem and state.attempt_number == 1:
                log.error(
                    "TLS certificate verification failed for %s: %s. If the control plane uses "
                    "a private CA, set MODELFORGE_AGENT_CA_CERT_PATH to the CA certificate; do "
                    "not turn off MODELFORGE_AGENT_TLS_VERIFY.",
                    self.settings.control_plane_url,
                    problem,
                )

        retrying = Retrying(
            retry=retry_if_exception(api.is_retryable),
            wait=wait_exponential(multiplier=1, min=1, max=16),
            sleep=sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            result = retrying(call)
        except api.ControlPlaneError as exc:
            stopped = _terminal(exc)
            if stopped is not None:
                raise stopped from None
            log.error("%s; this publication is dropped", api.describe(exc, method, path))
            return None
        if self._last_success is not None and time.monotonic() - self._last_success > 16:
            log.info("reconnected to the control plane (%s %s)", method, path)
        self._last_success = time.monotonic()
        return result

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
        nonce = self.store.claim_nonce(token)  # persisted before the claim (EN-5)
        fingerprint = {
            "machine_id": machine_id(),
            "gpu_uuids": [g.uuid for g in self.preflight.gpus],
        }
        answer = self._publish(
            "POST",
            "/api/v1/agent/enroll",
            lambda: api.enroll(
                self.http,
                token=token,
                claim_nonce=nonce,
                hostname=self.settings.hostname,
                fingerprint=fingerprint,
            ),
        )
        if answer is None:
            raise AgentStopped(EXIT_ENROLLMENT, "the control plane rejected the enrollment request")
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

    # -- the loops ------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except _Interrupted:
            pass

    def _run(self) -> None:
        identity = self.identity()
        cache = ArtifactCache(self.settings.artifact_cache, self.settings.artifact_cache_bytes)
        local = serve_local_api(
            self.settings.socket,
            cache=cache,
            http=self.http,
            credential=lambda: identity.credential,
        )
        threading.Thread(target=local.serve_forever, daemon=True, name="local-api").start()
        work = WorkRunner(
            http=self.http,
            credential=identity.credential,
            worker_socket=self.settings.worker_socket,
            agent_socket=self.settings.socket,
            parallel=self.parallel,
            stop=self.stop,
            publish=self._publish,
        )
        try:
            self._loop(identity, work)
        finally:
            local.shutdown()
            local.server_close()
            self.settings.socket.unlink(missing_ok=True)
        if work.failure is not None:
            raise work.failure

    def _loop(self, identity: Identity, work: WorkRunner) -> None:
        work_started = False
        nvml: Nvml | None = None
        if self.preflight.mode == "nvidia":
            from node_agent.nvml import Nvml  # only nvidia mode loads the NVML bindings

            nvml = Nvml().__enter__()
        try:
            next_heartbeat = next_telemetry = time.monotonic()
            while not self.stop.is_set():
                now = time.monotonic()
                if now >= next_heartbeat:
                    self._heartbeat(identity)
                    self._inventory_if_changed(identity)
                    next_heartbeat = time.monotonic() + self.heartbeat_interval
                    if not work_started:  # claim only once the node has reported itself
                        work.start()
                        work_started = True
                if now >= next_telemetry:
                    self._telemetry(identity, nvml)
                    next_telemetry = time.monotonic() + self.telemetry_interval
                self.stop.wait(max(0.0, min(next_heartbeat, next_telemetry) - time.monotonic()))
        finally:
            if nvml is not None:
                nvml.__exit__(None, None, None)

    def _heartbeat(self, identity: Identity) -> None:
        health: dict[str, Any] = {
            "status": "degraded" if self._health_message else "healthy",
            "preflight": "passed",
        }
        if self._health_message:
            health["message"] = self._health_message
        answer = self._publish(
            "POST",
            "/api/v1/agent/heartbeat",
            lambda: api.heartbeat(self.http, credential=identity.credential, health=health),
        )
        if answer:
            self._apply_intervals(answer)

    def _inventory_if_changed(self, identity: Identity) -> None:
        inventory = collect_inventory(
            hostname=self.settings.hostname,
            mode=self.preflight.mode,
            gpus=self.preflight.gpus,
            overrides=self.overrides,
            runtime_worker=self._runtime_worker(),
        )
        if inventory == self._last_inventory:
            return
        answer = self._publish(
            "PUT",
            "/api/v1/agent/inventory",
            lambda: api.put_inventory(
                self.http, credential=identity.credential, inventory=inventory
            ),
        )
        if answer is not None:
            self._last_inventory = inventory
            log.info(
                "inventory sent (%d CPUs, %d MB, %d GPUs, runtime worker %s)",
                inventory["cpu_count"],
                inventory["memory_mb"],
                len(inventory["gpus"]),
                (inventory.get("runtime_worker") or {}).get("version", "absent"),
            )

    def _runtime_worker(self) -> dict[str, Any] | None:
        """The worker's report; one missed answer (a busy moment) keeps the last one."""
        report = query_runtime_worker(self.settings.worker_socket)
        if report is None and self._worker_misses == 0 and self._last_worker is not None:
            self._worker_misses = 1
            return self._last_worker
        self._worker_misses = 0 if report is not None else self._worker_misses + 1
        self._last_worker = report
        return report

    def _telemetry(self, identity: Identity, nvml: Nvml | None) -> None:
        telemetry = collect_telemetry(nvml, self.preflight.gpus)
        missing = [g["index"] for g in telemetry["gpus"] if "utilization_percent" not in g]
        self._health_message = (
            f"NVML returned no utilisation for GPU(s) {missing}" if missing else None
        )
        self._publish(
            "POST",
            "/api/v1/agent/telemetry",
            lambda: api.post_telemetry(
                self.http, credential=identity.credential, telemetry=telemetry
            ),
        )
