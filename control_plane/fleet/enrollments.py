"""Enrollment tokens: mint, list, revoke, and the atomic claim.

The claim is decided by one conditional UPDATE: the row count picks the single winner,
never a read followed by a write; a revoke is the same kind of conditional UPDATE, so a claim and
a revoke racing for one token end with exactly one of them applied. Tokens and claim nonces are
stored only as SHA-256 hashes, and no object here shows a token or credential in `repr()`.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock
from control_plane.db import rowcount
from control_plane.errors import (
    Conflict,
    EnrollmentRefused,
    EnrollmentTokenGone,
    EnrollmentTokenUsed,
    NotFound,
    ServiceUnavailable,
)
from control_plane.fleet.credentials import CredentialAuthority
from control_plane.fleet.nodes import fingerprint_hash, record_event
from control_plane.models import Node, NodeCredential, NodeEnrollment
from control_plane.security import new_enrollment_token, new_id, sha256_hex


def enrollment_state(enrollment: NodeEnrollment, now: datetime) -> str:
    if enrollment.state == "pending" and enrollment.expires_at <= now:
        return "expired"
    return enrollment.state


@dataclass(frozen=True)
class MintedEnrollment:
    enrollment: NodeEnrollment
    #: Returned to the caller once, never stored.
    token: str = field(repr=False)


def mint_enrollment(
    *,
    session: Session,
    clock: Clock,
    display_name: str,
    expires_in_seconds: int,
    labels: dict[str, str],
    production_eligible: bool,
) -> MintedEnrollment:
    """Create a pending enrollment and reserve its node ID."""
    now = clock.now()
    token = new_enrollment_token()
    enrollment = NodeEnrollment(
        id=new_id("enr"),
        node_id=new_id("node"),
        display_name=display_name,
        labels=dict(labels),
        token_hash=sha256_hex(token),
        state="pending",
        production_eligible=production_eligible,
        created_at=now,
        expires_at=now + timedelta(seconds=expires_in_seconds),
    )
    session.add(enrollment)
    session.flush()
    return MintedEnrollment(enrollment, token)


def list_enrollments(*, session: Session) -> list[NodeEnrollment]:
    return list(session.scalars(select(NodeEnrollment).order_by(NodeEnrollment.created_at.desc())))


def get_enrollment(*, session: Session, enrollment_id: str) -> NodeEnrollment:
    enrollment = session.get(NodeEnrollment, enrollment_id)
    if enrollment is None:
        raise NotFound(
            "No enrollment with this id.",
            "List enrollments with GET /api/v1/admin/node-enrollments.",
            code="ENROLLMENT_NOT_FOUND",
        )
    return enrollment


def revoke_enrollment(*, session: Session, clock: Clock, enrollment_id: str) -> NodeEnrollment:
    """An unused token becomes unclaimable; a used one is refused.

    The conditional UPDATE decides against a claim racing this revoke (on PostgreSQL it waits
    for the claim's transaction and then re-checks the state): whichever commits first wins, and
    the loser is judged by the state read after the UPDATE, in the same transaction.
    """
    enrollment = get_enrollment(session=session, enrollment_id=enrollment_id)
    result = session.execute(
        update(NodeEnrollment)
        .where(NodeEnrollment.id == enrollment_id, NodeEnrollment.state == "pending")
        .values(state="revoked", revoked_at=clock.now())
        .execution_options(synchronize_session=False)
    )
    revoked_now = rowcount(result) == 1
    session.refresh(enrollment)
    if not revoked_now and enrollment.state == "claimed":
        raise Conflict(
            "This enrollment token was already used to enroll a node; revoking it changes nothing.",
            f"Revoke the node's credential instead: POST /api/v1/admin/nodes/"
            f"{enrollment.node_id}/credential/revoke.",
            code="ENROLLMENT_ALREADY_CLAIMED",
        )
    return enrollment  # revoked now, or by an earlier revoke


@dataclass(frozen=True)
class ClaimResult:
    node_id: str
    credential: str = field(repr=False)
    labels: dict[str, str] = field(default_factory=dict)


def claim_enrollment(
    *,
    session_factory: sessionmaker[Session],
    clock: Clock,
    authority: CredentialAuthority,
    token: str,
    claim_nonce: str,
    hostname: str,
    agent_version: str,
    protocol_version: int,
    fingerprint: dict[str, Any] | None,
) -> ClaimResult:
    token_hash = sha256_hex(token)
    nonce_hash = sha256_hex(claim_nonce)
    now = clock.now()
    with session_factory.begin() as session:
        won = session.execute(
            update(NodeEnrollment)
            .where(
                NodeEnrollment.token_hash == token_hash,
                NodeEnrollment.state == "pending",
                NodeEnrollment.expires_at > now,
            )
            .values(state="claimed", claimed_at=now, claim_nonce_hash=nonce_hash)
        )
        if rowcount(won) == 1:
            enrollment = session.scalars(
                select(NodeEnrollment).where(NodeEnrollment.token_hash == token_hash)
            ).one()
            return _create_node(
                session=session,
                clock=clock,
                authority=authority,
                enrollment=enrollment,
                hostname=hostname,
                agent_version=agent_version,
                protocol_version=protocol_version,
                fingerprint=fingerprint,
            )
    with session_factory.begin() as session:
        found = session.scalars(
            select(NodeEnrollment).where(NodeEnrollment.token_hash == token_hash).with_for_update()
        ).one_or_none()
        if found is None:
            raise EnrollmentRefused(
                "This enrollment token is not known to this control plane.",
                "Check that the agent points at the control plane that minted the token, or mint "
                "a new token (POST /api/v1/admin/node-enrollments).",
                code="ENROLLMENT_TOKEN_UNKNOWN",
            )
        enrollment = found
        if enrollment.state == "revoked":
            raise EnrollmentTokenGone(
                "This enrollment token was revoked by an administrator.",
                "Mint a new enrollment token and start the agent with it.",
                code="ENROLLMENT_TOKEN_REVOKED",
            )
        if enrollment.state == "claimed":
            same_claimant = enrollment.claim_nonce_hash is not None and hmac.compare_digest(
                enrollment.claim_nonce_hash, nonce_hash
            )
            node = session.get(Node, enrollment.node_id) if same_claimant else None
            if node is not None and not _has_active_credential(session, node.id):
                raise EnrollmentTokenUsed(
                    "This enrollment token was already used, and the credential of the node it "
                    "enrolled was revoked since; a retry cannot bring it back.",
                    "Mint a new enrollment token for this host and start the agent with it.",
                    code="ENROLLMENT_TOKEN_USED",
                )
            if node is not None:
                # The claimant lost our answer; give it the same identity again, with a
                # fresh credential (the one we sent before is revoked by `issue`). The token's
                # expiry does not matter here: it bounds who may claim, and this claim was won
                # before it.
                credential = authority.issue(session, node_id=node.id, labels=node.labels)
                record_event(
                    session,
                    node_id=node.id,
                    at=now,
                    kind="credential_reissued",
                    reason="the claimant retried its enrollment with the same claim nonce",
                )
                return ClaimResult(node.id, credential, dict(node.labels))
            raise EnrollmentTokenUsed(
                "This enrollment token was already used to enroll a node.",
                "Enrollment tokens are single-use: mint a new one for this host. If this host is "
                "the node that used it, restore its state volume instead.",
                code="ENROLLMENT_TOKEN_USED",
            )
        if enrollment.expires_at <= now:
            raise EnrollmentTokenGone(
                "This enrollment token has expired.",
                "Mint a new enrollment token and start the agent with it before it expires.",
                code="ENROLLMENT_TOKEN_EXPIRED",
            )
    raise ServiceUnavailable(
        "The enrollment could not be completed because of a concurrent change.",
        "Retry the enrollment with the same claim nonce.",
        code="ENROLLMENT_RETRY",
    )


def _has_active_credential(session: Session, node_id: str) -> bool:
    return (
        session.scalar(
            select(NodeCredential.jti).where(
                NodeCredential.node_id == node_id, NodeCredential.revoked_at.is_(None)
            )
        )
        is not None
    )


def _create_node(
    *,
    session: Session,
    clock: Clock,
    authority: CredentialAuthority,
    enrollment: NodeEnrollment,
    hostname: str,
    agent_version: str,
    protocol_version: int,
    fingerprint: dict[str, Any] | None,
) -> ClaimResult:
    now = clock.now()
    fp_hash = fingerprint_hash(fingerprint)
    node = Node(
        id=enrollment.node_id,
        enrollment_id=enrollment.id,
        display_name=enrollment.display_name,
        hostname=hostname,
        labels=dict(enrollment.labels),
        created_at=now,
        recorded_state="offline",
        agent_version=agent_version,
        protocol_version=protocol_version,
        fingerprint_hash=fp_hash,
    )
    session.add(node)
    session.flush()
    record_event(
        session,
        node_id=node.id,
        at=now,
        kind="enrolled",
        reason=f"enrolled from host {hostname!r} with agent {agent_version}",
    )
    if fp_hash is not None:
        others = list(
            session.scalars(
                select(Node.id).where(Node.fingerprint_hash == fp_hash, Node.id != node.id)
            )
        )
        for other in others:
            for subject, peer in ((node.id, other), (other, node.id)):
                record_event(
                    session,
                    node_id=subject,
                    at=now,
                    kind="duplicate_identity",
                    reason=f"node {peer} has the same machine fingerprint",
                )
    credential = authority.issue(session, node_id=node.id, labels=node.labels)
    return ClaimResult(node.id, credential, dict(node.labels))
