"""Access tokens (issue 27): the bearer tokens that open services at the gateway, the OpenAI
API's keys. A token minted under a service opens that service (scope `service`); a key minted
on its own (`mint_key`, issue 43) opens the services it names (`services`) or every LLM service
(`llm`).

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
from control_plane.models import AccessTokenService, Service, ServiceAccessToken
from control_plane.security import new_id, sha256_hex
from control_plane.services.key_schemas import AccessTokenCreate, AccessTokenPublic, ApiKeyCreate
from control_plane.services.lifecycle import get_service

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
class MintedApiKey:
    row: ServiceAccessToken
    #: Returned to the caller once, never stored.
    token: str = field(repr=False)
    #: The ids of the services it names (scope `services`).
    services: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Grant:
    """What a verified token opens, at its rate and its LLM tokens per minute (None:
    unlimited): its one service (`service_id`, scope `service`), the services it names
    (`services`), or every LLM service (`llm`)."""

    service_id: str | None
    service_name: str | None
    token_id: str
    rate_per_second: float | None
    burst: int | None
    tokens_per_minute: int | None = None
    scope: str = "service"
    services: frozenset[str] = frozenset()

    def opens(self, service: str, kind: str = "") -> bool:
        """Whether it opens `service` (an id; a `service` token's also by its name), a
        service of `kind` (`llm`, `onnx`, `command`)."""
        if self.scope == "llm":
            return kind == "llm"
        if self.scope == "services":
            return service in self.services
        return service in (self.service_id, self.service_name)


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
    row = _new_row(
        clock=clock, actor=actor, request=request, service_id=service.id, scope="service"
    )
    session.add(row.token)
    session.flush()
    return MintedAccessToken(row.token, row.secret)


@dataclass(frozen=True)
class _NewRow:
    token: ServiceAccessToken
    secret: str = field(repr=False)


def _new_row(
    *,
    clock: Clock,
    actor: str,
    request: AccessTokenCreate | ApiKeyCreate,
    service_id: str | None,
    scope: str,
) -> _NewRow:
    """A token's row (not added yet) and the token, its limits checked."""
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
        service_id=service_id,
        scope=scope,
        name=request.name,
        token_hash=sha256_hex(token),
        hint=token[:HINT_LENGTH],
        rate_per_second=rate,
        burst=burst,
        tokens_per_minute=request.tokens_per_minute,
        created_at=clock.now(),
        created_by=actor[:64],
    )
    return _NewRow(row, token)


def mint_key(*, session: Session, clock: Clock, actor: str, request: ApiKeyCreate) -> MintedApiKey:
    """A key of no one service: it opens the services `request.services` names (ids or names
    of deployed services), or, with `request.llm_services`, every LLM service."""
    active = session.scalar(
        select(func.count())
        .select_from(ServiceAccessToken)
        .where(ServiceAccessToken.service_id.is_(None), ServiceAccessToken.revoked_at.is_(None))
    )
    if (active or 0) >= MAX_ACTIVE_TOKENS:
        raise Conflict(
            f"There are {MAX_ACTIVE_TOKENS} API keys of several services that are not revoked, "
            "the most there may be.",
            "Revoke keys no longer used (DELETE /api/v1/access-tokens/{token_id}; the list "
            "shows each one's last_used_at), then mint again.",
            code="TOO_MANY_ACCESS_TOKENS",
        )
    if request.llm_services == bool(request.services):
        raise InvalidRequest(
            "An API key opens either the services it names or every LLM service.",
            'Give services (their names or ids), or "llm_services": true, not both.',
            code="INVALID_KEY_SCOPE",
        )
    opened: list[Service] = []
    for wanted in dict.fromkeys(request.services):
        service = session.scalars(
            select(Service)
            .where((Service.id == wanted) | (Service.name == wanted), Service.state != "stopped")
            .order_by(Service.created_at.desc())
            .limit(1)
        ).first()
        if service is None:
            raise NotFound(
                f"No deployed service is named {wanted!r} (or has that id).",
                "List the services with GET /api/v1/services, and name deployed ones.",
                code="SERVICE_NOT_FOUND",
            )
        opened.append(service)
    scope = "llm" if request.llm_services else "services"
    row = _new_row(clock=clock, actor=actor, request=request, service_id=None, scope=scope)
    session.add(row.token)
    session.flush()
    for service in opened:
        session.add(AccessTokenService(token_id=row.token.id, service_id=service.id))
    session.flush()
    return MintedApiKey(row.token, row.secret, [service.id for service in opened])


