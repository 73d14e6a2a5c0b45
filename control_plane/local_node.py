"""The local node (`modelforge-control-plane --local-node`): a node agent and a runtime worker run
beside the control plane as its children, so that one machine is a whole installation.

Composition, as `cli` is: it may import any room, and only `cli` imports it.

- The children start once the server answers. The agent enrolls with a single-use token the
  control plane mints for itself through the admin API's own domain function
  (`fleet.enrollments.mint_enrollment`, audited as `enrollment.mint` by the actor `local-node`),
  with the labels `local=true`. The token reaches the agent in a 0600 file, removed once the
  agent holds its identity: never in a process's arguments, its environment or a log. One
  mint per run until the agent enrolls; a token that cannot be written is revoked again.
- Everything lives under `<data dir>/local-node/`: the agent's state (so the next start finds its
  identity and mints nothing), the worker's and the agent's sockets, the artifact cache, and each
  child's output (`agent.log`, `worker.log`).
- A child that exits is started again after a backoff (1 s, doubling up to 60 s; back to 1 s once
  it has run for a minute), except an agent whose credential is refused (its node was deleted),
  whose configuration is refused (exit 2), or whose token minted in this run is refused: that
  needs a person, and the log says what to do.
- One control plane at a time runs the local node of a data dir: it holds a lock
  (`local-node/supervisor.lock`) while it does. A second start on the same data dir (`make run`
  in a second terminal) is refused before it serves, instead of starting a second agent and
  worker that would take the first one's sockets and identity.
- Each child runs in a session of its own, so a Ctrl-C in the terminal reaches only the control
  plane, which then stops them: SIGTERM, then SIGKILL to its process group after a grace. Each
  also dies with the thread that started it (PR_SET_PDEATHSIG), so a control plane killed with
  SIGKILL leaves no agent behind to heartbeat in its name.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import signal
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.orm import Session

from control_plane import local_processes
from control_plane.audit import Audit
from control_plane.clock import SystemClock
from control_plane.db import make_engine, make_session_factory
from control_plane.fleet.enrollments import mint_enrollment, revoke_enrollment
from control_plane.settings import Settings
from modelforge_contracts.files import write_private

log = logging.getLogger("modelforge.control_plane.local_node")

ACTOR = "local-node"
DISPLAY_NAME = "local node"
LABELS = {"local": "true"}
#: Long enough for a slow first start of the agent; a refused (expired) token is replaced.
TOKEN_LIFETIME_SECONDS = 900
GRACE_SECONDS = 15.0
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 60.0
#: A child that ran this long had a good start: its next restart waits the first backoff again.
STABLE_AFTER_SECONDS = 60.0
#: node_agent/cli.py's exit codes (the control plane imports nothing of the agent).
AGENT_CONFIG_REFUSED = 2
AGENT_CREDENTIAL_REFUSED = 4
AGENT_ENROLLMENT_REFUSED = 6
#: The longest path a unix socket may have (sun_path holds 108 bytes with its terminating NUL).
_SOCKET_PATH_MAX = 107
#: What each child needs importable: the agent's and the worker's extras (`.[agent,worker]`).
_NEEDED_MODULES = ("node_agent", "runtime_worker", "tenacity", "pynvml", "psutil", "onnxruntime")


class LocalNodeError(Exception):
    """The local node cannot run as configured; the message says why and the way out."""


class _AgentHalted(Exception):
    """The agent is not to be started again by this run; the message says what to fix."""


@dataclass(frozen=True)
class LocalNodePaths:
    """Where the local node keeps everything: `<data dir>/local-node/`."""

    root: Path

    @property
    def agent_state(self) -> Path:
        return self.root / "agent"

    @property
    def identity(self) -> Path:
        return self.agent_state / "identity.json"  # node_agent/identity.py's IDENTITY_FILE

    @property
    def token_file(self) -> Path:
        return self.root / "enrollment-token"

    @property
    def worker_socket(self) -> Path:
        return self.root / "worker.sock"

    @property
    def agent_socket(self) -> Path:
        return self.root / "agent.sock"

    @property
    def lock(self) -> Path:
        return self.root / "supervisor.lock"

    @property
    def artifact_cache(self) -> Path:
        return self.root / "artifact-cache"

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"


def paths_for(settings: Settings) -> LocalNodePaths:
    return LocalNodePaths(settings.data_dir.resolve() / "local-node")


def check(settings: Settings) -> None:
    """Refuse, before anything starts, a local node that could not run here."""
    missing = [name for name in _NEEDED_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise LocalNodeError(
            f"the local node needs the node agent's and the runtime worker's packages (missing: "
            f"{', '.join(missing)}); install them with pip install -e '.[agent,worker]' (make "
            "run does), or turn the local node off with MODELFORGE_LOCAL_NODE=false"
        )
    longest = paths_for(settings).worker_socket
    if len(os.fsencode(longest)) > _SOCKET_PATH_MAX:
        raise LocalNodeError(
            f"MODELFORGE_DATA_DIR {settings.data_dir.resolve()} is too deep for the local node's "
            f"unix sockets ({longest} is over {_SOCKET_PATH_MAX} bytes); choose a shorter data "
            "dir, or turn the local node off with MODELFORGE_LOCAL_NODE=false"
        )


def control_plane_url(settings: Settings) -> str:
    """Where the local agent reaches this control plane: its own port, on loopback when it
    listens on every address."""
    if settings.tls_cert is not None and settings.public_url:
        return settings.public_url.rstrip("/")  # the name its certificate is for
    return served_url(settings)


def served_url(settings: Settings) -> str:
    """The server at an address it listens on: loopback when it listens on every address."""
    every = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}  # noqa: S104 - read, not bound
    host = every.get(settings.host, settings.host)
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if settings.tls_cert else 'http'}://{host}:{settings.port}"


@contextmanager
def _audited(
    settings: Settings, action: str, target: str, **detail: Any
) -> Iterator[tuple[Session, Audit]]:
    """One transaction of this control plane's database with its audit entry by `local-node`,
    added as succeeded when the block ends without an exception (as an admin's request's is)."""
    audit = Audit(actor=ACTOR, clock=SystemClock())
    audit(action, target, **detail)
    engine = make_engine(settings.sqlalchemy_url)
    try:
        with make_session_factory(engine).begin() as session:
            yield session, audit
            audit.succeeded(session)
    finally:
        engine.dispose()


def mint_local_enrollment(settings: Settings) -> tuple[str, str]:
    """A single-use token for the local agent, minted and audited as an admin's mint is: its
    enrollment's id and the token."""
    with _audited(settings, "enrollment.mint", DISPLAY_NAME, labels=LABELS) as (session, audit):
        minted = mint_enrollment(
            session=session,
            clock=audit.clock,
            display_name=DISPLAY_NAME,
            expires_in_seconds=TOKEN_LIFETIME_SECONDS,
            labels=dict(LABELS),
            production_eligible=False,
        )
        audit.target = minted.enrollment.id
    log.info(
        "local node: minted enrollment %s (labels local=true) for its agent",
        minted.enrollment.id,
    )
    return minted.enrollment.id, minted.token


