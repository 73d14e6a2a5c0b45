"""Services as users see them: deploy, get, list, restart, undeploy, their events and their
public views.

A deployed service runs `replicas` copies (`replicas`), each `pending` until the placement
loop gives it a node (`placement`); it is never deleted: undeploying it stops it and all its
replicas (`stopped`) and keeps its record and events. `generation` grows with each restart asked
for; the agents restart every replica whose generation changed.
"""

from __future__ import annotations

from typing import Any, NoReturn

from pydantic import TypeAdapter, ValidationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from control_plane.artifacts.store import reference_artifacts
from control_plane.catalog import catalog
from control_plane.clock import Clock
from control_plane.errors import Conflict, InvalidRequest, NotFound
from control_plane.events import events_after
from control_plane.fleet.schemas import AssignedGpu
from control_plane.models import Service, ServiceEvent, ServiceReplica
from control_plane.security import new_id
from control_plane.services import aliases, replicas
from control_plane.services._changes import record_event
from control_plane.services.schemas import (
    LLM_RUNNERS,
    Instances,
    ServiceBatching,
    ServiceCreate,
    ServiceEventPublic,
    ServiceHealth,
    ServiceLlm,
    ServicePublic,
)
from control_plane.vault import vault

#: The built-in onnx runner's readiness path (Open Inference Protocol), its health check's
#: path when none is given; the runtime worker defaults to the same.
ONNX_HEALTH_PATH = "/v2/health/ready"
#: Each runner's health path when none is given (llama-server: 200 once its model is loaded).
HEALTH_PATHS = {"onnx": ONNX_HEALTH_PATH, "llama.cpp": "/health"}
#: The runners a service (or a model it names) may run without a command.
RUNNERS = frozenset(HEALTH_PATHS)


def deploy(*, session: Session, clock: Clock, request: ServiceCreate) -> Service:
    """A new service and its pending replicas. Its name is the gateway's address for it, so no
    other deployed (not `stopped`) service may hold it (409 `SERVICE_NAME_TAKEN`)."""
    taken = _holder_of(session, request.name) or aliases.holder_of(session, request.name)
    if taken is not None:
        raise _name_taken(request.name, taken)
    spec = resolve_spec(session=session, request=request)
    autoscale = request.autoscale.model_dump() if request.autoscale is not None else None
    count = request.replicas
    if autoscale is not None:  # starts within its bounds (at 1 when its min is 0)
        count = max(autoscale["min"], min(autoscale["max"], count))
    now = clock.now()
    service = Service(
        id=new_id("svc"),
        name=request.name,
        state="pending",
        **spec,
        restarts=0,
        generation=1,
        replicas=count,
        revision=1,
        autoscale=autoscale,
        created_at=now,
        updated_at=now,
        next_event_seq=1,
    )
    try:
        # The row before its replicas' (their foreign key); two deploys of one name at once:
        # the partial unique index (migration 0016) lets one win.
        with session.begin_nested():
            session.add(service)
    except IntegrityError:
        raise _name_taken(request.name, _holder_of(session, request.name)) from None
    aliases.claim(session, service, request.aliases)
    replicas.start(session, service, now)
    record_event(session, service, now, "state", {"state": "pending"})
    session.flush()
    return service


def _holder_of(session: Session, name: str) -> str | None:
    """The id of the deployed service named `name`, if one is."""
    return session.scalar(
        select(Service.id).where(Service.name == name, Service.state != "stopped").limit(1)
    )


def _name_taken(name: str, holder: str | None) -> Conflict:
    which = f"service {holder}" if holder else "another service"
    undeploy = f"DELETE /api/v1/services/{holder or '<its id>'}"
    return Conflict(
        f"The name {name} is taken by {which}, which is deployed (as its name or an alias): "
        "the gateway reaches a service by its name, so two deployed services may not share one.",
        f"Undeploy {which} ({undeploy}) first, or deploy this one under another name.",
        code="SERVICE_NAME_TAKEN",
    )


