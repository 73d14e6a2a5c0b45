"""Who a request to the admin API acts as (issue 45): the break-glass admin token, a console
session (of the admin token, or of a user), or a user's personal key. `api/deps.py` finds the
principal once per request; `needs(area)` checks it against `roles.permits`."""

from __future__ import annotations

from dataclasses import dataclass

from control_plane.access.roles import Area, Role, Scope, permits
from control_plane.errors import ModelForgeError


class Forbidden(ModelForgeError):
    """A known principal whose role (or key's scopes) does not reach what it asked."""

    http_status = 403
    code = "ROLE_FORBIDDEN"


@dataclass(frozen=True)
class Principal:
    #: What the audit log names (`admin-token`, `console-session:<8>`, `user:<name>`,
    #: `user:<name> key:<8>`).
    actor: str
    role: Role
    #: How it signed in: `admin-token`, `session` or `key`.
    via: str
    user_id: str | None = None
    user_name: str | None = None
    #: A key's scopes; None for a session or the admin token.
    scopes: frozenset[Scope] | None = None

    def check(self, area: Area, change: bool) -> None:
        if permits(self.role, self.scopes, area, change):
            return
        verb = "change" if change else "read"
        if permits(self.role, None, area, change):
            scopes = ", ".join(sorted(self.scopes or ()))
            raise Forbidden(
                f"This key's scopes ({scopes}) do not let it {verb} {area.value}.",
                "Use a key with the scope it needs (docs/access.md), or the console.",
                code="KEY_SCOPE_FORBIDDEN",
            )
        raise Forbidden(
            f"The role {self.role.value} may not {verb} {area.value}.",
            "Ask an admin for a role that may (docs/access.md lists what each role may do).",
        )
