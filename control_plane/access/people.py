"""Users and their personal API keys (issue 45): creating, changing and removing users, password
sign-in, and keys minted, found and revoked.

A password is kept only as its Argon2id hash (argon2-cffi's defaults, RFC 9106's second
recommended profile); a wrong name costs the same hash as a wrong password, so the answer's time
does not say which names exist. A key (`mfk_` and 43 random characters) is kept as its SHA-256,
as the services' tokens are: it is random, not chosen, so a slow hash adds nothing.
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass, field
from datetime import timedelta

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.access.console_sessions import SignInThrottle
from control_plane.access.roles import Role, Scope
from control_plane.clock import Clock
from control_plane.errors import AdminAuthError, Conflict, NotFound
from control_plane.models import ApiKey, User
from control_plane.security import new_id, sha256_hex

#: A user's name: lower case, as an identity provider's usernames usually are; 32 at most (the
#: audit log's actor column holds `user:<name> key:<8>`).
USER_NAME_PATTERN = r"^[a-z][a-z0-9._-]{0,31}$"
KEY_PREFIX = "mfk_"
#: The characters of a key a list shows: its prefix and 6 of its 43 random ones.
HINT_LENGTH = 10
#: Unexpired keys one user may hold at once.
MAX_KEYS = 50
#: Longer than any key: a presented value past this is not hashed, just refused.
_MAX_PRESENTED = 200
_HASHER = PasswordHasher()
_SIGN_IN = "Sign in again with your name and password, or ask an admin to reset the password."


@dataclass(frozen=True)
class MintedKey:
    row: ApiKey
    #: Returned to the caller once, never stored.
    key: str = field(repr=False)


@functools.cache
def _dummy_hash() -> str:
    """A hash to verify against when the name is unknown (made once, on first use)."""
    return _HASHER.hash(secrets.token_urlsafe(16))


def hash_password(password: str) -> str:
    return _HASHER.hash(password)


def create_user(
    *,
    session: Session,
    clock: Clock,
    actor: str,
    name: str,
    role: Role,
    password: str | None,
    oidc_subject: str | None = None,
) -> User:
    """A new user; `oidc_subject` for one the OpenID provider signs in (`oidc.py`)."""
    if session.scalar(select(User.id).where(User.name == name)) is not None:
        raise Conflict(
            f"A user named {name!r} exists.",
            "Choose another name, or change that user with PATCH /api/v1/users/{name}.",
            code="USER_EXISTS",
        )
    now = clock.now()
    user = User(
        id=new_id("usr"),
        name=name,
        role=role.value,
        password_hash=None if password is None else hash_password(password),
        disabled=False,
        created_at=now,
        updated_at=now,
        created_by=actor[:100],
        oidc_subject=oidc_subject,
    )
    session.add(user)
    session.flush()
    return user


def get_user(session: Session, name: str) -> User:
    user = session.scalar(select(User).where(User.name == name))
    if user is None:
        raise NotFound(
            f"No user named {name!r}.",
            "List the users with GET /api/v1/users.",
            code="USER_NOT_FOUND",
        )
    return user


def list_users(session: Session) -> list[User]:
    return list(session.scalars(select(User).order_by(User.name)))


def check_password(
    *,
    session: Session,
    clock: Clock,
    throttle: SignInThrottle,
    address: str,
    name: str,
    password: str,
) -> User:
    """The user `name` and `password` sign in as; one refusal for every wrong part (an unknown
    name, a wrong password, a user without a password or disabled), counted per address. It only
    reads: give it a read-only session, so the hash's time holds no write lock."""
    now = clock.now()
    throttle.check(address, now, then="sign in")
    user = session.scalar(select(User).where(User.name == name))
    stored = user.password_hash if user is not None else None
    try:
        _HASHER.verify(stored or _dummy_hash(), password)
        matched = stored is not None
    except (VerificationError, InvalidHashError):
        matched = False
    if not matched or user is None or user.disabled:
        throttle.failed(address, now)
        raise AdminAuthError(
            "The name or the password is wrong, or this user may not sign in.",
            _SIGN_IN,
            code="SIGN_IN_FAILED",
        )
    throttle.succeeded(address)
    return user


def mint_key(
    *,
    session: Session,
    clock: Clock,
    user: User,
    name: str,
    scopes: list[Scope],
    expires_in_days: int,
) -> MintedKey:
    now = clock.now()
    held = session.scalar(
        select(func.count()).where(ApiKey.user_id == user.id, ApiKey.expires_at > now)
    )
    if (held or 0) >= MAX_KEYS:
        raise Conflict(
            f"{user.name} holds {held} keys, the most one user may.",
            "Revoke keys no longer used (DELETE /api/v1/me/keys/{key_id}), then mint again.",
            code="TOO_MANY_KEYS",
        )
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        id=new_id("key"),
        user_id=user.id,
        name=name,
        token_hash=sha256_hex(key),
        hint=key[:HINT_LENGTH],
        scopes=sorted(scope.value for scope in set(scopes)),
        created_at=now,
        expires_at=now + timedelta(days=expires_in_days),
    )
    session.add(row)
    session.flush()
    return MintedKey(row=row, key=key)


def list_keys(session: Session, user_id: str) -> list[ApiKey]:
    return list(
        session.scalars(
            select(ApiKey).where(ApiKey.user_id == user_id).order_by(ApiKey.created_at, ApiKey.id)
        )
    )


def revoke_key(session: Session, *, user_id: str, key_id: str) -> ApiKey:
    row = session.get(ApiKey, key_id)
    if row is None or row.user_id != user_id:
        raise NotFound(
            f"No key {key_id!r} of this user.",
            "List the keys with GET /api/v1/me/keys (an admin: GET /api/v1/users/{name}/keys).",
            code="API_KEY_NOT_FOUND",
        )
    session.delete(row)
    return row


def find_key(session: Session, clock: Clock, presented: str) -> tuple[ApiKey, User]:
    """The key presented and its user; refused when unknown, expired or its user disabled."""
    row = None
    if len(presented) <= _MAX_PRESENTED:
        row = session.scalar(select(ApiKey).where(ApiKey.token_hash == sha256_hex(presented)))
    if row is None:
        raise AdminAuthError(
            "This API key is not known (revoked, or never minted).",
            "Mint a key with POST /api/v1/me/keys, or sign in to the console.",
            code="API_KEY_INVALID",
        )
    if row.expires_at <= clock.now():
        raise AdminAuthError(
            f"This API key expired at {row.expires_at.isoformat()}.",
            "Mint a new key with POST /api/v1/me/keys.",
            code="API_KEY_EXPIRED",
        )
    user = session.get(User, row.user_id)
    if user is None or user.disabled:
        raise AdminAuthError(
            "The user of this API key is disabled.",
            "Ask an admin to enable the user again (PATCH /api/v1/users/{name}).",
            code="USER_DISABLED",
        )
    return row, user