def resolve_spec(*, session: Session, request: ServiceCreate) -> dict[str, Any]:
    """What a replica of `request` runs (`replicas.REVISION_FIELDS`): its model resolved to
    weights, params and runner, its weights and secrets checked, its health path the runner's
    own when not given. Raises what a deploy of it would."""
    runner: str | None = request.runner
    weights, params = request.weights, dict(request.params)
    if request.model is not None:
        model = catalog.resolve(session, request.model, named_by="The service")
        weights, params = model.weights, {**model.params, **params}
        if request.command is None:
            if model.runner not in RUNNERS:
                raise InvalidRequest(
                    f"Model {model.ref} has runner {model.runner}: the service needs a command.",
                    "Give `command` (argv, with {weights} and {port}), or name a model of "
                    "runner onnx or llama.cpp.",
                    code="SERVICE_NEEDS_COMMAND",
                )
            runner = model.runner
    elif weights is not None:
        reference_artifacts(session, [weights], required=True, named_by="The service")
    vault.required_labels(session, list(request.secrets), named_by="The service")
    params = _serving_params(params, request, runner)
    health = (request.health or ServiceHealth()).model_dump()
    if health["path"] is None:  # the runner's own: the onnx model server answers 404 on `/`
        health["path"] = HEALTH_PATHS.get(runner or "", "/")
    return {
        "command": list(request.command) if request.command is not None else None,
        "runner": runner,
        "weights": weights,
        "model": request.model,
        "params": params,
        "env": dict(request.env),
        "secrets": list(request.secrets),
        "labels": dict(request.labels),
        "worker_policy": request.worker_policy,
        "resources": request.resources.model_dump(),
        "health": health,
        "restart": request.restart.model_dump(),
    }


def _serving_params(
    params: dict[str, Any], request: ServiceCreate, runner: str | None
) -> dict[str, Any]:
    """The onnx runner's `batching` and `instances` are kept with the service's params (where
    a model's params may give them too), checked here, whichever gave them."""
    if request.batching is not None:
        params["batching"] = request.batching.model_dump()
    if request.instances is not None:
        params["instances"] = request.instances
    if runner in LLM_RUNNERS:  # the engine's options, each default filled in
        if request.llm is not None:
            params["llm"] = request.llm.model_dump()
        try:
            params["llm"] = ServiceLlm.model_validate(params.get("llm") or {}).model_dump()
        except ValidationError as exc:
            _refuse_serving_params("llm", exc)
        return params
    if request.llm is not None:  # a model that named another runner
        raise InvalidRequest(
            f"The service gives `llm` but runs {runner or 'a command'}.",
            "Give `llm` only with runner llama.cpp (docs/llm.md).",
            code="INVALID_SERVING_OPTIONS",
        )
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
        f"The service's params (or its model's) give an invalid batching, instances or llm "
        f"({where}: {problem['msg']}).",
        "Give `batching`, `instances` or `llm` with the service (docs/services.md, "
        "docs/llm.md), or register "
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
    return events_after(
        session, ServiceEvent, ServiceEvent.service_id, service_id, after=after, limit=limit
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
    record_event(
        session, service, now, "restart", {"requested": True, "generation": service.generation}
    )
    return service


def undeploy(*, session: Session, clock: Clock, service_id: str) -> Service:
    service = get_service(session=session, service_id=service_id, lock=True)
    if service.state == "stopped":
        return service  # undeploying twice changes nothing
    now = clock.now()
    service.state = "stopped"
    service.stopped_at = service.updated_at = now
    replicas.stop_all(session, service, now)
    aliases.release(session, service)
    record_event(session, service, now, "state", {"state": "stopped", "reason": "undeployed"})
    return service


def service_public(
    service: Service,
    copies: list[ServiceReplica],
    waiting_reason: dict[str, str] | None = None,
    names: list[str] | None = None,
) -> ServicePublic:
    """The service's view from its row and its replicas (`replicas.of_service`)."""
    shown = replicas.representative(copies)
    return ServicePublic(
        service_id=service.id,
        name=service.name,
        state=service.state,
        node_id=shown.node_id if shown else None,
        url=shown.url if shown else None,
        grpc_url=shown.grpc_url if shown else None,
        restarts=sum(copy.restarts for copy in copies),
        last_exit=shown.last_exit if shown else None,
        gpus=[
            AssignedGpu.model_validate(gpu)
            for gpu in ((shown.assigned_gpus or []) if shown else [])
        ],
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
        log_tail=list(shown.log_tail or []) if shown else [],
        batching=(service.params or {}).get("batching") if service.runner == "onnx" else None,
        instances=(service.params or {}).get("instances") if service.runner == "onnx" else None,
        llm=(service.params or {}).get("llm") if service.runner in LLM_RUNNERS else None,
        aliases=names or [],
        desired_replicas=service.replicas,
        replicas=[replicas.replica_public(copy) for copy in copies if copy.state != "stopped"],
        revision=service.revision,
        autoscale=service.autoscale,
        rollout=service.rollout,
        last_request_at=service.last_request_at,
    )


def event_public(event: ServiceEvent) -> ServiceEventPublic:
    return ServiceEventPublic(
        seq=event.seq, at=event.at, kind=event.kind, data=event.data, replica_id=event.replica_id
    )
