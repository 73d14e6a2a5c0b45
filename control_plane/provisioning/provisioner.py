"""The provisioning loop (PV-1): asks Slurm for node agents when work waits for a profile.

Every few seconds, in a thread, never holding a transaction across an SSH call:

- **demand**: a queued job or pending service waits (its waiting reason is one a new node would
  answer: no node with its labels, none online, none large enough, no room) and a profile carries
  its labels and has the resources it asks for → a request for that profile, unless one is
  outstanding (`submitting`/`pending`: a partial unique index keeps it to one per profile across
  replicas), one attached less than `_SETTLING` ago (its node may not look online yet where the
  waiting reasons are read), or the profile's last request failed less than a minute ago.
- **submit**: in one transaction a node is created for the agent-to-be (labels = the profile's)
  with a credential the provisioner issues, valid 24 h (CR-3); then over SSH the credential goes
  to a 0600 file on the cluster and `sbatch` gets the job script (control_plane.provisioning.slurm).
- **attach**: the request's node reported (a heartbeat) → `attached`.
- **ended early**: a pending request's Slurm job ended without its agent attaching (a `prerun`
  that failed, a node that failed to boot, an operator's scancel) → `failed` at once, its state
  and the tail of its output in its events, rather than holding the profile's one outstanding
  request until `provision_timeout_s` (or for ever, with `0`). Asked of squeue (sacct for the
  jobs it no longer lists) at most every `_JOB_CHECK_S` per provisioner, only while requests
  are pending.
- **timeout**: not attached within `provision_timeout_s` → `scancel`, `cancelled`, its credential
  revoked and its node forgotten.
- **idle**: an attached node without running jobs or deployed services for `max_idle_s` → its
  credential revoked, `scancel` (the agent gets SIGTERM and exits, the Slurm job ends),
  `released`, its node forgotten. `0` disables either limit.
- **shutdown**: requests not attached yet are cancelled.

Every SSH call's outcome is an event of its request: the command (never a secret), the exit code
and the tail of its stderr.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from anyio import to_thread
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock
from control_plane.fleet.credentials import PROVISIONER_LIFETIME, CredentialAuthority
from control_plane.fleet.liveness import Liveness
from control_plane.models import (
    Job,
    Node,
    NodeEnrollment,
    ProvisionEvent,
    ProvisionRequest,
    ServiceReplica,
)
from control_plane.provisioning import slurm
from control_plane.provisioning.config import Profile, SlurmProvisioner
from control_plane.provisioning.demand import needs_a_node, serves, waiting_shapes
from control_plane.scheduling.waiting import Fleet, explain
from control_plane.security import new_id, sha256_hex

log = logging.getLogger(__name__)
INTERVAL_S = 2.0
OUTSTANDING = ("submitting", "pending")
_RETRY_AFTER_FAILURE = timedelta(seconds=60)
#: How long a request that attached still counts as busy. Its round attaches it from the node's
#: live heartbeat, but the waiting reasons come from the scheduler's fleet view, up to
#: `fleet_view.MAX_AGE_SECONDS` old (and on another replica the heartbeat reaches the database
#: only at its next flush, up to a second): there the node may still look offline, a reason a
#: new node would answer, and a second node would be asked for. Its agent then reports its
#: inventory and claims the work within a few seconds.
_SETTLING = timedelta(seconds=10)
#: How often, at most, one provisioner's pending Slurm jobs are checked (one SSH call, two when
#: some left squeue); on the control plane's monotonic clock.
_JOB_CHECK_S = 10.0


@dataclass(frozen=True)
class _Wanted:
    provisioner: SlurmProvisioner
    profile: Profile
    why: str


class Provisioner:
    def __init__(
        self,
        *,
        provisioners: list[SlurmProvisioner],
        session_factory: sessionmaker[Session],
        clock: Clock,
        authority: CredentialAuthority,
        liveness: Callable[[], Liveness],
        fleet: Callable[[Session], Fleet],
    ) -> None:
        self.provisioners = {p.name: p for p in provisioners}
        self._session_factory = session_factory
        self._clock = clock
        self._authority = authority
        self._liveness = liveness
        self._fleet = fleet
        self._task: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        #: When each provisioner's pending jobs were last asked of Slurm (clock.monotonic).
        self._checked: dict[str, float] = {}

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> None:
        if self.provisioners and self._task is None:
            self._task = asyncio.create_task(self._run(), name="provisioning")

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        await to_thread.run_sync(self.cancel_outstanding, "the control plane is shutting down")

    async def _run(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(INTERVAL_S)
            try:
                await to_thread.run_sync(self.tick)
                failures = 0
            except Exception:
                failures += 1
                if failures in (1, 10, 100, 1000):
                    log.exception("provisioning round failed (%d in a row)", failures)

    def tick(self) -> None:
        """One round: attach, time out, release, then ask for what is wanted."""
        with self._lock:
            self._attach()
            self._fail_ended()
            self._time_out()
            self._release_idle()
            for wanted in self._wanted():
                self._request(wanted)

    # -- rounds -----------------------------------------------------------------------------

    def _attach(self) -> None:
        now = self._clock.now()
        liveness = self._liveness()
        with self._session_factory.begin() as session:
            rows = session.execute(
                select(ProvisionRequest, Node.last_heartbeat_at)
                .join(Node, Node.id == ProvisionRequest.node_id)
                .where(ProvisionRequest.state == "pending")
            ).all()
            for request, stored in rows:
                if liveness.last_seen(request.node_id or "", stored) is None:
                    continue
                request.state, request.attached_at, request.updated_at = "attached", now, now
                _event(session, request, now, "state", {"state": "attached"})

    def _fail_ended(self) -> None:
        """Fail the pending requests whose Slurm job ended before its agent attached."""
        with self._session_factory() as session:
            pending: dict[str, dict[str, str]] = {}
            for row in session.scalars(
                select(ProvisionRequest).where(
                    ProvisionRequest.state == "pending", ProvisionRequest.slurm_job_id.is_not(None)
                )
            ):
                if row.provisioner in self.provisioners and row.slurm_job_id is not None:
                    pending.setdefault(row.provisioner, {})[row.slurm_job_id] = row.id
        now = self._clock.monotonic()
        for name, requests in pending.items():
            if now - self._checked.get(name, -math.inf) < _JOB_CHECK_S:
                continue
            self._checked[name] = now
            provisioner = self.provisioners[name]
            states, failed = slurm.job_states(provisioner, sorted(requests))
            for outcome in failed:  # on the requests it was about: the operator sees why
                for request_id in requests.values():
                    self._record(request_id, "ssh", outcome.event())
            for job_id, state in states.items():
                if not state.ended:
                    continue
                request_id = requests[job_id]
                output = slurm.output_tail(provisioner, request_id)
                self._record(
                    request_id,
                    "slurm",
                    {"job": job_id, "state": state.state, "detail": state.detail, "output": output},
                )
                self._end(
                    request_id,
                    "failed",
                    f"its Slurm job {job_id} ended {state.describe()} before its agent attached "
                    "(the tail of its output is in the request's events)",
                    only_from="pending",
                    job_ended=True,
                )

    def _time_out(self) -> None:
        now = self._clock.now()
        with self._session_factory() as session:
            late = [
                (row.id, row.provisioner)
                for row in session.scalars(
                    select(ProvisionRequest).where(ProvisionRequest.state.in_(OUTSTANDING))
                )
                if (p := self.provisioners.get(row.provisioner)) is not None
                and p.provision_timeout_s > 0
                and now - row.created_at >= timedelta(seconds=p.provision_timeout_s)
            ]
        for request_id, name in late:
            timeout = self.provisioners[name].provision_timeout_s
            self._end(request_id, "cancelled", f"did not attach within {timeout:g} s")

    def _release_idle(self) -> None:
        now = self._clock.now()
        with self._session_factory() as session:
            idle = []
            for request in session.scalars(
                select(ProvisionRequest).where(ProvisionRequest.state == "attached")
            ):
                provisioner = self.provisioners.get(request.provisioner)
                if provisioner is None or provisioner.max_idle_s <= 0 or request.node_id is None:
                    continue
                since = _idle_since(session, request)
                if since is not None and now - since >= timedelta(seconds=provisioner.max_idle_s):
                    idle.append((request.id, provisioner.max_idle_s))
        for request_id, limit in idle:
            self._end(request_id, "released", f"idle for {limit:g} s", only_if_idle=True)

    def cancel_outstanding(self, reason: str) -> None:
        with self._session_factory() as session:
            ids = list(
                session.scalars(
                    select(ProvisionRequest.id).where(ProvisionRequest.state.in_(OUTSTANDING))
                )
            )
        for request_id in ids:
            self._end(request_id, "cancelled", reason)

    # -- demand -----------------------------------------------------------------------------

    def _wanted(self) -> list[_Wanted]:
        now = self._clock.now()
        with self._session_factory() as session:
            busy = {
                (row.provisioner, row.profile)
                for row in session.execute(
                    select(ProvisionRequest.provisioner, ProvisionRequest.profile).where(
                        ProvisionRequest.state.in_(OUTSTANDING)
                        | (
                            (ProvisionRequest.state == "attached")
                            & (ProvisionRequest.attached_at > now - _SETTLING)
                        )
                        | (
                            (ProvisionRequest.state == "failed")
                            & (ProvisionRequest.ended_at > now - _RETRY_AFTER_FAILURE)
                        )
                    )
                )
            }
            shapes = waiting_shapes(session)
            if not shapes:
                return []
            fleet = self._fleet(session)
        wanted: dict[tuple[str, str], _Wanted] = {}
        for shape in shapes:
            reason = explain(fleet, shape)
            if not needs_a_node(reason.code):
                continue
            for provisioner in self.provisioners.values():
                for profile in provisioner.profiles:
                    key = (provisioner.name, profile.name)
                    if key in busy or key in wanted or not serves(profile, shape):
                        continue
                    wanted[key] = _Wanted(provisioner, profile, reason.message)
        return list(wanted.values())

    # -- one request ------------------------------------------------------------------------

    def _request(self, wanted: _Wanted) -> None:
        provisioner, profile = wanted.provisioner, wanted.profile
        now = self._clock.now()
        request_id = new_id("prq")
        try:
            with self._session_factory.begin() as session:
                node_id, credential = self._new_node(session, provisioner, profile, request_id)
                request = ProvisionRequest(
                    id=request_id,
                    provisioner=provisioner.name,
                    profile=profile.name,
                    state="submitting",
                    node_id=node_id,
                    created_at=now,
                    updated_at=now,
                )
                session.add(request)
                session.flush()
                _event(session, request, now, "state", {"state": "submitting", "why": wanted.why})
        except IntegrityError:
            return  # another replica's request for this profile is outstanding
        log.info("provisioning: requesting a node of %s/%s", provisioner.name, profile.name)
        identity = {
            "node_id": node_id,
            "control_plane_url": provisioner.engine_url.rstrip("/"),
            "credential": credential,
        }
        put = slurm.put_credential(provisioner, request_id, identity)
        self._record(request_id, "ssh", put.event())
        if not put.ok:
            self._end(request_id, "failed", f"writing the credential file failed ({put.exit_code})")
            return
        submitted = slurm.submit(provisioner, profile, request_id)
        self._record(request_id, "ssh", submitted.event())
        job_id = slurm.parse_job_id(submitted.stdout) if submitted.ok else None
        if job_id is None:
            slurm.remove_credential(provisioner, request_id)
            self._end(request_id, "failed", f"sbatch failed ({submitted.exit_code})")
            return
        with self._session_factory.begin() as session:
            row = session.get(ProvisionRequest, request_id, with_for_update=True)
            if row is None or row.state != "submitting":
                cancel_after = True  # cancelled meanwhile (shutdown): the job must go too
            else:
                cancel_after = False
                row.state, row.slurm_job_id, row.updated_at = "pending", job_id, self._clock.now()
                _event(session, row, row.updated_at, "state", {"state": "pending", "job": job_id})
        if cancel_after:
            self._record(request_id, "ssh", slurm.cancel(provisioner, job_id).event())

    def _new_node(
        self, session: Session, provisioner: SlurmProvisioner, profile: Profile, request_id: str
    ) -> tuple[str, str]:
        """A node for the agent the request starts, and its 24 h credential."""
        now = self._clock.now()
        node_id = new_id("node")
        enrollment = NodeEnrollment(
            id=new_id("enr"),
            node_id=node_id,
            display_name=f"{provisioner.name}/{profile.name} ({request_id})"[:120],
            labels=dict(profile.labels),
            # No token exists for it: the hash of a random value no one holds.
            token_hash=sha256_hex(secrets.token_hex(32)),
            state="claimed",
            production_eligible=False,
            created_at=now,
            expires_at=now,
            claimed_at=now,
        )
        session.add(enrollment)
        session.flush()
        session.add(
            Node(
                id=node_id,
                enrollment_id=enrollment.id,
                display_name=enrollment.display_name,
                hostname=f"slurm:{provisioner.name}",
                labels=dict(profile.labels),
                created_at=now,
                recorded_state="offline",
            )
        )
        session.flush()
        credential = self._authority.issue(
            session,
            node_id=node_id,
            labels=dict(profile.labels),
            lifetime=PROVISIONER_LIFETIME,
            issuer="provisioner",
        )
        return node_id, credential

    def _end(
        self,
        request_id: str,
        state: str,
        reason: str,
        *,
        only_if_idle: bool = False,
        only_from: str | None = None,
        job_ended: bool = False,
    ) -> None:
        """End a request: its credential revoked and its node forgotten (one transaction),
        then its Slurm job cancelled and its credential file removed (SSH, outside it). With
        `only_from`, only a request still in that state (another replica may have moved it);
        with `job_ended`, its Slurm job is known to have ended: nothing to cancel."""
        now = self._clock.now()
        with self._session_factory.begin() as session:
            request = session.get(ProvisionRequest, request_id, with_for_update=True)
            if request is None or request.state in ("released", "cancelled", "failed"):
                return
            if only_from is not None and request.state != only_from:
                return
            if request.node_id is not None:
                # The node's row lock: a job batch placing work there finishes first.
                node = session.get(Node, request.node_id, with_for_update=True)
                if only_if_idle and node is not None and _idle_since(session, request) is None:
                    return  # work arrived meanwhile
                self._authority.revoke_for_node(
                    session, node_id=request.node_id, reason=f"provision request {state}: {reason}"
                )
                if node is not None:
                    session.delete(node)
            was = request.state
            request.state, request.reason, request.ended_at, request.updated_at = (
                state,
                reason,
                now,
                now,
            )
            _event(session, request, now, "state", {"state": state, "reason": reason})
            job_id, name = request.slurm_job_id, request.provisioner
        log.info("provisioning: request %s %s (%s)", request_id, state, reason)
        provisioner = self.provisioners.get(name)
        if provisioner is None:
            return
        if job_id is not None and not job_ended:
            self._record(request_id, "ssh", slurm.cancel(provisioner, job_id).event())
        # A request that failed before sbatch took its job has no file left; one whose job ended
        # unattached may (the job never started, or failed before taking the file).
        if was in OUTSTANDING and (state != "failed" or job_id is not None):
            self._record(
                request_id, "ssh", slurm.remove_credential(provisioner, request_id).event()
            )

    def _record(self, request_id: str, kind: str, data: dict[str, Any]) -> None:
        with self._session_factory.begin() as session:
            session.add(
                ProvisionEvent(request_id=request_id, at=self._clock.now(), kind=kind, data=data)
            )

    # -- for the API and the metrics --------------------------------------------------------

    def outstanding(self, session: Session) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = dict.fromkeys(
            ((p.name, profile.name) for p in self.provisioners.values() for profile in p.profiles),
            0,
        )
        for provisioner, profile, count in session.execute(
            select(ProvisionRequest.provisioner, ProvisionRequest.profile, func.count())
            .where(ProvisionRequest.state.in_(OUTSTANDING))
            .group_by(ProvisionRequest.provisioner, ProvisionRequest.profile)
        ):
            counts[(provisioner, profile)] = int(count)
        return counts


def _event(session: Session, request: ProvisionRequest, at: datetime, kind: str, data: Any) -> None:
    session.add(ProvisionEvent(request_id=request.id, at=at, kind=kind, data=data))


def _idle_since(session: Session, request: ProvisionRequest) -> datetime | None:
    """Since when the request's node has had no running job and no deployed service; None
    while it has some."""
    node_id = request.node_id
    busy = (
        session.execute(
            select(Job.id).where(Job.node_id == node_id, Job.state == "running").limit(1)
        ).first()
        or session.execute(
            select(ServiceReplica.id)
            .where(ServiceReplica.node_id == node_id, ServiceReplica.state != "stopped")
            .limit(1)
        ).first()
    )
    if busy is not None:
        return None
    last_job = session.execute(
        select(func.max(Job.finished_at)).where(Job.node_id == node_id)
    ).scalar_one_or_none()
    since = request.attached_at or request.created_at
    return max(since, last_job) if last_job is not None else since
