"""Rolling updates and replica counts (issue 27): what a change of a deployed service does.

- `change` (`PATCH /api/v1/services/{id}`): a change of what a replica runs (its model, weights,
  command, params, env, secrets, labels, resources, health, restart, serving settings) makes a
  new `service_revisions` row and starts a rollout to it; a change of `replicas` or `autoscale`
  alone only scales (`scale`). One rollout at a time (409 `ROLLOUT_IN_PROGRESS`); a change of
  `autoscale` alone is taken while one runs, its bounds applied to the count when it ends.
- A rollout from revision N to N+1 surges: `replicas` new replicas of N+1 start at once (room
  for them is needed beside the old ones); the old ones keep serving meanwhile. Once every new
  one is healthy and warm (`ready_at`), the old ones are drained (the gateway sends them no new
  request; those in flight finish) and stopped after the drain period. A new replica that fails
  (`failed`, `unhealthy`, restarted) or is not warm by the deadline stops the rollout: the new
  replicas are stopped, the service goes back to revision N, the old ones never stopped
  serving. `advance` (the rollout loop, every second) takes each step; `Service.rollout` shows
  the last rollout (`running`, `succeeded`, `failed` with its `reason`, `cancelled`) and each
  step is a `rollout` event.
- A draining replica's `stopped_at` is when it began draining (it left the rotation then); it
  is `stopped` once the drain period has passed since, or sooner, once its agent reports no
  request in flight to it through the tunnel (`in_flight`, reported while the sync's spec says
  `draining`) in two reports in a row, the first received `DRAIN_SETTLE_SECONDS` or more after
  it left the rotation (`record_in_flight`, `idle`).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.errors import Conflict, InvalidRequest
from control_plane.models import Service, ServiceEvent, ServiceReplica, ServiceRevision
from control_plane.security import new_id
from control_plane.services import aliases, lifecycle, replicas
from control_plane.services._changes import record_event
from control_plane.services.schemas import LLM_RUNNERS, ServiceCreate, ServiceUpdate

#: A new replica in one of these states (or restarted once) fails its rollout.
_FAILING = ("failed", "unhealthy", "restarting")
#: States of a replica that no longer takes part in its service's count.
_RETIRED = ("stopped", "draining")
#: Fields of an update that only scale.
_SCALING = ("replicas", "autoscale")
#: Fields of an update that change only where calls go (no rollout).
_ROUTING = ("aliases",)
#: How long after a replica left the rotation a gateway may still choose it: the routing table
#: a request reads is at most 2 s old (`gateway/routing.RoutingTable.max_age`), plus a second
#: for the request to reach the node's tunnel.
DRAIN_SETTLE_SECONDS = 3.0


def in_progress(service: Service) -> bool:
    return bool(service.rollout) and (service.rollout or {}).get("state") == "running"


def spec_of(service: Service) -> dict[str, Any]:
    """What a replica of `service`'s current revision runs (its columns)."""
    return {field: getattr(service, field) for field in replicas.REVISION_FIELDS}


def change(
    *, session: Session, clock: Clock, service_id: str, request: ServiceUpdate, deadline: float
) -> Service:
    """Apply `request` to the service: a new revision and its rollout when what runs changes
    (`deadline` seconds for the new replicas to get warm), a new count when only that does."""
    service = lifecycle.get_service(session=session, service_id=service_id, lock=True)
    if service.state == "stopped":
        raise Conflict(
            "This service was undeployed.",
            "Deploy it again with POST /api/v1/services.",
            code="SERVICE_STOPPED",
        )
    given = request.model_fields_set
    spec = lifecycle.resolve_spec(session=session, request=_merged(service, request))
    changes = spec != spec_of(service)
    if in_progress(service) and (changes or "replicas" in given):
        raise Conflict(
            f"A rollout to revision {service.rollout['to']} is under way."
            if service.rollout
            else "A rollout is under way.",
            "Wait for it to end (GET /api/v1/services/{id}: `rollout`), then send the change.",
            code="ROLLOUT_IN_PROGRESS",
        )
    now = clock.now()
    if "aliases" in given:
        before = aliases.by_service(session, [service.id]).get(service.id, [])
        after = sorted(aliases.claim(session, service, request.aliases or []))
        if after != before:
            record_event(session, service, now, "aliases", {"from": before, "to": after})
    if "autoscale" in given:
        autoscale = request.autoscale.model_dump() if request.autoscale else None
        if autoscale != service.autoscale:
            service.autoscale = autoscale
            record_event(session, service, now, "autoscale", {"settings": autoscale})
    service.updated_at = now
    if in_progress(service):
        # `autoscale` alone (anything else was refused above): its bounds apply when the
        # rollout ends (`_end`), as the autoscaler's do; scaling now could retire the new
        # revision's replicas before they are warm.
        return service
    want = _bounded(service, request.replicas if request.replicas is not None else None)
    if want != service.replicas:
        record_event(session, service, now, "scale", {"from": service.replicas, "to": want})
    if changes:
        service.replicas = want  # the new revision runs the new count
        _start(session, service, now, spec, deadline)
    elif want != service.replicas:
        scale(session, service, now, want)
    return service


