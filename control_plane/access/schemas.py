"""Access's request and response bodies: the console's sign-in and its session, users, their
personal keys, and who a request acts as."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Self

from fastapi import Path
from pydantic import BaseModel, Field, SecretStr, StringConstraints, model_validator

from control_plane.access.people import USER_NAME_PATTERN
from control_plane.access.roles import Role, Scope
from control_plane.schemas import StrictModel

UserName = Annotated[str, StringConstraints(pattern=USER_NAME_PATTERN)]
UserNamePath = Annotated[str, Path(pattern=USER_NAME_PATTERN)]
#: 12 characters at least (NIST SP 800-63B asks 8; a shared appliance asks more), 256 at most.
Password = Annotated[SecretStr, StringConstraints(min_length=12, max_length=256)]


class SignInRequest(StrictModel):
    """Either the admin token, or a user's name and password."""

    # SecretStr: a validation error or a repr() never shows it.
    admin_token: Annotated[SecretStr, StringConstraints(min_length=1, max_length=512)] | None = None
    name: UserName | None = None
    password: Annotated[SecretStr, StringConstraints(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _one_way(self) -> Self:
        with_password = self.name is not None or self.password is not None
        if (self.admin_token is None) == (not with_password) or (
            with_password and (self.name is None or self.password is None)
        ):
            raise ValueError("sign in with either admin_token, or name and password")
        return self


class SignInOptions(BaseModel):
    """How one may sign in: a name and password (or the admin token) always; `sso`, the OpenID
    provider's display name, when single sign-on is configured."""

    password: bool = True
    sso: str | None = None


class ConsoleSessionInfo(BaseModel):
    """Held by the console in memory only; the session itself is the HttpOnly cookie."""

    csrf_token: str
    expires_at: datetime
    #: The signed-in user; None for a session of the admin token.
    user: str | None = None
    role: Role = Role.ADMIN


class UserCreate(StrictModel):
    name: UserName
    role: Role
    #: None: the user cannot sign in with a password (until an admin sets one).
    password: Password | None = None


class UserUpdate(StrictModel):
    role: Role | None = None
    disabled: bool | None = None
    password: Password | None = None


class UserPublic(BaseModel):
    id: str
    name: str
    role: Role
    disabled: bool
    has_password: bool
    created_at: datetime
    updated_at: datetime
    created_by: str


class PersonalKeyCreate(StrictModel):
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}$")]
    scopes: Annotated[list[Scope], Field(min_length=1, max_length=3)]
    #: 1 day to a year; 90 days unless said.
    expires_in_days: Annotated[int, Field(ge=1, le=366)] = 90


class PersonalKeyPublic(BaseModel):
    id: str
    name: str
    hint: str
    scopes: list[Scope]
    created_at: datetime
    expires_at: datetime


class PersonalKeyMinted(PersonalKeyPublic):
    #: Shown once: only its SHA-256 is kept.
    key: str


class Me(BaseModel):
    """Who this request acts as, and what it may do (`area:read`, `area:change`)."""

    actor: str
    via: str
    role: Role
    user: str | None
    scopes: list[Scope] | None
    may: list[str]
