"""Services (WL-5a): long-running model servers, deployed until undeployed.

A service is placed like a job — labels (`require`/`prefer`), free resources, specific GPUs
(SC-5), and the labels of its secrets — but it holds no claim slot: the placement loop assigns
pending services to nodes (one transaction each, the chosen node's row locked as a job batch
locks it, so the two never over-commit a node), and from then on it holds its resources and
GPUs there (`scheduling.free_capacity` counts them) until it is undeployed.

The node's agent learns what to run from `sync` (`POST /api/v1/agent/services/sync`, every few
seconds): it reports what its runtime worker runs — state, port, restarts, last exit, new events,
the tail of the output — and gets back the services assigned to it, with their secrets' values
for its process only. A service not in that answer (undeployed, or placed elsewhere) is stopped
by the agent. Its URL is built from the address the control plane saw the agent connect from,
or the agent's `MODELFORGE_AGENT_SERVICE_HOST`.

A service whose node goes offline is placed again on another matching node; when the old node
comes back its agent no longer finds it in the answer and stops it, so it is not run twice.
`generation` grows with each restart asked for; the agent restarts a service whose generation
changed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NoReturn

from pydantic import TypeAdapter, ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.artifacts.store import reference_artifacts
from control_plane.catalog import catalog as models_catalog
from control_plane.clock import Clock
from control_plane.errors import Conflict, InvalidRequest, NotFound
from control_plane.fleet.liveness import Liveness
from control_plane.models import Node, Service, ServiceEvent
from control_plane.scheduling.placement import Request, Shape, free_capacity, labels_match
from control_plane.schemas import AssignedGpu
from control_plane.security import new_id
from control_plane.vault import vault as secrets_vault
from control_plane.vault.vault import Vault
from control_plane.workload_schemas import (
    AgentServiceSpec,
    AgentServicesSync,
    Instances,
    ServiceBatching,
    ServiceCreate,
    ServiceEventPublic,
    ServiceHealth,
    ServicePublic,
)

#: States in which a service holds its node's resources.
DEPLOYED = ("starting", "healthy", "unhealthy", "restarting", "failed")
_REPORTED = {"starting", "healthy", "unhealthy", "restarting", "failed"}
_LOG_TAIL = 50
#: The built-in onnx runner's readiness path (Open Inference Protocol), its health check's
#: path when none is given; the runtime worker defaults to the same.
ONNX_HEALTH_PATH = "/v2/health/ready"


def _event(session: Session, service: Service, now: datetime, kind: str, data: Any) -> None:
    session.add(
        ServiceEvent(
            service_id=service.id, seq=service.next_event_seq, at=now, kind=kind, data=data
        )
    )
    service.next_event_seq += 1


# -- the admin API's operations -----------------------------------------------------------------


def deploy(*, session: Session, clock: Clock, request: ServiceCreate) -> Service:
    runner, weights, params = request.runner, request.weights, dict(request.params)
    if request.model is not None:
        model = models_catalog.resolve(session, request.model, named_by="The service")
        weights, params = model.weights, {**model.params, **params}
        if request.command is None:
            if model.runner != "onnx":
                raise InvalidRequest(
                    f"Model {model.ref} has runner {model.runner}: the service needs a command.",
                    "Give `command` (argv, with {weights} and {port}), or name an onnx model.",
                    code="SERVICE_NEEDS_COMMAND",
                )
            runner = "onnx"
    elif weights is not None:
        reference_artifacts(session, [weights], required=True, named_by="The service")
    secrets_vault.required_labels(session, list(request.secrets), named_by="The service")
    params = _serving_params(params, request, runner)
    health = (request.health or ServiceHealth()).model_dump()
    if health["path"] is None:  # the runner's own: the onnx model server answers 404 on `/`
        health["path"] = ONNX_HEALTH_PATH if runner == "onnx" else "/"
    now = clock.now()
    service = Service(
        id=new_id("svc"),
        name=request.name,
        state="pending",
        command=list(request.command) if request.command is not None else None,
        runner=runner,
        weights=weights,
        model=request.model,
        params=params,
        env=dict(request.env),
        secrets=list(request.secrets),
        labels=dict(request.labels),
        worker_policy=request.worker_policy,
        resources=request.resources.model_dump(),
        health=health,
        restart=request.restart.model_dump(),
        restarts=0,
        generation=1,
        created_at=now,
        updated_at=now,
        next_event_seq=1,
    )
    session.add(service)
    _event(session, service, now, "state", {"state": "pending"})
    session.flush()
    return service


def _serving_params(
    params: dict[str, Any], request: ServiceCreate, runner: str | None
) -> dict[str, Any]:
    """The onnx runner's `batching` and `instances` are kept with the service's params (where
    a model's params may give them too), checked here, whichever gave them."""
    if request.batching is not None:
        params["batching"] = request.batching.model_dump()
    if request.instances is not None:
        params["instances"] = request.instances
    if runner != "onnx":  # a command (the schema refuses batching and instances beside one)
        return params
    for field, check in (
        ("batching", ServiceBatching.model_validate),
        ("instances", TypeAdapter(Instances).validate_python),
    ):
        if params.get(field) is None:
            continue
        try:
            check(params[field])
        except ValidationError as exc:
            _refuse_serving_params(field, exc)
    return params


def _refuse_serving_params(field: str, exc: ValidationError) -> NoReturn:
    problem = exc.errors()[0]
    location = [str(part) for part in problem["loc"]]
    if problem["type"] == "extra_forbidden":  # a key it was sent, never quoted back
        location[-1:] = ["<key>"]
    where = ".".join([field, *location])
    raise InvalidRequest(
        f"The service's params (or its model's) give an invalid batching or instances "
        f"({where}: {problem['msg']}).",
        "Give `batching` and `instances` with the service (docs/services.md), or register "
        "a model version with valid ones.",
        code="INVALID_SERVING_OPTIONS",
    )


def get_service(*, session: Session, service_id: str, lock: bool = False) -> Service:
    service = session.get(Service, service_id, with_for_update=lock)
    if service is None:
        raise NotFound(
            "No service with this id.",
            "List services with GET /api/v1/services.",
            code="SERVICE_NOT_FOUND",
        )
    return service


def list_services(*, session: Session, state: str | None, limit: int) -> list[Service]:
    query = select(Service).order_by(Service.created_at.desc(), Service.id).limit(limit)
    if state:
        query = query.where(Service.state == state)
    return list(session.scalars(query))


def list_events(*, session: Session, service_id: str, after: int, limit: int) -> list[ServiceEvent]:
    get_service(session=session, service_id=service_id)
    return list(
        session.scalars(
            select(ServiceEvent)
            .where(ServiceEvent.service_id == service_id, ServiceEvent.seq > after)
            .order_by(ServiceEvent.seq)
            .limit(limit)
        )
    )


def restart(*, session: Session, clock: Clock, service_id: str) -> Service:
    service = get_service(session=session, service_id=service_id, lock=True)
    if service.state == "stopped":
        raise Conflict(
            "This service was undeployed.",
            "Deploy it again with POST /api/v1/services.",
            code="SERVICE_STOPPED",
        )
    now = clock.now()
    service.generation += 1
    service.updated_at = now
    _event(session, service, now, "restart", {"requested": True, "generation": service.generation})
    return service


def undeploy(*, session: Session, clock: Clock, service_id: str) -> Service:
    service = get_service(session=session, service_id=service_id, lock=True)
    if service.state == "stopped":
        return service  # undeploying twice changes nothing
    now = clock.now()
    service.state = "stopped"
    service.stopped_at = service.updated_at = now
    service.url = service.grpc_url = None
    _event(session, service, now, "state", {"state": "stopped", "reason": "undeployed"})
    return service


def service_public(service: Service, waiting_reason: dict[str, str] | None = None) -> ServicePublic:
    return ServicePublic(
        service_id=service.id,
        name=service.name,
        state=service.state,
        node_id=service.node_id if service.state != "stopped" else None,
        url=service.url,
        grpc_url=service.grpc_url,
        restarts=service.restarts,
        last_exit=service.last_exit,
        gpus=[AssignedGpu.model_validate(gpu) for gpu in service.assigned_gpus or []],
        command=service.command,
        runner=service.runner,
        weights=service.weights,
        model=service.model,
        labels=service.labels,
        worker_policy=service.worker_policy,
        resources=service.resources,
        health=service.health,
        restart=service.restart,
        env=service.env,
        secrets=list(service.secrets or []),
        generation=service.generation,
        created_at=service.created_at,
        updated_at=service.updated_at,
        stopped_at=service.stopped_at,
        waiting_reason=waiting_reason,
        log_tail=list(service.log_tail or []),
        batching=(service.params or {}).get("batching") if service.runner == "onnx" else None,
        instances=(service.params or {}).get("instances") if service.runner == "onnx" else None,
    )


def event_public(event: ServiceEvent) -> ServiceEventPublic:
    return ServiceEventPublic(seq=event.seq, at=event.at, kind=event.kind, data=event.data)


# -- placement ----------------------------------------------------------------------------------


def shape_of(session: Session, service: Service) -> Shape:
    required = secrets_vault.required_labels(
        session, list(service.secrets or []), named_by=f"Service {service.name}"
    )
    return Shape.of(service.labels, service.worker_policy, service.resources, required)


def place_pending(*, session_factory: Any, clock: Clock, liveness: Liveness) -> int:
    """Give each pending service a node (oldest first), and put back in `pending` the services
    whose node went offline. One transaction per service; returns how many were placed."""
    with session_factory.begin() as session:
        _replace_lost(session, clock, liveness)
    placed = 0
    with session_factory() as session:
        pending = list(
            session.scalars(
                select(Service.id)
                .where(Service.state == "pending")
                .order_by(Service.created_at)
                .limit(100)
            )
        )
    for service_id in pending:
        with session_factory.begin() as session:
            placed += _place_one(session, clock, liveness, service_id)
    return placed


def _replace_lost(session: Session, clock: Clock, liveness: Liveness) -> None:
    now = clock.now()
    rows = session.execute(
        select(Service.id, Service.node_id, Node.last_heartbeat_at)
        .outerjoin(Node, Node.id == Service.node_id)
        .where(Service.node_id.is_not(None), Service.state.in_(DEPLOYED))
    ).all()
    for service_id, node_id, last in rows:
        if node_id is None:
            continue
        gone = last is None and session.get(Node, node_id) is None
        if not gone and liveness.state_of(node_id, last, now) != "offline":
            continue
        service = session.get(Service, service_id, with_for_update=True)
        if service is None or service.node_id != node_id or service.state not in DEPLOYED:
            continue
        service.state, service.node_id, service.assigned_gpus, service.url = (
            "pending",
            None,
            None,
            None,
        )
        service.grpc_url = None
        service.updated_at = now
        why = "its node was deleted" if gone else "its node went offline"
        data = {"state": "pending", "reason": why, "node_id": node_id}
        _event(session, service, now, "state", data)


def _place_one(session: Session, clock: Clock, liveness: Liveness, service_id: str) -> int:
    service = session.get(Service, service_id, with_for_update=True)
    if service is None or service.state != "pending":
        return 0
    try:
        shape = shape_of(session, service)
    except (NotFound, InvalidRequest):
        return 0  # a secret is missing: the waiting reason says so; it waits
    now = clock.now()
    nodes = session.execute(
        select(Node.id, Node.labels, Node.inventory, Node.compat_code, Node.last_heartbeat_at)
        .where(Node.inventory.is_not(None), Node.compat_code.is_(None))
        .order_by(Node.id)
    ).all()
    online = [
        row
        for row in nodes
        if liveness.state_of(row.id, row.last_heartbeat_at, now) == "online"
        and shape.admits(dict(row.labels or {}))
    ]
    carrying = [row for row in online if labels_match(shape.labels, dict(row.labels or {}))]
    others = [row for row in online if row not in carrying] if shape.prefer else []
    request = Request.of(service.resources)
    for row in carrying + others:
        # The node's row lock: a job batch holding it finishes first, then its jobs count.
        session.execute(select(Node.id).where(Node.id == row.id).with_for_update())
        free = free_capacity(session, {row.id: row.inventory})[row.id]
        if not free.fits(request):
            continue
        gpus = free.pick_gpus(request)
        service.state, service.node_id, service.assigned_gpus = "starting", row.id, gpus
        service.placed_at = service.updated_at = now
        _event(
            session, service, now, "state", {"state": "starting", "node_id": row.id, "gpus": gpus}
        )
        return 1
    return 0


def waiting_reason(session: Session, service: Service, explain: Any) -> dict[str, str] | None:
    if service.state != "pending":
        return None
    try:
        shape = shape_of(session, service)
    except (NotFound, InvalidRequest) as exc:
        return {"code": exc.code, "message": exc.message, "next_step": exc.next_step}
    return dict(explain(shape).model_dump())


# -- the agents' sync ---------------------------------------------------------------------------


def sync(
    *,
    session: Session,
    clock: Clock,
    vault: Vault,
    node_id: str,
    carried: dict[str, Any],
    seen_host: str,
    body: AgentServicesSync,
) -> list[AgentServiceSpec]:
    """Record what the node reports of its services; answer with the services it must run."""
    now = clock.now()
    host = body.service_host or seen_host
    reported = {status.service_id: status for status in body.services}
    rows = (
        list(
            session.scalars(
                select(Service)
                .where(Service.id.in_(list(reported)))
                .order_by(Service.id)
                .with_for_update()
            )
        )
        if reported
        else []
    )
    for service in rows:
        status = reported[service.id]
        if service.node_id != node_id or service.state not in DEPLOYED:
            continue  # no longer this node's: the answer leaves it out and the agent stops it
        for event in status.events:
            _event(session, service, event.at or now, event.kind, event.data)
        if status.generation != service.generation:
            continue  # a restart asked for is on its way
        if status.state in _REPORTED and status.state != service.state:
            service.state = status.state
            _event(session, service, now, "state", {"state": status.state})
        service.restarts = status.restarts
        service.last_exit = status.last_exit
        service.log_tail = status.log_tail[-_LOG_TAIL:]
        service.url = _url(host, status.port) if status.port else None
        service.grpc_url = _address(host, status.grpc_port) if status.grpc_port else None
        service.updated_at = now
    desired = []
    for service in session.scalars(
        select(Service)
        .where(Service.node_id == node_id, Service.state.in_(DEPLOYED))
        .order_by(Service.created_at)
    ):
        values = secrets_vault.values_for(session, vault, list(service.secrets or []), carried)
        if values is None:
            if service.state != "failed":
                service.state, service.updated_at = "failed", now
                _event(
                    session,
                    service,
                    now,
                    "error",
                    {
                        "code": "SECRET_NOT_PERMITTED",
                        "message": "the node's signed credential does not carry the labels of "
                        "the service's secrets, or a secret was deleted; undeploy it and "
                        "deploy it again",
                    },
                )
            continue
        desired.append(
            AgentServiceSpec(
                service_id=service.id,
                generation=service.generation,
                name=service.name,
                command=service.command,
                runner=service.runner,
                weights=service.weights,
                params=service.params,
                env=service.env,
                secrets=values,
                assigned_gpus=[AssignedGpu.model_validate(g) for g in service.assigned_gpus or []],
                resources=service.resources,
                health=service.health,
                restart=service.restart,
            )
        )
    return desired


def _url(host: str, port: int) -> str:
    return f"http://{_address(host, port)}"


def _address(host: str, port: int) -> str:
    """`host:port`, as HTTP URLs and gRPC clients take it."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"{host}:{port}"


def deployed_counts(session: Session) -> dict[str, int]:
    """Services by state, for the metrics."""
    counts: dict[str, int] = {}
    for (state,) in session.execute(select(Service.state)):
        counts[state] = counts.get(state, 0) + 1
    return counts