def _bounded(service: Service, count: int | None) -> int:
    """`count` (None: the service's `replicas`) within its autoscale bounds, if it has them."""
    want = service.replicas if count is None else count
    if service.autoscale:
        want = max(int(service.autoscale["min"]), min(int(service.autoscale["max"]), want))
    return want


def _merged(service: Service, request: ServiceUpdate) -> ServiceCreate:
    """The service's request as if deployed now with `request`'s fields: what it gives replaces
    what the service had; a new model (or weights) brings its own params unless given."""
    given = request.model_fields_set
    params = dict(service.params or {})
    body: dict[str, Any] = {
        "name": service.name,
        "command": service.command,
        "runner": service.runner,
        "weights": None if service.model else service.weights,
        "model": service.model,
        "labels": service.labels,
        "worker_policy": service.worker_policy,
        "resources": service.resources,
        "health": service.health,
        "restart": service.restart,
        "env": service.env,
        "secrets": list(service.secrets or []),
    }
    if service.runner == "onnx":
        body["batching"] = params.pop("batching", None)
        body["instances"] = params.pop("instances", None)
    if service.runner in LLM_RUNNERS:
        body["llm"] = params.pop("llm", None)
    body["params"] = params
    if given & {"model", "weights"}:
        body.update(model=None, weights=None, params={}, batching=None, instances=None)
    if given & {"command", "runner"}:
        body.update(command=None, runner=None, batching=None, instances=None, llm=None)
        body["health"] = {**service.health, "path": None}  # the new runner's own
    for name in given - set(_SCALING) - set(_ROUTING):
        value = getattr(request, name)
        body[name] = value.model_dump() if hasattr(value, "model_dump") else value
    # `batching` or `instances` given to a service that runs a command is refused below, never
    # dropped (beside a `command` in the change itself the schema refuses them, as on deploy).
    try:
        return ServiceCreate.model_validate(body)
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"]) or "the service"
        raise InvalidRequest(
            f"With this change the service would be invalid ({where}: {problem['msg']}).",
            "Send the fields that go together (e.g. `runner` with `weights` or `model`, "
            "`command` without `batching` or `llm`); docs/services.md, Rolling updates.",
            code="INVALID_SERVICE_UPDATE",
        ) from None


def _start(
    session: Session, service: Service, now: datetime, spec: dict[str, Any], deadline: float
) -> None:
    """Revision N+1 with `spec`, and its replicas (none while scaled to zero: done at once)."""
    latest = session.scalar(
        select(func.max(ServiceRevision.revision)).where(ServiceRevision.service_id == service.id)
    )
    old, new = service.revision, max(int(latest or 0), service.revision) + 1
    session.add(ServiceRevision(service_id=service.id, revision=new, spec=spec, created_at=now))
    for field, value in spec.items():
        setattr(service, field, value)
    service.revision = new
    record = {"from": old, "to": new, "started_at": now.isoformat(), "reason": None}
    if service.replicas == 0:  # scaled to zero: its next replica runs the new revision
        scale(session, service, now, 0)
        service.rollout = {**record, "state": "succeeded", "ended_at": now.isoformat()}
        record_event(session, service, now, "rollout", {"state": "succeeded", **_ends(old, new)})
        return
    ends = now + timedelta(seconds=deadline)
    service.rollout = {**record, "state": "running", "deadline": ends.isoformat()}
    record_event(
        session,
        service,
        now,
        "rollout",
        {"state": "running", "replicas": service.replicas, **_ends(old, new)},
    )
    session.add_all(
        ServiceReplica(
            id=new_id("rep"),
            service_id=service.id,
            ordinal=ordinal,
            revision=new,
            state="pending",
            restarts=0,
            created_at=now,
            updated_at=now,
        )
        for ordinal in range(service.replicas)
    )


