"""The agents' services sync (`POST /api/v1/agent/services/sync`, every few seconds).

The node's agent reports what its runtime worker runs — state, port, restarts, last exit, new
events, the tail of the output — and gets back the replicas placed on it, with their services'
secrets' values for its process only. Each spec carries the service's id and name and the
replica's id (`replica_id`), which the agent runs it by and reports it by (an agent from before
replicas reports by the service's id: its first replica on the node is meant). A replica not in
that answer (undeployed, or placed elsewhere) is stopped by the agent. A replica listens on its
node's loopback address, reached through the agent's tunnel, unless the node turned direct access
on by naming its `MODELFORGE_AGENT_SERVICE_HOST`: only then does it get a URL (at that host),
or when its agent connects from the control plane's own machine (over loopback), where the
replica answers at that loopback address.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.fleet.schemas import AssignedGpu
from control_plane.models import Service, ServiceReplica
from control_plane.services import replicas, rollout
from control_plane.services._changes import DEPLOYED, record_event
from control_plane.services.schemas import LLM_RUNNERS, AgentServiceSpec, AgentServicesSync
from control_plane.vault import vault as secrets_vault
from control_plane.vault.vault import Vault

#: The states an agent may report of a service it runs.
_REPORTED = {"starting", "healthy", "unhealthy", "restarting", "failed"}
#: The replicas a node runs: those deployed, and draining ones finishing their requests.
_RUN = (*DEPLOYED, "draining")
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
    """Record what the node reports of its replicas; answer with the replicas it must run."""
    now = clock.now()
    host = body.service_host or (seen_host if _loopback(seen_host) else None)
    held = _held_here(session, node_id)
    by_id = {replica.id: (service, replica) for service, replica in held}
    # An agent from before replicas reports by the service's id: its first replica here.
    first_of: dict[str, tuple[Service, ServiceReplica]] = {}
    for service, replica in held:
        first_of.setdefault(service.id, (service, replica))
    touched: dict[str, Service] = {}
    for status in body.services:
        found = by_id.get(status.service_id) or first_of.get(status.service_id)
        if found is None:
            continue  # no longer this node's: the answer leaves it out and the agent stops it
        service, replica = found
        touched[service.id] = service
        for event in status.events:
            record_event(
                session, service, event.at or now, event.kind, event.data, replica_id=replica.id
            )
        if status.in_flight is not None and replica.state == "draining":
            rollout.record_in_flight(replica, status.in_flight, now)
        if status.generation != service.generation:
            continue  # a restart asked for is on its way
        # A draining replica stays out of the rotation whatever it reports (`rollout`).
        if status.state in _REPORTED and replica.state not in (status.state, "draining"):
            replicas.set_state(session, service, replica, now, status.state)
        replica.restarts = status.restarts
        replica.last_exit = status.last_exit
        replica.log_tail = status.log_tail[-_LOG_TAIL:]
        replica.url = _url(host, status.port) if status.port and host else None
        replica.grpc_url = _address(host, status.grpc_port) if status.grpc_port and host else None
        replica.engine = None if status.engine is None else status.engine.model_dump()
        replica.updated_at = service.updated_at = now
    desired = []
    # Each replica runs its own revision's spec (a rollout runs two side by side).
    specs = rollout.revision_specs(session, {(s.id, r.revision) for s, r in held})
    for service, replica in held:
        spec = specs.get((service.id, replica.revision)) or rollout.spec_of(service)
        values = secrets_vault.values_for(session, vault, list(spec["secrets"] or []), carried)
        if values is None:
            if replica.state != "failed":
                replicas.set_state(session, service, replica, now, "failed")
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
                    replica_id=replica.id,
                )
                touched[service.id] = service
            continue
        desired.append(
            AgentServiceSpec(
                service_id=service.id,
                replica_id=replica.id,
                generation=service.generation,
                name=service.name,
                command=spec["command"],
                runner=spec["runner"],
                weights=spec["weights"],
                params=spec["params"],
                env=spec["env"],
                secrets=values,
                assigned_gpus=[AssignedGpu.model_validate(g) for g in replica.assigned_gpus or []],
                resources=spec["resources"],
                health=spec["health"],
                restart=spec["restart"],
                draining=replica.state == "draining",
                engine_load=spec["runner"] in LLM_RUNNERS,
            )
        )
    copies = replicas.by_service(session, touched)
    for service_id, service in touched.items():
        replicas.summarise(session, service, now, copies[service_id])
    return desired


def _held_here(session: Session, node_id: str) -> list[tuple[Service, ServiceReplica]]:
    """The replicas placed on `node_id` (their services' oldest first, then by ordinal), their
    services' rows locked, in id order, before the replicas are read again under the locks."""
    service_ids = sorted(
        set(
            session.scalars(
                select(ServiceReplica.service_id).where(
                    ServiceReplica.node_id == node_id, ServiceReplica.state.in_(_RUN)
                )
            )
        )
    )
    if not service_ids:
        return []
    services = {
        service.id: service
        for service in session.scalars(
            select(Service)
            .where(Service.id.in_(service_ids))
            .order_by(Service.id)
            .with_for_update()
        )
    }
    rows = session.scalars(
        select(ServiceReplica)
        .where(
            ServiceReplica.node_id == node_id,
            ServiceReplica.state.in_(_RUN),
            ServiceReplica.service_id.in_(list(services)),
        )
        .order_by(ServiceReplica.ordinal)
    )
    held = [(services[replica.service_id], replica) for replica in rows]
    held.sort(key=lambda pair: (pair[0].created_at, pair[0].id, pair[1].ordinal))
    return held


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _url(host: str, port: int) -> str:
    return f"http://{_address(host, port)}"


def _address(host: str, port: int) -> str:
    """`host:port`, as HTTP URLs and gRPC clients take it."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"{host}:{port}"
