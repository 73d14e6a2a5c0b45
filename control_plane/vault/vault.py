"""Secrets (WL-6a): write-only values, encrypted at rest, delivered only into the process of the
job or service that lists them, on nodes whose signed credential labels carry the secret's
labels.

Encryption: AES-256-GCM (`cryptography`), a fresh 96-bit nonce per value, the secret's name as
associated data (a ciphertext copied onto another name does not decrypt). Keys live in
`<data dir>/secret-keys/<key id>.key` (32 random bytes, hex, mode 0600); `current` names the one
new values are encrypted with. Every row records its key id, so a key rotation
(`POST /api/v1/admin/secrets/rotate-key`) writes a new key, re-encrypts every value in one
transaction and leaves the old key file for the operator to delete once no backup needs it.
Replicas share the data dir (as for the signing key) and read a key file they have not seen yet
when a row names it.

A value never appears in a log, an exception, an event, an API response or a `repr`.
"""

from __future__ import annotations

import hashlib
import os
import secrets as random
import threading
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.errors import InvalidRequest, ModelForgeError, NotFound
from control_plane.models import Secret
from control_plane.vault.schemas import SecretPublic, SecretPut
from modelforge_contracts.files import write_private

KEYS_DIR = "secret-keys"
_NONCE = 12


class SecretKeyError(ModelForgeError):
    http_status = 500
    code = "SECRET_KEY_UNAVAILABLE"


class Vault:
    def __init__(self, data_dir: Path) -> None:
        self._dir = data_dir / KEYS_DIR
        self._lock = threading.Lock()
        self._keys: dict[str, bytes] = {}
        self._current: str | None = None

    def __repr__(self) -> str:
        return f"Vault(current={self._current!r})"

    # -- keys -------------------------------------------------------------------------------

    def _key(self, key_id: str) -> bytes:
        with self._lock:
            key = self._keys.get(key_id)
        if key is not None:
            return key
        path = self._dir / f"{key_id}.key"
        try:
            key = bytes.fromhex(path.read_text().strip())
        except (OSError, ValueError):
            raise SecretKeyError(
                f"The key a secret was encrypted with ({key_id}) is not readable at {path}.",
                "Restore the data dir's secret-keys/ directory (every replica needs the same "
                "one), or set the secret again.",
            ) from None
        with self._lock:
            self._keys[key_id] = key
        return key

    def current(self) -> str:
        """The id of the key new values are encrypted with; created on first use."""
        if self._current is not None:
            return self._current
        pointer = self._dir / "current"
        if not pointer.exists():
            self._new_key(first=True)
        key_id = pointer.read_text().strip()
        self._key(key_id)
        self._current = key_id
        return key_id

    def _new_key(self, *, first: bool = False) -> str:
        key = random.token_bytes(32)
        key_id = hashlib.sha256(key).hexdigest()[:16]
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(self._dir / f"{key_id}.key", key.hex() + "\n", exclusive=True)
        try:
            if first:
                write_private(self._dir / "current", key_id + "\n", exclusive=True)
            else:
                write_private(self._dir / "current", key_id + "\n")
        except FileExistsError:
            pass  # another replica created the first key at the same moment: use theirs
        with self._lock:
            self._keys[key_id] = key
        return key_id

    # -- values -----------------------------------------------------------------------------

    def encrypt(self, name: str, value: str, key_id: str | None = None) -> tuple[bytes, str]:
        key_id = key_id or self.current()
        nonce = os.urandom(_NONCE)
        sealed = AESGCM(self._key(key_id)).encrypt(nonce, value.encode(), name.encode())
        return nonce + sealed, key_id

    def decrypt(self, row: Secret) -> str:
        data = bytes(row.ciphertext)
        try:
            plain = AESGCM(self._key(row.key_id)).decrypt(
                data[:_NONCE], data[_NONCE:], row.name.encode()
            )
        except InvalidTag:
            raise SecretKeyError(
                f"Secret {row.name} does not decrypt with key {row.key_id}.",
                "The key file does not belong to this database; restore the right "
                "secret-keys/ directory or set the secret again.",
            ) from None
        return plain.decode()

    def rotate(self, session: Session) -> tuple[str, int]:
        """A new current key; every value re-encrypted with it in `session`'s transaction."""
        key_id = self._new_key()
        self._current = key_id
        rows = list(session.scalars(select(Secret).with_for_update()))
        for row in rows:
            row.ciphertext, row.key_id = self.encrypt(row.name, self.decrypt(row), key_id)
        return key_id, len(rows)


# -- the API's operations -----------------------------------------------------------------------


def put_secret(
    *, session: Session, clock: Clock, vault: Vault, name: str, request: SecretPut
) -> Secret:
    ciphertext, key_id = vault.encrypt(name, request.value)
    now = clock.now()
    row = session.get(Secret, name, with_for_update=True)
    if row is None:
        row = Secret(name=name, created_at=now)
        session.add(row)
    row.ciphertext, row.key_id, row.labels, row.updated_at = ciphertext, key_id, request.labels, now
    session.flush()
    return row


def delete_secret(*, session: Session, name: str) -> None:
    row = session.get(Secret, name)
    if row is None:
        raise _not_found(name)
    session.delete(row)


def list_secrets(*, session: Session) -> list[Secret]:
    return list(session.scalars(select(Secret).order_by(Secret.name)))


def secret_public(row: Secret) -> SecretPublic:
    return SecretPublic(
        name=row.name, labels=row.labels, created_at=row.created_at, updated_at=row.updated_at
    )


def _not_found(name: str) -> NotFound:
    return NotFound(
        f"No secret named {name}.",
        "Set it with PUT /api/v1/admin/secrets/{name}, or list them with "
        "GET /api/v1/admin/secrets.",
        code="SECRET_NOT_FOUND",
    )


def required_labels(session: Session, names: list[str], *, named_by: str) -> dict[str, Any]:
    """The labels a node must carry to receive every secret of `names`; refuses a name that
    does not exist and secrets whose labels contradict each other (no node could run it)."""
    if not names:
        return {}
    rows = {row.name: row for row in session.scalars(select(Secret).where(Secret.name.in_(names)))}
    labels: dict[str, Any] = {}
    for name in names:
        row = rows.get(name)
        if row is None:
            raise NotFound(
                f"{named_by} lists secret {name}, which does not exist.",
                f"Set it first with PUT /api/v1/admin/secrets/{name}.",
                code="SECRET_NOT_FOUND",
            )
        for key, value in (row.labels or {}).items():
            if labels.get(key, value) != value:
                raise InvalidRequest(
                    f"{named_by} lists secrets whose labels contradict each other "
                    f"({key}={labels[key]} and {key}={value}): no node carries both.",
                    "List only secrets meant for the same nodes.",
                    code="SECRET_LABELS_CONFLICT",
                )
            labels[key] = value
    return labels


def values_for(
    session: Session, vault: Vault, names: list[str], carried: dict[str, Any]
) -> dict[str, str] | None:
    """Each listed secret's value for a node carrying `carried` labels (its signed credential's):
    None when any secret is gone or its labels are not all carried — nothing is delivered."""
    if not names:
        return {}
    rows = {row.name: row for row in session.scalars(select(Secret).where(Secret.name.in_(names)))}
    values: dict[str, str] = {}
    for name in names:
        row = rows.get(name)
        if row is None or any(carried.get(k) != v for k, v in (row.labels or {}).items()):
            return None
        values[name] = vault.decrypt(row)
    return values