def _ends(old: int, new: int) -> dict[str, int]:
    return {"from": old, "to": new}


def scale(session: Session, service: Service, now: datetime, want: int) -> None:
    """Run `want` replicas of the service's revision: new ones `pending` (the lowest free
    ordinals), extra ones retired (those not serving first, then the highest ordinals)."""
    service.replicas = want
    copies = replicas.of_service(session, service.id)
    live = [copy for copy in copies if copy.state not in _RETIRED]
    if len(live) < want:
        used = {copy.ordinal for copy in live}
        free = (ordinal for ordinal in range(want + len(used)) if ordinal not in used)
        added = [
            ServiceReplica(
                id=new_id("rep"),
                service_id=service.id,
                ordinal=next(free),
                revision=service.revision,
                state="pending",
                restarts=0,
                created_at=now,
                updated_at=now,
            )
            for _ in range(want - len(live))
        ]
        session.add_all(added)
        copies += added
    else:
        # Retired first: those not serving, then the highest ordinals (the lowest stay, as a
        # service's ordinals count up from 0).
        live.sort(key=lambda copy: (copy.state == "healthy", -copy.ordinal))
        for copy in live[: len(live) - want]:
            retire(session, service, copy, now, "scaled down")
    replicas.summarise(session, service, now, copies)


def retire(
    session: Session, service: Service, replica: ServiceReplica, now: datetime, why: str
) -> None:
    """Take `replica` out of the service's count: drained first when it serves, else stopped."""
    if replica.state == "healthy" and replica.node_id is not None:
        replicas.set_state(session, service, replica, now, "draining", reason=why)
        replica.stopped_at = now  # when it left the rotation; stopped after the drain
        return
    _stop(session, service, replica, now, why)


def _stop(
    session: Session, service: Service, replica: ServiceReplica, now: datetime, why: str
) -> None:
    replicas.set_state(session, service, replica, now, "stopped", reason=why)
    replica.stopped_at = now
    replica.url = replica.grpc_url = None


def advance(*, session_factory: Any, clock: Clock, drain_seconds: float) -> int:
    """The rollout loop's round: each running rollout's next step, and draining replicas past
    their drain period stopped. One transaction per service; returns how many changed."""
    with session_factory() as session:
        running = set(
            session.scalars(
                select(Service.id).where(Service.rollout.is_not(None), Service.state != "stopped")
            )
        )
        draining = set(
            session.scalars(
                select(ServiceReplica.service_id).where(ServiceReplica.state == "draining")
            )
        )
    changed = 0
    for service_id in sorted(running | draining):
        with session_factory.begin() as session:
            changed += _advance_one(session, clock, service_id, drain_seconds)
    return changed


def _advance_one(session: Session, clock: Clock, service_id: str, drain_seconds: float) -> int:
    service = session.get(Service, service_id, with_for_update=True)
    if service is None:
        return 0
    now = clock.now()
    copies = replicas.of_service(session, service_id)
    changed = 0
    if in_progress(service):
        changed += _step(session, service, now, copies)
    drained = now - timedelta(seconds=drain_seconds)
    for copy in copies:
        gone = service.state == "stopped"
        if copy.state == "draining" and (gone or (copy.stopped_at or now) <= drained or idle(copy)):
            _stop(session, service, copy, now, "drained")
            changed += 1
    if changed:
        replicas.summarise(session, service, now, copies)
    return changed


def record_in_flight(replica: ServiceReplica, count: int, now: datetime) -> None:
    """A draining replica's requests in flight as its agent reported them (the sync): the
    count, when, and the first of the reports in a row that said that count once no gateway
    could still choose it (`idle` reads them)."""
    left = replica.stopped_at
    settled = None if left is None else left + timedelta(seconds=DRAIN_SETTLE_SECONDS)
    since = replica.in_flight_since
    if count != replica.in_flight or since is None or settled is None or since < settled:
        replica.in_flight_since = now
    replica.in_flight, replica.in_flight_at = count, now


