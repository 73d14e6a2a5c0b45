"""The role matrix (issue 45), generated from the OpenAPI document: every route that takes a
person (it lists the `X-ModelForge-Admin-Token` header) is asked by each role, through a key of
each scope, and by nobody; each answer must be refused exactly when this file's table says so.
A new route with no area here fails the test, so none ships outside the matrix.

The table is written out here, apart from `control_plane/access/roles.py`, on purpose: it is
what docs/access.md promises, checked against what the app does. SQLite only: the check is of
the routes' dependencies, not of the database."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.factories import ControlPlane, control_plane

PASSWORD = "a passphrase for the matrix"  # noqa: S105 - test users' password

#: (METHOD path pattern, area): the first match names a route's area.
AREAS = [
    (r"POST /api/v1/admin/signing-key/rotate", "people"),
    (r"POST /api/v1/admin/secrets/rotate-key", "people"),
    (r"POST /api/v1/admin/artifacts/sweep", "fleet"),
    (r"\w+ /api/v1/admin/secrets.*", "work"),
    (r"\w+ /api/v1/admin/audit", "audit"),
    (r"\w+ /api/v1/admin/.*", "fleet"),
    (r"\w+ /api/v1/users.*", "people"),
    (r"\w+ /api/v1/me.*", "self"),
    (r"\w+ /api/v1/(jobs|services|models|artifacts|access-tokens)\b.*", "work"),
]
READ, CHANGE = "read", "change"
#: What docs/access.md says each role may do.
ROLES = {
    "viewer": {("work", READ), ("fleet", READ), ("self", READ), ("self", CHANGE)},
    "member": {("work", READ), ("work", CHANGE), ("fleet", READ), ("self", READ), ("self", CHANGE)},
    "operator": {
        ("work", READ),
        ("work", CHANGE),
        ("fleet", READ),
        ("fleet", CHANGE),
        ("audit", READ),
        ("self", READ),
        ("self", CHANGE),
    },
}
ROLES["admin"] = {(area, how) for _, area in AREAS for how in (READ, CHANGE)} | {("audit", CHANGE)}
#: What a key's scope lets it do, within its user's role.
SCOPES = {
    "read": {(area, READ) for area, _ in ROLES["admin"]},
    "deploy": {(area, READ) for area, _ in ROLES["admin"]} | {("work", CHANGE)},
    "admin": ROLES["admin"],
}
REFUSED = ("ROLE_FORBIDDEN", "KEY_SCOPE_FORBIDDEN")
#: Routes that list the admin token's header but take no person: Prometheus' scrape takes the
#: metrics token (or the break-glass admin token), never a person's key or session.
NO_PERSON = {("GET", "/metrics")}


def _operations(cp: ControlPlane) -> list[tuple[str, str]]:
    paths = cp.client.get("/openapi.json").json()["paths"]
    found = []
    for path, operations in paths.items():
        for method, operation in operations.items():
            names = {p["name"] for p in operation.get("parameters", []) if p["in"] == "header"}
            if "X-ModelForge-Admin-Token" in names and (method.upper(), path) not in NO_PERSON:
                found.append((method.upper(), path))
    return sorted(found)


def _area(method: str, path: str) -> str:
    for pattern, area in AREAS:
        if re.fullmatch(pattern, f"{method} {path}"):
            return area
    raise AssertionError(f"{method} {path} has no area here: add it to AREAS and docs/access.md")


def _key(cp: ControlPlane, name: str, role: str, scopes: list[str]) -> str:
    cp.client.post(
        "/api/v1/users", headers=cp.admin, json={"name": name, "role": role, "password": PASSWORD}
    )
    cp.client.cookies.clear()
    session = cp.client.post("/api/v1/console/session", json={"name": name, "password": PASSWORD})
    csrf = {"X-ModelForge-CSRF": session.json()["csrf_token"]}
    minted = cp.client.post(
        "/api/v1/me/keys", headers=csrf, json={"name": "matrix", "scopes": scopes}
    )
    assert minted.status_code == 201, minted.text
    cp.client.cookies.clear()
    return str(minted.json()["key"])


def _ask(cp: ControlPlane, method: str, path: str, headers: dict[str, str]) -> Any:
    url = re.sub(r"\{[^}]+\}", "x", path)
    body = None if method in ("GET", "HEAD", "DELETE") else {}
    return cp.client.request(method, url, headers=headers, json=body)


def test_every_route_answers_each_role_and_scope_as_the_table_says(tmp_path: Path) -> None:
    with control_plane(tmp_path, f"sqlite:///{tmp_path / 'cp.db'}") as cp:
        operations = _operations(cp)
        assert len(operations) > 50  # the document was read, not an empty list
        askers = {(role, "admin"): _key(cp, f"{role}-a", role, ["admin"]) for role in ROLES} | {
            ("member", scope): _key(cp, f"member-{scope}", "member", [scope])
            for scope in ("read", "deploy")
        }
        wrong = []
        for method, path in operations:
            area = _area(method, path)
            how = READ if method in ("GET", "HEAD") else CHANGE
            nobody = _ask(cp, method, path, {})
            if nobody.status_code != 401:
                wrong.append(f"{method} {path} by nobody: {nobody.status_code}")
            for (role, scope), key in askers.items():
                allowed = (area, how) in ROLES[role] and (area, how) in SCOPES[scope]
                answer = _ask(cp, method, path, {"Authorization": f"Bearer {key}"})
                refused = answer.status_code == 403 and answer.json()["error"]["code"] in REFUSED
                if refused == allowed or answer.status_code == 401:
                    wrong.append(f"{method} {path} by {role}/{scope}: {answer.status_code}")
        assert not wrong, "\n".join(wrong)
