"""People (issue 45): users and their roles (admins only), every user's own personal keys, and
who a request acts as. A password or a key is never returned after it is set or minted, and
never written to the audit log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, status
from sqlalchemy.orm import Session

from control_plane.access import people
from control_plane.access.principals import Principal
from control_plane.access.roles import ROLE_GRANTS, Area, Role, permits
from control_plane.access.schemas import (
    Me,
    PersonalKeyCreate,
    PersonalKeyMinted,
    PersonalKeyPublic,
    UserCreate,
    UserNamePath,
    UserPublic,
    UserUpdate,
)
from control_plane.api.deps import AuditDep, ContextDep, SessionDep, needs
from control_plane.api.routing import LaneRoute
from control_plane.errors import Conflict
from control_plane.models import ApiKey, User

users = APIRouter(
    prefix="/api/v1/users",
    tags=["people"],
    dependencies=[needs(Area.PEOPLE)],
    route_class=LaneRoute,
)
me = APIRouter(prefix="/api/v1/me", tags=["people"], route_class=LaneRoute)
SelfDep = Annotated[Principal, needs(Area.SELF)]
KeyIdPath = Annotated[str, Path(pattern=r"^key_[0-9a-f]{20}$")]


@users.post("", status_code=status.HTTP_201_CREATED, response_model=UserPublic)
def create_user(
    body: UserCreate, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> UserPublic:
    audit("user.create", body.name, role=body.role.value, password=body.password is not None)
    user = people.create_user(
        session=session,
        clock=ctx.clock,
        actor=audit.actor,
        name=body.name,
        role=body.role,
        password=None if body.password is None else body.password.get_secret_value(),
    )
    return _user(user)


@users.get("", response_model=list[UserPublic])
def list_users(session: SessionDep) -> list[UserPublic]:
    return [_user(user) for user in people.list_users(session)]


@users.get("/{name}", response_model=UserPublic)
def get_user(name: UserNamePath, session: SessionDep) -> UserPublic:
    return _user(people.get_user(session, name))


@users.patch("/{name}", response_model=UserPublic)
def update_user(
    name: UserNamePath, body: UserUpdate, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> UserPublic:
    """Change a user's role, disable or enable them (their sessions and keys stop, or work
    again, at their next request), or set a new password."""
    changed = body.model_dump(exclude_unset=True, exclude={"password"})
    audit("user.update", name, **changed, password=body.password is not None)
    user = people.get_user(session, name)
    if body.role is not None:
        user.role = body.role.value
    if body.disabled is not None:
        user.disabled = body.disabled
    if body.password is not None:
        user.password_hash = people.hash_password(body.password.get_secret_value())
    user.updated_at = ctx.clock.now()
    return _user(user)


@users.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_user(name: UserNamePath, session: SessionDep, audit: AuditDep) -> None:
    """Remove a user with their keys and sessions; the audit log keeps their name."""
    audit("user.delete", name)
    session.delete(people.get_user(session, name))


@users.get("/{name}/keys", response_model=list[PersonalKeyPublic])
def list_user_keys(name: UserNamePath, session: SessionDep) -> list[PersonalKeyPublic]:
    user = people.get_user(session, name)
    return [_key(row) for row in people.list_keys(session, user.id)]


@users.delete("/{name}/keys/{key_id}", status_code=status.HTTP_204_NO_CONTENT)
def revoke_user_key(
    name: UserNamePath, key_id: KeyIdPath, session: SessionDep, audit: AuditDep
) -> None:
    audit("api_key.revoke", key_id, user=name)
    user = people.get_user(session, name)
    people.revoke_key(session, user_id=user.id, key_id=key_id)


@me.get("", response_model=Me)
def who_am_i(principal: SelfDep) -> Me:
    grants = ROLE_GRANTS[principal.role]
    may = [
        f"{area.value}:{'change' if change else 'read'}"
        for area, change in sorted(grants)
        if permits(principal.role, principal.scopes, area, change)
    ]
    return Me(
        actor=principal.actor,
        via=principal.via,
        role=principal.role,
        user=principal.user_name,
        scopes=None if principal.scopes is None else sorted(principal.scopes),
        may=may,
    )


@me.post("/keys", status_code=status.HTTP_201_CREATED, response_model=PersonalKeyMinted)
def mint_key(
    body: PersonalKeyCreate,
    principal: SelfDep,
    ctx: ContextDep,
    session: SessionDep,
    audit: AuditDep,
) -> PersonalKeyMinted:
    """A personal key, shown once. It acts as you, narrowed to its scopes: never beyond your
    role, and it stops when you are disabled or removed."""
    audit("api_key.create", body.name, scopes=sorted(body.scopes))
    user = _person(session, principal)
    minted = people.mint_key(
        session=session,
        clock=ctx.clock,
        user=user,
        name=body.name,
        scopes=body.scopes,
        expires_in_days=body.expires_in_days,
    )
    return PersonalKeyMinted(**_key(minted.row).model_dump(), key=minted.key)


@me.get("/keys", response_model=list[PersonalKeyPublic])
def list_my_keys(principal: SelfDep, session: SessionDep) -> list[PersonalKeyPublic]:
    return [_key(row) for row in people.list_keys(session, _person(session, principal).id)]


@me.delete("/keys/{key_id}", status_code=status.HTTP_204_NO_CONTENT)
def revoke_my_key(
    key_id: KeyIdPath, principal: SelfDep, session: SessionDep, audit: AuditDep
) -> None:
    audit("api_key.revoke", key_id, user=principal.user_name or "")
    people.revoke_key(session, user_id=_person(session, principal).id, key_id=key_id)


def _person(session: Session, principal: Principal) -> User:
    user = None if principal.user_id is None else session.get(User, principal.user_id)
    if user is None:
        raise Conflict(
            "The admin token is not a person: it has no keys of its own.",
            "Create a user (POST /api/v1/users), sign in as them, and mint keys there.",
            code="NOT_A_USER",
        )
    return user


def _user(user: User) -> UserPublic:
    return UserPublic(
        id=user.id,
        name=user.name,
        role=Role(user.role),
        disabled=user.disabled,
        has_password=user.password_hash is not None,
        created_at=user.created_at,
        updated_at=user.updated_at,
        created_by=user.created_by,
    )


def _key(row: ApiKey) -> PersonalKeyPublic:
    return PersonalKeyPublic(
        id=row.id,
        name=row.name,
        hint=row.hint,
        scopes=row.scopes,
        created_at=row.created_at,
        expires_at=row.expires_at,
    )
