"""ORM tables of the people who use ModelForge (issue 45): users with a role, and their personal
API keys. `models.py` re-exports them: import tables from there. A password is kept only as its
Argon2id hash, a key only as its SHA-256."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from control_plane.table_base import Base


class User(Base):
    """A person with a role (`access/roles.py`). `password_hash` is None for a user who signs in
    some other way (no password sign-in then). A disabled user's sessions and keys stop at their
    next request: every request reads the row."""

    __tablename__ = "users"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    #: admin | operator | member | viewer
    role: Mapped[str] = mapped_column(String(16))
    password_hash: Mapped[str | None] = mapped_column(String(256))
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    created_by: Mapped[str] = mapped_column(String(100))
    #: `<issuer> <sub>` of a user the OpenID provider made at first sign-in; None for a local one.
    oidc_subject: Mapped[str | None] = mapped_column(String(400), unique=True)


class OidcLogin(Base):
    """A sign-in through the OpenID provider under way (at most 10 minutes): found by the SHA-256
    of its `state`, used once. The PKCE verifier is the browser's (a cookie); only its SHA-256
    is here, so a callback from another browser, or a replayed one, is refused."""

    __tablename__ = "oidc_logins"

    state_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    nonce: Mapped[str] = mapped_column(String(100))
    verifier_hash: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[datetime] = mapped_column(index=True)


class ApiKey(Base):
    """A user's personal API key: shown once, kept as its SHA-256; `scopes` narrow what it may do
    to within its user's role (never beyond); it ends at `expires_at` or when revoked (deleted)."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    #: The key's first characters, to tell keys apart in lists (never enough to use it).
    hint: Mapped[str] = mapped_column(String(16))
    scopes: Mapped[list[Any]] = mapped_column(JSON)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]
