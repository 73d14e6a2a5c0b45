"""What a failed control plane call means, decided in one place for every call the agent makes.

- No answer (a transport error), 429 and 5xx: retried with exponential backoff 1 s…16 s, as long
  as the agent is not stopping. Each retry is logged as
  `ConnectError on POST /api/v1/agent/heartbeat (backoff 1s…16s); next attempt in 2s; last
  success 40s ago`, with a hint once when TLS verification is the cause.
- A revoked, expired or invalid credential, a refusal of the agent's own protocol (426,
  `TOO_OLD`, `TOO_NEW`, `UNKNOWN`) and a refused enrollment token: terminal. Retrying cannot fix
  them, so the first one is recorded, the agent's stop event is set and `AgentStopped` is
  raised — from whichever thread met it — and every later call fails at once with the same
  outcome.
- Any other refusal (4xx): raised as `ControlPlaneError` for the endpoint to interpret. So is a
  426 that names the runtime worker (`"component": "runtime-worker"`): upgrading the worker fixes
  it, and the agent keeps the node online meanwhile (node_agent.agent).

Messages name the status or exception, the method and the path: never a body, never the
credential.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
from tenacity import Retrying, retry_if_exception, wait_exponential

log = logging.getLogger("modelforge.node_agent")
T = TypeVar("T")

EXIT_CONFIG = 2
EXIT_CREDENTIAL = 4
EXIT_PROTOCOL = 5
EXIT_ENROLLMENT = 6

BACKOFF = "(backoff 1s…16s)"
_PROTOCOL_CODES = {"TOO_OLD", "TOO_NEW", "UNKNOWN"}
#: The `component` of a protocol refusal that concerns the runtime worker, not the agent.
RUNTIME_WORKER = "runtime-worker"


class ControlPlaneError(Exception):
    """The control plane answered with a refusal: its status, stable code and (for a protocol
    refusal) the component it names — never the rest of the body."""

    def __init__(
        self, status: int, code: str, method: str, path: str, *, component: str | None = None
    ) -> None:
        named = f" ({component})" if component else ""
        super().__init__(f"HTTP {status} {code}{named} on {method} {path}")
        self.status = status
        self.code = code
        self.method = method
        self.path = path
        self.component = component


class AgentStopped(Exception):
    """The agent must stop and exit with `exit_code`; `explanation` says what to do."""

    def __init__(self, exit_code: int, explanation: str) -> None:
        super().__init__(explanation)
        self.exit_code = exit_code
        self.explanation = explanation


class Interrupted(Exception):
    """The agent is stopping: a call waiting for its next attempt gives up."""


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, ControlPlaneError):
        return exc.status == 429 or exc.status >= 500
    return False


def terminal_outcome(exc: ControlPlaneError) -> AgentStopped | None:
    """The stop a refusal calls for, or None when the refusal concerns this call only."""
    if exc.component == RUNTIME_WORKER:
        return None  # the worker's protocol: the agent stays up (node_agent.agent)
    if exc.status == 426 or exc.code in _PROTOCOL_CODES:
        return AgentStopped(
            EXIT_PROTOCOL,
            f"the control plane refused this agent's protocol ({exc.code}); upgrade the "
            "component it names (see docs/COMPATIBILITY.md) and start the agent again",
        )
    if exc.code == "CREDENTIAL_EXPIRED":
        return AgentStopped(
            EXIT_CREDENTIAL,
            "the node credential has expired; this agent stops publishing. To bring the node "
            "back, mint an enrollment token, remove identity.json from the state volume and "
            "start the agent with the new token",
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


def certificate_problem(exc: BaseException) -> str | None:
    """The TLS verification failure behind a connection error, if that is what it is."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen.verify_message or str(seen)
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    return text if "CERTIFICATE_VERIFY_FAILED" in text else None


