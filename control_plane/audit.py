"""The audit log (AU-1): every admin action — time, actor, action, target, outcome — appended,
never updated, never holding a secret value.

A route states its action with `audit(action, target, **detail)` before doing it. When the
route succeeds the entry is written in the route's own transaction (the action and its record
commit together); when it is refused, the entry is written in a transaction of its own with the
refusal's code as the outcome, since the route's transaction rolls back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock
from control_plane.models import AuditEntry

#: Actions the log records; the API filters by these names.
ACTIONS = frozenset(
    {
        "enrollment.mint",
        "enrollment.revoke",
        "node.delete",
        "node.credential.revoke",
        "gpu.quarantine",
        "gpu.readmit",
        "credential.revoke",
        "signing_key.rotate",
        "job.submit",
        "job.cancel",
        "job.delete",
        "service.deploy",
        "service.restart",
        "service.update",
        "service.undeploy",
        "service_token.create",
        "service_token.revoke",
        "access_token.create",
        "access_token.revoke",
        "model.create",
        "secret.set",
        "secret.delete",
        "secret.rotate_key",
        "artifact.sweep",
        "artifact.upload",
        "user.create",
        "user.update",
        "user.delete",
        "api_key.create",
        "api_key.revoke",
    }
)
ADMIN_TOKEN_ACTOR = "admin-token"  # noqa: S105 - an actor name, not a token


def console_actor(session_hash: str) -> str:
    return f"console-session:{session_hash[:8]}"


@dataclass
class Audit:
    """The entry one admin request will leave (at most one: the route's action)."""

    actor: str
    clock: Clock
    action: str | None = None
    target: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    written: bool = False

    def __call__(self, action: str, target: str, **detail: Any) -> None:
        if action not in ACTIONS:
            raise ValueError(f"unknown audit action {action!r}")
        self.action, self.target, self.detail = action, target[:300], detail

    def entry(self, outcome: str) -> AuditEntry | None:
        if self.action is None:
            return None
        return AuditEntry(
            at=self.clock.now(),
            actor=self.actor,
            action=self.action,
            target=self.target,
            outcome=outcome[:40],
            detail=self.detail,
        )

    def succeeded(self, session: Session) -> None:
        """Add the entry to the route's transaction; a route that commits before it returns
        calls this itself, first."""
        entry = None if self.written else self.entry("ok")
        if entry is not None:
            session.add(entry)
            self.written = True

    def refused(self, session_factory: sessionmaker[Session], code: str) -> None:
        entry = None if self.written else self.entry(code)
        if entry is not None:
            with session_factory.begin() as session:
                session.add(entry)
            self.written = True


def list_entries(
    *,
    session: Session,
    action: str | None,
    actor: str | None,
    target: str | None,
    since: datetime | None,
    before_id: int | None,
    limit: int,
) -> list[AuditEntry]:
    """Newest first; `before_id` pages back."""
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if action:
        query = query.where(AuditEntry.action == action)
    if actor:
        query = query.where(AuditEntry.actor == actor)
    if target:
        query = query.where(AuditEntry.target == target)
    if since is not None:
        query = query.where(AuditEntry.at >= since)
    if before_id is not None:
        query = query.where(AuditEntry.id < before_id)
    return list(session.scalars(query))
