"""Which process holds which node's tunnel (`gateway_tunnels`): where several control-plane
replicas serve, each records the tunnels its `TunnelHub` holds (`tunnels.py`), so that a gateway
on another replica finds the holder and forwards a stream through it (`peers.py`). Blocking: the
hub runs these on a thread, off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock
from control_plane.db import dialect_insert
from control_plane.models import GatewayTunnel


@dataclass(frozen=True)
class HolderRecord:
    """Where this process says which tunnels it holds: `holder` (its id), reached by the other
    replicas at `address` (empty: it cannot be, though its row still says it holds them)."""

    holder: str
    address: str
    session_factory: sessionmaker[Session]
    clock: Clock

    def opened(self, node_id: str) -> None:
        with self.session_factory.begin() as session:
            record_holder(
                session,
                node_id=node_id,
                holder=self.holder,
                address=self.address,
                at=self.clock.now(),
            )

    def closed(self, node_id: str) -> None:
        with self.session_factory.begin() as session:
            forget_holder(session, node_id=node_id, holder=self.holder)

    def closed_all(self) -> None:
        with self.session_factory.begin() as session:
            session.execute(delete(GatewayTunnel).where(GatewayTunnel.holder == self.holder))


def record_holder(
    session: Session, *, node_id: str, holder: str, address: str, at: datetime
) -> None:
    """Say in `gateway_tunnels` that process `holder` (reached at `address`) holds the tunnel:
    one upsert, so two processes recording the same node at once both succeed (the later wins)."""
    values = {"node_id": node_id, "holder": holder, "holder_address": address, "connected_at": at}
    changed = {"holder": holder, "holder_address": address, "connected_at": at}
    session.execute(
        dialect_insert(session, GatewayTunnel)
        .values(values)
        .on_conflict_do_update(index_elements=[GatewayTunnel.node_id], set_=changed)
    )


def forget_holder(session: Session, *, node_id: str, holder: str) -> None:
    """The row goes, unless another process holds the node's tunnel by now."""
    session.execute(
        delete(GatewayTunnel).where(
            GatewayTunnel.node_id == node_id, GatewayTunnel.holder == holder
        )
    )