def describe(exc: BaseException, method: str, path: str) -> str:
    """A failed attempt in one line: the refusal as `ControlPlaneError` words it, or the class of
    the transport error."""
    if isinstance(exc, ControlPlaneError):
        return str(exc)
    return f"{type(exc).__name__} on {method} {path}"


class RetryRule:
    """The one rule every control plane call runs under; shared by all the agent's threads."""

    def __init__(self, *, stop: threading.Event, control_plane_url: str) -> None:
        self.stop = stop
        self.control_plane_url = control_plane_url
        self._last_success: float | None = None
        #: A call failed to reach the control plane since the last success: the next success
        #: (of any loop's call) is a reconnection.
        self._unreachable = False
        #: How many times contact was lost (a call failed to reach the control plane after a
        #: success): whoever must act after a loss compares it with the count it last acted on.
        self._losses = 0
        self._stopped: AgentStopped | None = None
        self._lock = threading.Lock()

    @property
    def stopped(self) -> AgentStopped | None:
        """The terminal outcome that stopped the agent, if one did."""
        return self._stopped

    @property
    def losses(self) -> int:
        """How many times contact with the control plane was lost since the agent started."""
        return self._losses

    def cut_off_for(self) -> float:
        """Seconds since the last call that reached the control plane, while the calls since
        fail to reach it; 0 while it is reachable (or before any call reached it)."""
        with self._lock:
            if not self._unreachable or self._last_success is None:
                return 0.0
            return time.monotonic() - self._last_success

    def run(self, method: str, path: str, attempt: Callable[[], T]) -> T:
        """Run `attempt` until it succeeds, fails for good, or the agent stops.

        Raises `AgentStopped` (terminal), `Interrupted` (stopping while waiting to retry), or
        `ControlPlaneError` (a refusal of this call only).
        """
        self._raise_if_stopped()
        retrying = Retrying(
            retry=retry_if_exception(is_retryable),
            wait=wait_exponential(multiplier=1, min=1, max=16),
            sleep=self._sleep,
            before_sleep=lambda state: self._log_retry(state, method, path),
            reraise=True,
        )
        try:
            result = retrying(attempt)
        except ControlPlaneError as exc:
            stopped = terminal_outcome(exc)
            if stopped is None:
                raise
            self._stop_with(stopped)
            raise stopped from None
        self._succeeded(method, path)
        return result

    def _raise_if_stopped(self) -> None:
        stopped = self._stopped
        if stopped is not None:
            raise AgentStopped(stopped.exit_code, stopped.explanation)

    def _stop_with(self, stopped: AgentStopped) -> None:
        with self._lock:
            if self._stopped is None:
                self._stopped = stopped
        self.stop.set()

    def _sleep(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Interrupted

    def _succeeded(self, method: str, path: str) -> None:
        now = time.monotonic()
        with self._lock:
            last, self._last_success = self._last_success, now
            unreachable, self._unreachable = self._unreachable, False
        if unreachable or (last is not None and now - last > 16):
            log.info("reconnected to the control plane (%s %s)", method, path)

    def _log_retry(self, state: Any, method: str, path: str) -> None:
        exc = state.outcome.exception()
        if isinstance(exc, httpx.TransportError):
            with self._lock:
                if not self._unreachable:
                    self._unreachable = True
                    self._losses += 1
        last = self._last_success
        since = (
            "never succeeded"
            if last is None
            else f"last success {time.monotonic() - last:.0f}s ago"
        )
        log.warning(
            "%s %s; next attempt in %.0fs; %s",
            describe(exc, method, path),
            BACKOFF,
            state.upcoming_sleep,
            since,
        )
        problem = certificate_problem(exc)
        if problem and state.attempt_number == 1:
            log.error(
                "TLS certificate verification failed for %s: %s. If the control plane uses "
                "a private CA, set MODELFORGE_AGENT_CA_CERT_PATH to the CA certificate; do "
                "not turn off MODELFORGE_AGENT_TLS_VERIFY.",
                self.control_plane_url,
                problem,
            )