def revoke_local_enrollment(settings: Settings, enrollment_id: str) -> None:
    """Revoke a token minted here that never reached the agent, as an admin's revoke does."""
    with _audited(settings, "enrollment.revoke", enrollment_id) as (session, audit):
        revoke_enrollment(session=session, clock=audit.clock, enrollment_id=enrollment_id)
    log.info("local node: revoked enrollment %s, its token never reached the agent", enrollment_id)


@dataclass
class _Child:
    """One supervised process: the agent or the worker."""

    name: str
    module: str
    log: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    backoff: float = FIRST_BACKOFF_SECONDS
    #: When to start it (again); None: not to be started.
    start_at: float | None = 0.0


def _start_later(child: _Child, now: float) -> float:
    """Start `child` again after its backoff, which doubles for the next time (up to the
    most); the seconds it waits."""
    wait = child.backoff
    child.start_at = now + wait
    child.backoff = min(wait * 2, MAX_BACKOFF_SECONDS)
    return wait


class LocalNode:
    """Starts the agent and the worker once the server answers, keeps them running, stops them."""

    def __init__(self, settings: Settings, *, grace: float = GRACE_SECONDS) -> None:
        self.settings = settings
        self.paths = paths_for(settings)
        self.url = control_plane_url(settings)
        self._grace = grace
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="local-node", daemon=True)
        self.worker = _Child("runtime worker", "runtime_worker", self.paths.log("worker"))
        self.agent = _Child("node agent", "node_agent", self.paths.log("agent"))
        self._lock_fd: int | None = None
        self._not_before: threading.Event | None = None
        #: The enrollment minted in this run while the agent has not enrolled with it: one
        #: mint per run until the agent holds an identity, not one per restart.
        self._minted: str | None = None

    def start(self, *, not_before: threading.Event | None = None) -> None:
        """Take the data dir's local node and start supervising (once `not_before` is set, when
        given); `LocalNodeError` when another control plane runs it."""
        try:
            self.paths.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise LocalNodeError(
                f"cannot prepare the local node's directory {self.paths.root} ({exc}); make it "
                "writable by this user, or turn the local node off with MODELFORGE_LOCAL_NODE=false"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LocalNodeError(
                f"another control plane runs the local node of {self.paths.root} (it holds "
                f"{self.paths.lock}): stop that one first, or start this one with "
                "--no-local-node or another MODELFORGE_DATA_DIR"
            ) from None
        self._lock_fd = fd
        self._not_before = not_before
        self._thread.start()

    def stop(self) -> None:
        """Stop both children (SIGTERM, SIGKILL after the grace) and wait for them."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self._grace + 10)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the lock goes with it
            self._lock_fd = None

    # -- the supervising thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            if not self._wait_until_serving():
                return
            log.info(
                "local node: starting a runtime worker and a node agent for %s (their output: "
                "%s, %s)",
                self.url,
                self.worker.log,
                self.agent.log,
            )
            self._tend(self.worker)
            self._wait_for_worker_socket()
            while not self._stopping.is_set():
                self._forget_token_once_enrolled()
                self._tend(self.worker)
                self._tend(self.agent)
                self._stopping.wait(0.2)
        except Exception:
            log.exception("local node: its supervisor failed; stopping the agent and the worker")
        finally:
            self._stop_children()

    def _wait_until_serving(self) -> bool:
        """Wait until `not_before` is set (`cli`: once Granian forked its worker from this
        process, which nothing here may touch while the fork copies it), then until this control
        plane's health answers: a 200 with its body, not another server's answer on the port
        (Granian listens before it forks). False when stopped first."""
        while self._not_before is not None and not self._not_before.wait(0.1):
            if self._stopping.is_set():
                return False
        health = f"{served_url(self.settings)}/api/v1/health"
        # Only whether it answers; nothing is sent but this GET, so its certificate (which
        # may name another host than this address) is not checked.
        unverified = ssl.create_default_context()
        unverified.check_hostname = False
        unverified.verify_mode = ssl.CERT_NONE
        while not self._stopping.is_set():
            try:
                answer = httpx.get(health, timeout=2, verify=unverified)
                if answer.status_code == 200 and _is_health(answer.json()):
                    return True
            except (httpx.HTTPError, ValueError):
                pass
            self._stopping.wait(0.1)
        return False

    def _wait_for_worker_socket(self) -> None:
        """The agent finds its worker at once (it would wait for it otherwise, reporting it
        missing)."""
        deadline = time.monotonic() + 10
        while not self.paths.worker_socket.exists() and time.monotonic() < deadline:
            if self.worker.process is None or self.worker.process.poll() is not None:
                return
            if self._stopping.wait(0.05):
                return

    def _tend(self, child: _Child) -> None:
        now = time.monotonic()
        process = child.process
        if process is not None:
            code = process.poll()
            if code is None:
                return
            child.process = None
            self._exited(child, code, ran=now - child.started_at, now=now)
        if child.start_at is not None and now >= child.start_at:
            self._start(child, now)

    def _exited(self, child: _Child, code: int, *, ran: float, now: float) -> None:
        if ran >= STABLE_AFTER_SECONDS:
            child.backoff = FIRST_BACKOFF_SECONDS
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        if child is self.agent and code == AGENT_CREDENTIAL_REFUSED:
            child.start_at = None
            log.error(
                "local node: the node agent exited with %s: the control plane refused its "
                "credential (was the node deleted?). To enroll it again, stop the control plane, "
                "remove %s and start it again. Its output: %s",
                how,
                self.paths.agent_state,
                child.log,
            )
            return
        if child is self.agent and code == AGENT_CONFIG_REFUSED:
            child.start_at = None
            log.error(
                "local node: the node agent exited with %s: it refused its configuration (a "
                "MODELFORGE_AGENT_* value, or an identity enrolled under another URL than %s; "
                "its output says which: %s). Fix that variable, or give it back the URL it "
                "enrolled with (or remove %s to enroll a new node), then restart the control "
                "plane",
                how,
                self.url,
                child.log,
                self.paths.agent_state,
            )
            return
        if child is self.agent and code == AGENT_ENROLLMENT_REFUSED:
            self.paths.token_file.unlink(missing_ok=True)  # used or expired: mint a new one
            if self._minted is not None:
                child.start_at = None
                log.error(
                    "local node: the node agent exited with %s: the control plane refused the "
                    "enrollment token minted for it in this run (enrollment %s: expired after "
                    "%d s, or revoked); it mints one per run. See its output %s, then restart the "
                    "control plane to mint a new one",
                    how,
                    self._minted,
                    TOKEN_LIFETIME_SECONDS,
                    child.log,
                )
                return
        log.warning(
            "local node: the %s exited with %s; starting it again in %g s (its output: %s)",
            child.name,
            how,
            _start_later(child, now),
            child.log,
        )

    def _start(self, child: _Child, now: float) -> None:
        child.start_at = None
        try:
            if child is self.agent:
                env = self._agent_environment()
            else:
                self.paths.worker_socket.unlink(missing_ok=True)  # wait for the new one
                env = self._worker_environment()
            child.process = local_processes.spawn(
                child.module, env=env, cwd=self.paths.root, output=child.log
            )
        except _AgentHalted as exc:
            log.error("local node: the node agent is left stopped: %s", exc)
            return
        except Exception as exc:
            # The database or the file system said no: try again later, as after an exit.
            log.warning(
                "local node: cannot start the %s (%s: %s); trying again in %g s",
                child.name,
                type(exc).__name__,
                exc,
                _start_later(child, now),
            )
            return
        child.started_at = now
        log.info("local node: %s started (pid %d)", child.name, child.process.pid)

    def _agent_environment(self) -> dict[str, str]:
        """The agent's variables; with no identity yet, a token is minted into its file first
        (or the one still there, unused, is given again)."""
        env = local_processes.inherited(agent_variables=True)
        paths = self.paths
        env.update(
            MODELFORGE_AGENT_CONTROL_PLANE_URL=self.url,
            MODELFORGE_AGENT_STATE_VOLUME=str(paths.agent_state),
            MODELFORGE_AGENT_WORKER_SOCKET=str(paths.worker_socket),
            MODELFORGE_AGENT_SOCKET=str(paths.agent_socket),
            MODELFORGE_ARTIFACT_CACHE=str(paths.artifact_cache),
        )
        # On a machine with NVIDIA GPUs they are offered; without, it is a CPU node.
        env.setdefault("MODELFORGE_AGENT_ACCELERATOR_MODE", "auto")
        if self.settings.tls_cert is not None:
            env.setdefault("MODELFORGE_AGENT_CA_CERT_PATH", str(self.settings.tls_cert.resolve()))
        elif not self.url.startswith(("http://127.", "http://[::1]", "http://localhost")):
            # A plain-http address of this very host: the traffic never leaves the machine.
            env["MODELFORGE_AGENT_ALLOW_INSECURE_HTTP"] = "true"
        if not paths.identity.exists():
            if not paths.token_file.exists():
                self._mint_token_file()
            env["MODELFORGE_AGENT_ENROLLMENT_TOKEN_FILE"] = str(paths.token_file)
        return env

    def _mint_token_file(self) -> None:
        """Mint a token into its file, once per run until the agent enrolls; a token that
        cannot be written is revoked again, not left behind unclaimed."""
        token_file = self.paths.token_file
        if self._minted is not None:
            raise _AgentHalted(
                f"the token minted in this run (enrollment {self._minted}) is gone from "
                f"{token_file} and the agent has not enrolled; restart the control plane to "
                "mint a new one"
            )
        enrollment_id, token = mint_local_enrollment(self.settings)
        self._minted = enrollment_id
        try:
            write_private(token_file, token)
        except OSError as exc:
            revoke_local_enrollment(self.settings, enrollment_id)
            raise _AgentHalted(
                f"cannot write its enrollment token to {token_file} ({exc.strerror or exc}); "
                f"enrollment {enrollment_id} was revoked again. Make {self.paths.root} writable "
                "by this user (and its file system not full), then restart the control plane"
            ) from None

    def _worker_environment(self) -> dict[str, str]:
        env = local_processes.inherited(agent_variables=False)
        env["MODELFORGE_WORKER_SOCKET"] = str(self.paths.worker_socket)
        return env

    def _forget_token_once_enrolled(self) -> None:
        if self.paths.identity.exists():
            self.paths.token_file.unlink(missing_ok=True)
            self._minted = None  # consumed: a later enrollment may mint again

    def _stop_children(self) -> None:
        running = [c.process for c in (self.agent, self.worker) if c.process is not None]
        local_processes.stop(running, grace=self._grace)
        self.agent.process = self.worker.process = None
        if running:
            log.info("local node: agent and worker stopped")


def _is_health(body: object) -> bool:
    """The body of this control plane's `GET /api/v1/health` (schemas.Health)."""
    return isinstance(body, dict) and {"status", "database", "storage"} <= body.keys()