def list_keys(*, session: Session) -> list[tuple[ServiceAccessToken, list[str]]]:
    """The keys of no one service, newest first (the revoked ones included), each with the
    services it names."""
    rows = list(
        session.scalars(
            select(ServiceAccessToken)
            .where(ServiceAccessToken.service_id.is_(None))
            .order_by(ServiceAccessToken.created_at.desc(), ServiceAccessToken.id)
        )
    )
    named = _named(session, [row.id for row in rows])
    return [(row, named.get(row.id, [])) for row in rows]


def revoke_key(
    *, session: Session, clock: Clock, token_id: str
) -> tuple[ServiceAccessToken, list[str]]:
    """As `revoke`, for a key of no one service."""
    row = session.get(ServiceAccessToken, token_id)
    if row is None or row.service_id is not None:
        raise NotFound(
            "There is no API key of several services with this id (a service's own token is "
            "revoked under its service).",
            "List the keys with GET /api/v1/access-tokens.",
            code="ACCESS_TOKEN_NOT_FOUND",
        )
    _revoke(session, clock, row)
    return row, _named(session, [row.id]).get(row.id, [])


def _named(session: Session, token_ids: list[str]) -> dict[str, list[str]]:
    named: dict[str, list[str]] = {}
    if token_ids:
        for token_id, service_id in session.execute(
            select(AccessTokenService.token_id, AccessTokenService.service_id)
            .where(AccessTokenService.token_id.in_(token_ids))
            .order_by(AccessTokenService.service_id)
        ):
            named.setdefault(token_id, []).append(service_id)
    return named


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
    _revoke(session, clock, row)
    return row


def _revoke(session: Session, clock: Clock, row: ServiceAccessToken) -> None:
    session.execute(
        update(ServiceAccessToken)
        .where(ServiceAccessToken.id == row.id, ServiceAccessToken.revoked_at.is_(None))
        .values(revoked_at=clock.now())
        .execution_options(synchronize_session=False)
    )
    session.refresh(row)


def verify(session: Session, presented: str) -> Grant | None:
    """The grant of a presented token, or None: unknown, revoked, or (a service's own token)
    its service undeployed. The row is found by the digest (an index), and the digests
    compared in constant time."""
    if not presented.startswith(TOKEN_PREFIX) or len(presented) > _MAX_PRESENTED:
        return None
    digest = sha256_hex(presented)
    found = session.execute(
        select(ServiceAccessToken, Service.name, Service.state)
        .outerjoin(Service, Service.id == ServiceAccessToken.service_id)
        .where(ServiceAccessToken.token_hash == digest)
    ).first()
    if found is None:
        return None
    row, service_name, service_state = found
    if not hmac.compare_digest(row.token_hash, digest):
        return None
    if row.revoked_at is not None or (row.scope == "service" and service_state == "stopped"):
        return None
    services: frozenset[str] = frozenset()
    if row.scope == "services":
        services = frozenset(
            session.scalars(
                select(AccessTokenService.service_id).where(AccessTokenService.token_id == row.id)
            )
        )
    return Grant(
        service_id=row.service_id,
        service_name=service_name,
        token_id=row.id,
        rate_per_second=row.rate_per_second,
        burst=row.burst,
        tokens_per_minute=row.tokens_per_minute,
        scope=row.scope,
        services=services,
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


def token_public(row: ServiceAccessToken, services: list[str] | None = None) -> AccessTokenPublic:
    return AccessTokenPublic(
        id=row.id,
        service_id=row.service_id,
        scope=row.scope,
        services=services or [],
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
