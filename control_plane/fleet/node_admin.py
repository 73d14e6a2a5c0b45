"""An administrator's changes to a node: deleting it, and revoking its credentials.

Both revoke through the one credential authority, so the node's waiting claims and watches end
once the transaction commits; each is one call for its admin route."""

from __future__ import annotations

from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.fleet.credentials import CredentialAuthority
from control_plane.fleet.heartbeats import HeartbeatBuffer
from control_plane.fleet.nodes import delete_node, get_node, record_event


def remove_node(
    *,
    session: Session,
    authority: CredentialAuthority,
    heartbeats: HeartbeatBuffer,
    node_id: str,
) -> None:
    """Delete a node: its credentials revoked first, and a heartbeat it sent that was not yet
    flushed dropped, so nothing brings it back."""
    get_node(session=session, node_id=node_id)
    authority.revoke_for_node(session, node_id=node_id, reason="node deleted")
    delete_node(session=session, node_id=node_id)
    heartbeats.discard(node_id)


def revoke_node_credentials(
    *, session: Session, clock: Clock, authority: CredentialAuthority, node_id: str
) -> int:
    """Revoke every active credential of the node, recorded as one of its events; how many."""
    get_node(session=session, node_id=node_id)
    revoked = authority.revoke_for_node(
        session, node_id=node_id, reason="revoked by an administrator"
    )
    record_event(
        session,
        node_id=node_id,
        at=clock.now(),
        kind="credential_revoked",
        reason=f"{len(revoked)} credential(s) revoked by an administrator",
    )
    return len(revoked)