def idle(replica: ServiceReplica) -> bool:
    """Whether a draining replica's agent said it has no request in flight in two reports in a
    row, the first received once no gateway can still be choosing it (`DRAIN_SETTLE_SECONDS`
    after it left the rotation): its drain is over before the drain period. Two, because a
    report is counted when it arrives, and one the agent sent again after a failed try may
    have been made before the last request came; the next is made after that one arrived."""
    left, since, last = replica.stopped_at, replica.in_flight_since, replica.in_flight_at
    if left is None or since is None or last is None or replica.in_flight != 0:
        return False
    return since >= left + timedelta(seconds=DRAIN_SETTLE_SECONDS) and last > since


def _step(session: Session, service: Service, now: datetime, copies: list[ServiceReplica]) -> int:
    record = dict(service.rollout or {})
    old, new = int(record["from"]), int(record["to"])
    fresh = [copy for copy in copies if copy.revision == new and copy.state not in _RETIRED]
    if service.state == "stopped":
        _end(session, service, now, "cancelled", "the service was undeployed")
        return 1
    failing = next((copy for copy in fresh if copy.state in _FAILING or copy.restarts > 0), None)
    if failing is not None:
        why = f"replica {failing.ordinal} of revision {new} is {failing.state}"
        if failing.restarts and failing.state not in _FAILING:
            why = f"replica {failing.ordinal} of revision {new} exited and was restarted"
        _fail(session, service, now, copies, old, new, _with_cause(session, failing, why))
        return 1
    warm = [copy for copy in fresh if copy.state == "healthy" and copy.ready_at is not None]
    if len(warm) >= service.replicas:
        for copy in copies:
            if copy.revision != new and copy.state not in _RETIRED:
                retire(session, service, copy, now, f"replaced by revision {new}")
        _end(session, service, now, "succeeded", None)
        return 1
    if now >= datetime.fromisoformat(record["deadline"]):
        why = (
            f"{len(warm)} of {service.replicas} replicas of revision {new} were healthy and "
            f"warm by the deadline"
        )
        _fail(session, service, now, copies, old, new, why)
        return 1
    return 0


def _with_cause(session: Session, replica: ServiceReplica, why: str) -> str:
    """`why`, with the replica's last error event's message (its node's words) when it has one."""
    event = session.scalars(
        select(ServiceEvent)
        .where(ServiceEvent.replica_id == replica.id, ServiceEvent.kind == "error")
        .order_by(ServiceEvent.seq.desc())
        .limit(1)
    ).first()
    message = (
        event.data.get("message") if event is not None and isinstance(event.data, dict) else None
    )
    if message:
        return f"{why}: {str(message)[:300]}"
    if replica.last_exit:
        return f"{why} (last exit {replica.last_exit})"
    return why


def _fail(
    session: Session,
    service: Service,
    now: datetime,
    copies: list[ServiceReplica],
    old: int,
    new: int,
    why: str,
) -> None:
    for copy in copies:
        if copy.revision == new and copy.state != "stopped":
            _stop(session, service, copy, now, "its rollout failed")
    previous = session.get(ServiceRevision, (service.id, old))
    if previous is not None:
        for field, value in previous.spec.items():
            setattr(service, field, value)
    service.revision = old
    _end(session, service, now, "failed", why)


def _end(session: Session, service: Service, now: datetime, state: str, why: str | None) -> None:
    """The rollout ends `state`; then the service's count is brought within autoscale bounds
    changed while it ran (a `scale` event)."""
    record = dict(service.rollout or {})
    record.update(state=state, ended_at=now.isoformat(), reason=why)
    service.rollout = record
    data = {"state": state, "from": record.get("from"), "to": record.get("to")}
    if why:
        data["reason"] = why
    record_event(session, service, now, "rollout", data)
    want = _bounded(service, None)
    if service.state != "stopped" and want != service.replicas:
        scale_data = {"from": service.replicas, "to": want, "reason": "autoscale bounds"}
        record_event(session, service, now, "scale", scale_data)
        scale(session, service, now, want)


def revision_specs(
    session: Session, keys: set[tuple[str, int]]
) -> dict[tuple[str, int], dict[str, Any]]:
    """The spec of each (service id, revision) in `keys` (one query): what a replica of that
    revision runs, whatever the service's current revision."""
    if not keys:
        return {}
    service_ids = sorted({service_id for service_id, _ in keys})
    rows = session.scalars(
        select(ServiceRevision).where(ServiceRevision.service_id.in_(service_ids))
    )
    return {
        (row.service_id, row.revision): row.spec
        for row in rows
        if (row.service_id, row.revision) in keys
    }
