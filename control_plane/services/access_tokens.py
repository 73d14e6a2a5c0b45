"""A service's access tokens (issue 27): the bearer tokens that open one service at the gateway.

A token is `mfs_` and 43 URL-safe characters, shown once when it is minted and kept only as its
SHA-256 digest (and a short hint, to tell tokens apart in lists); it is never logged, echoed in
an error or shown in `repr()`. A token may carry a rate (requests per second, a token bucket of
`burst`), which the gateway enforces per control-plane process (`gateway/auth.py`). Revoking is
for good. `verify` is the one check of a presented token: it finds the row by the digest and
compares the digests in constant time; a revoked token, or one of an undeployed service, opens
nothing.
"""

from __future__ import annotations

import hmac
import math
import secrets
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.db import rowcount
from control_plane.errors import Conflict, InvalidRequest, NotFound
from control_plane.models import Service, ServiceAccessToken
from control_plane.security import new_id, sha256_hex
from control_plane.services.lifecycle import get_service
from control_plane.services.schemas import AccessTokenCreate, AccessTokenPublic

TOKEN_PREFIX = "mfs_"  # noqa: S105 - a prefix, not a secret
#: The characters of a token a list shows: its prefix and 6 of its 43 random ones.
HINT_LENGTH = 10
#: Unrevoked tokens one service may have at once.
MAX_ACTIVE_TOKENS = 100
#: Longer than any token: a presented value past this is not hashed, just refused.
_MAX_PRESENTED = 200


def new_access_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)  # 32 bytes: 43 characters


@dataclass(frozen=True)
class MintedAccessToken:
    row: ServiceAccessToken
    #: Returned to the caller once, never stored.
    token: str = field(repr=False)


@dataclass(frozen=True)
class Grant:
    """What a verified token opens: one service, at its rate and its LLM tokens per minute
    (None: unlimited)."""

    service_id: str
    service_name: str
    token_id: str
    rate_per_second: float | None
    burst: int | None
    tokens_per_minute: int | None = None


def mint(
    *, session: Session, clock: Clock, service_id: str, actor: str, request: AccessTokenCreate
) -> MintedAccessToken:
    service = get_service(session=session, service_id=service_id, lock=True)
    if service.state == "stopped":
        raise Conflict(
            "This service was undeployed; an access token would open nothing.",
            "Deploy it again with POST /api/v1/services and mint a token for the new service.",
            code="SERVICE_STOPPED",
        )
    active = session.scalar(
        select(func.count())
        .select_from(ServiceAccessToken)
        .where(ServiceAccessToken.service_id == service.id, ServiceAccessToken.revoked_at.is_(None))
    )
    if (active or 0) >= MAX_ACTIVE_TOKENS:
        raise Conflict(
            f"This service has {MAX_ACTIVE_TOKENS} access tokens that are not revoked, the most "
            "it may have.",
            "Revoke tokens no longer used (DELETE /api/v1/services/{id}/access-tokens/"
            "{token_id}; the list shows each one's last_used_at), then mint again.",
            code="TOO_MANY_ACCESS_TOKENS",
        )
    rate, burst = request.rate_per_second, request.burst
    if burst is not None and rate is None:
        raise InvalidRequest(
            "burst is given without rate_per_second.",
            "Give rate_per_second too (requests per second), or neither for no limit.",
            code="INVALID_REQUEST",
        )
    if rate is not None and burst is None:
        burst = max(1, math.ceil(rate))  # a second's worth
    token = new_access_token()
    row = ServiceAccessToken(
        id=new_id("stk"),
        service_id=service.id,
        name=request.name,
        token_hash=sha256_hex(token),
        hint=token[:HINT_LENGTH],
        rate_per_second=rate,
        burst=burst,
        tokens_per_minute=request.tokens_per_minute,
        created_at=clock.now(),
        created_by=actor[:64],
    )
    session.add(row)
    session.flush()
    return MintedAccessToken(row, token)


def list_tokens(*, session: Session, service_id: str) -> list[ServiceAccessToken]:
    """Newest first, the revoked ones included."""
    get_service(session=session, service_id=service_id)
    return list(
        session.scalars(
            select(ServiceAccessToken)
            .where(ServiceAccessToken.service_id == service_id)
            .order_by(ServiceAccessToken.created_at.desc(), ServiceAccessToken.id)
        )
    )


def revoke(*, session: Session, clock: Clock, service_id: str, token_id: str) -> ServiceAccessToken:
    """Revoked for good; revoking again changes nothing (the first `revoked_at` stays). The
    gateway stops taking it within its cache's second."""
    get_service(session=session, service_id=service_id)
    row = session.get(ServiceAccessToken, token_id)
    if row is None or row.service_id != service_id:
        raise NotFound(
            "This service has no access token with this id.",
            "List its tokens with GET /api/v1/services/{id}/access-tokens.",
            code="ACCESS_TOKEN_NOT_FOUND",
        )
    session.execute(
        update(ServiceAccessToken)
        .where(ServiceAccessToken.id == token_id, ServiceAccessToken.revoked_at.is_(None))
        .values(revoked_at=clock.now())
        .execution_options(synchronize_session=False)
    )
    session.refresh(row)
    return row


def verify(session: Session, presented: str) -> Grant | None:
    """The grant of a presented token, or None: unknown, revoked, or its service undeployed.
    The row is found by the digest (an index), and the digests compared in constant time."""
    if not presented.startswith(TOKEN_PREFIX) or len(presented) > _MAX_PRESENTED:
        return None
    digest = sha256_hex(presented)
    found = session.execute(
        select(ServiceAccessToken, Service.name, Service.state)
        .join(Service, Service.id == ServiceAccessToken.service_id)
        .where(ServiceAccessToken.token_hash == digest)
    ).first()
    if found is None:
        return None
    row, service_name, service_state = found
    if not hmac.compare_digest(row.token_hash, digest):
        return None
    if row.revoked_at is not None or service_state == "stopped":
        return None
    return Grant(
        service_id=row.service_id,
        service_name=service_name,
        token_id=row.id,
        rate_per_second=row.rate_per_second,
        burst=row.burst,
        tokens_per_minute=row.tokens_per_minute,
    )


def record_use(session: Session, last_used: dict[str, datetime]) -> int:
    """Write each token's last use (token id -> when), never moving one back; the gateway
    gathers them in memory and hands them here in batches, off the request path."""
    changed = 0
    for token_id, at in last_used.items():
        result = session.execute(
            update(ServiceAccessToken)
            .where(
                ServiceAccessToken.id == token_id,
                (ServiceAccessToken.last_used_at.is_(None))
                | (ServiceAccessToken.last_used_at < at),
            )
            .values(last_used_at=at)
            .execution_options(synchronize_session=False)
        )
        changed += rowcount(result)
    return changed


def token_public(row: ServiceAccessToken) -> AccessTokenPublic:
    return AccessTokenPublic(
        id=row.id,
        service_id=row.service_id,
        name=row.name,
        hint=row.hint,
        rate_per_second=row.rate_per_second,
        burst=row.burst,
        tokens_per_minute=row.tokens_per_minute,
        created_at=row.created_at,
        created_by=row.created_by,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
    )
