"""Who may do what (issue 45): four roles over five areas of the API, and the scopes that narrow
a personal key within its user's role.

Every route of the admin API names its area (`api/deps.needs`); a GET or HEAD reads it, any
other method changes it. The table below is the whole rule, and `tests/control_plane/
test_roles.py` walks every route of the OpenAPI document against it.

| area     | what                                          | viewer | member | operator | admin  |
|----------|-----------------------------------------------|--------|--------|----------|--------|
| `work`   | jobs, services, models, artifacts, secrets    | read   | change | change   | change |
| `fleet`  | nodes, GPUs, credentials, provisioning, sweep | read   | read   | change   | change |
| `audit`  | the audit log                                 | –      | –      | read     | read   |
| `people` | users and their keys, signing / secrets keys  | –      | –      | –        | change |
| `self`   | who am I, my own keys                         | change | change | change   | change |

A key's scopes: `read` reads what its user may read; `deploy` also changes `work`; `admin` does
whatever its user may. A key changes its user's own keys only with `admin` (a leaked read key
cannot mint another). Calling a service at the gateway takes a service access token, not a
personal key (yet: an `invoke` scope needs the gateway's usage book to count per person).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class Role(StrEnum):
    ADMIN = "admin"
    OPERATOR = "operator"
    MEMBER = "member"
    VIEWER = "viewer"


class Area(StrEnum):
    WORK = "work"
    FLEET = "fleet"
    AUDIT = "audit"
    PEOPLE = "people"
    SELF = "self"


class Scope(StrEnum):
    READ = "read"
    DEPLOY = "deploy"
    ADMIN = "admin"


#: (area, change): a role's grants. Reading is (area, False), changing (area, True).
_VIEWER = frozenset(
    {(Area.WORK, False), (Area.FLEET, False), (Area.SELF, False), (Area.SELF, True)}
)
_MEMBER = _VIEWER | {(Area.WORK, True)}
_OPERATOR = _MEMBER | {(Area.FLEET, True), (Area.AUDIT, False)}
_ADMIN = frozenset((area, change) for area in Area for change in (False, True))
ROLE_GRANTS: dict[Role, frozenset[tuple[Area, bool]]] = {
    Role.VIEWER: _VIEWER,
    Role.MEMBER: _MEMBER,
    Role.OPERATOR: _OPERATOR,
    Role.ADMIN: _ADMIN,
}
_READS = frozenset((area, False) for area in Area)
SCOPE_GRANTS: dict[Scope, frozenset[tuple[Area, bool]]] = {
    Scope.READ: _READS,
    Scope.DEPLOY: _READS | {(Area.WORK, True)},
    Scope.ADMIN: _ADMIN,
}


def permits(role: Role, scopes: Iterable[Scope] | None, area: Area, change: bool) -> bool:
    """Whether `role` (narrowed by a key's `scopes`; None: not a key) may read or change `area`."""
    if (area, change) not in ROLE_GRANTS[role]:
        return False
    return scopes is None or any((area, change) in SCOPE_GRANTS[scope] for scope in scopes)
