"""The agents' services sync (`POST /api/v1/agent/services/sync`, every few seconds).

The node's agent reports what its runtime worker runs — state, port, restarts, last exit, new
events, the tail of the output — and gets back the services assigned to it, with their secrets'
values for its process only. A service not in that answer (undeployed, or placed elsewhere) is
stopped by the agent. Its URL is built from the address the control plane saw the agent
connect from, or the agent's `MODELFORGE_AGENT_SERVICE_HOST`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.fleet.schemas import AssignedGpu
from control_plane.models import Service
from control_plane.services._changes import DEPLOYED, record_event
from control_plane.services.schemas import AgentServiceSpec, AgentServicesSync
from control_plane.vault import vault as secrets_vault
from control_plane.vault.vault import Vault

#: The states an agent may report of a service it runs.
_REPORTED = {"starting", "healthy", "unhealthy", "restarting", "failed"}
#: The lines of a service's output kept from its agent's last report.
_LOG_TAIL = 50


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
            record_event(session, service, event.at or now, event.kind, event.data)
        if status.generation != service.generation:
            continue  # a restart asked for is on its way
        if status.state in _REPORTED and status.state != service.state:
            service.state = status.state
            record_event(session, service, now, "state", {"state": status.state})
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
                record_event(
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
