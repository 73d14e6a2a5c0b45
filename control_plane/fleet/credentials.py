"""Node credentials: EdDSA JWTs signed with Authlib, one active `jti` per node.

`authenticate` is the one verification entry point: signature, issuer and claims, then the
status of the `jti`. It is built for heartbeat fleets (HB-4): a credential string that verified
once is kept in memory, and the status of each `jti` is cached, so a steady-state request costs
two dict look-ups and no database round trip (`cached_active` is that check alone, for callers
that must not block). `start` loads which credentials are active in one query, so a restarted
control plane verifies each node's first credential without a database read either; only a
credential issued by another process since then is looked up, once. Revocations made in this
process apply at once; those made by another process are picked up by `refresh()`, which the app
runs every second.

Revocations are durable: a revoked credential's row stays (also after its node was deleted),
so every replica's refresh sees it. A request that was authenticated and then waits (a long
poll) asks `still_active` before each attempt, so a revocation ends it too.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import warnings
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import authlib.deprecate  # noqa: E402,I001 - installs Authlib's own warning filter first
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock
from control_plane.db import dialect_insert, rowcount
from control_plane.errors import CredentialError, CredentialExpired, CredentialRevoked, NotFound
from control_plane.models import NodeCredential, SigningKey
from control_plane.scheduling.dispatch import jobs_changed, node_key
from control_plane.security import new_id
from modelforge_contracts.files import write_private

with warnings.catch_warnings():
    # authlib.jose warns that joserfc is its successor; its JWT API is stable through Authlib 1.x.
    warnings.simplefilter("ignore", authlib.deprecate.AuthlibDeprecationWarning)
    from authlib.jose import JsonWebToken
    from authlib.jose.errors import ExpiredTokenError, JoseError

SIGNING_KEY_FILE = "signing-key.pem"
ISSUER = "modelforge-control-plane"
_ALGORITHM = "EdDSA"
_VERIFIED_CACHE_LIMIT = 200_000
DEFAULT_LIFETIME = timedelta(days=365)
#: Credentials a provisioner has issued for a node agent it starts on a cluster (PV-1).
PROVISIONER_LIFETIME = timedelta(hours=24)
#: Revocations committed by other processes are searched this far behind the last refresh.
_REFRESH_OVERLAP = timedelta(seconds=10)


@dataclass(frozen=True)
class NodePrincipal:
    node_id: str
    jti: str
    labels: dict[str, str]
    #: Its `exp` as a UNIX time (CR-3); None for a credential issued before expiry existed.
    expires: int | None = None


@dataclass(frozen=True)
class _Key:
    kid: str
    public_pem: bytes
    retired: bool


class CredentialAuthority:
    def __init__(
        self,
        *,
        data_dir: Path,
        clock: Clock,
        session_factory: sessionmaker[Session],
        lifetime: timedelta = DEFAULT_LIFETIME,
    ) -> None:
        self._key_path = data_dir / SIGNING_KEY_FILE
        #: How long an enrollment-issued credential lasts (`MODELFORGE_CREDENTIAL_LIFETIME_DAYS`).
        self.lifetime = lifetime
        self._clock = clock
        self._session_factory = session_factory
        self._jwt = JsonWebToken([_ALGORITHM])
        self._lock = threading.Lock()
        self._private_pem = b""
        self._kid = ""
        self._keys: dict[str, _Key] = {}
        self._verified: dict[str, NodePrincipal] = {}
        #: jti -> True (active) / False (revoked); absent means "ask `_active_at_start`, then
        #: the database".
        self._jti_active: dict[str, bool] = {}
        #: jti -> node id of the credentials active when `start` ran (one query), each moved to
        #: `_jti_active` on first use; `refresh` catches revocations committed since. About
        #: 2 MB for 10,000 nodes. Revoked credentials are not loaded: they only accumulate.
        self._active_at_start: dict[str, str] = {}
        self._refreshed_at: datetime | None = None
        #: Whether this process issues credentials (holds the signing key) or only checks them
        #: (an artifact host: `start(signing=False)`).
        self._signing = True

    def __repr__(self) -> str:
        return f"CredentialAuthority(kid={self._kid!r})"

    # -- keys -------------------------------------------------------------------------------

    def start(self, session: Session, *, signing: bool = True) -> None:
        """Load (or create) the signing key and register it, and load which credentials are
        active; call once at start-up. With `signing` false the process only checks
        credentials, against the keys the database holds: it reads, makes and registers no
        signing key of its own."""
        self._signing = signing
        if signing:
            self._start_signing(session)
        self._load_keys(session)
        # Read before the query: the next refresh looks for revocations from this time on
        # (less its overlap), so one committed while the query runs is not missed.
        now = self._clock.now()
        active = session.execute(
            select(NodeCredential.jti, NodeCredential.node_id).where(
                NodeCredential.revoked_at.is_(None)
            )
        )
        with self._lock:
            self._active_at_start = dict(active.all())
        self._refreshed_at = now

    def _start_signing(self, session: Session) -> None:
        if self._key_path.exists():
            self._private_pem = self._key_path.read_bytes()
        else:
            self._private_pem = _generate_private_pem()
            write_private(self._key_path, self._private_pem.decode())
        self._kid, public_pem = _describe(self._private_pem)
        row = session.get(SigningKey, self._kid)
        if row is None:
            # Control-plane replicas sharing the key may start together: the first insert wins,
            # the others' change nothing (a plain insert failed the start of all but one).
            session.execute(
                dialect_insert(session, SigningKey)
                .values(
                    kid=self._kid,
                    public_key_pem=public_pem.decode(),
                    created_at=self._clock.now(),
                    retired_at=None,
                )
                .on_conflict_do_nothing(index_elements=[SigningKey.kid])
            )
            session.flush()

    def rotate(self, session: Session) -> tuple[str, int]:
        """Replace the signing key and revoke every credential. Returns (new kid, revoked)."""
        now = self._clock.now()
        private_pem = _generate_private_pem()
        kid, public_pem = _describe(private_pem)
        session.execute(
            update(SigningKey).where(SigningKey.retired_at.is_(None)).values(retired_at=now)
        )
        session.add(
            SigningKey(kid=kid, public_key_pem=public_pem.decode(), created_at=now, retired_at=None)
        )
        revoked = rowcount(
            session.execute(
                update(NodeCredential)
                .where(NodeCredential.revoked_at.is_(None))
                .values(revoked_at=now, revoked_reason="signing key rotated")
            )
        )
        session.flush()
        # The key file is replaced only after the database accepted the change; the caller
        # commits right after. A crash between the two leaves the old key active and nothing lost.
        write_private(self._key_path, private_pem.decode())
        with self._lock:
            self._private_pem, self._kid = private_pem, kid
            self._verified.clear()
            self._jti_active = dict.fromkeys(self._jti_active, False)
            self._active_at_start = {}
        self._load_keys(session)
        return kid, revoked

    def _load_keys(self, session: Session) -> None:
        keys = {
            row.kid: _Key(row.kid, row.public_key_pem.encode(), row.retired_at is not None)
            for row in session.scalars(select(SigningKey))
        }
        with self._lock:
            self._keys = keys
            rotated = keys.get(self._kid, _Key("", b"", True)).retired
            if self._signing and rotated and self._key_path.exists():
                # Another process sharing this data dir rotated the key.
                self._private_pem = self._key_path.read_bytes()
                self._kid, _ = _describe(self._private_pem)
                self._verified.clear()

    # -- issue ------------------------------------------------------------------------------

    def issue(
        self,
        session: Session,
        *,
        node_id: str,
        labels: dict[str, str],
        lifetime: timedelta | None = None,
        issuer: str = "enrollment",
    ) -> str:
        """Revoke the node's active credential (if any) and issue a new one, in `session`,
        valid for `lifetime` (the enrollment lifetime unless given)."""
        now = self._clock.now()
        expires_at = now + (lifetime or self.lifetime)
        replaced = _revoke_active(
            session, node_id=node_id, at=now, reason="replaced by a new credential"
        )
        jti = new_id("jti")
        session.add(
            NodeCredential(
                jti=jti,
                node_id=node_id,
                kid=self._kid,
                issued_at=now,
                expires_at=expires_at,
                labels=dict(labels),
                issuer=issuer,
            )
        )
        session.flush()
        claims = {
            "iss": ISSUER,
            "sub": node_id,
            "jti": jti,
            "iat": int(now.timestamp()),
            "exp": int(expires_at.timestamp()),
            "labels": labels,
        }
        token: bytes = self._jwt.encode(
            {"alg": _ALGORITHM, "kid": self._kid, "typ": "JWT"}, claims, self._private_pem
        )
        self.forget(replaced)
        return token.decode()

    # -- verify -----------------------------------------------------------------------------

    def authenticate(self, token: str) -> NodePrincipal:
        """The node behind a valid, active credential; `CredentialError` (or its subclass
        `CredentialRevoked`) otherwise. Reads the database only for a `jti` neither seen before
        nor active at start, so call it off the event loop unless `cached_active` answered
        first."""
        principal = self._verified.get(token)
        if principal is None:
            principal = self._verify_signature(token)
            if len(self._verified) >= _VERIFIED_CACHE_LIMIT:
                self._verified.clear()
            self._verified[token] = principal
        if self._expired(principal):
            raise expired()
        active = self._jti_active.get(principal.jti)
        if active is None:
            owner = self._active_at_start.pop(principal.jti, None)
            if owner is not None:
                active = owner == principal.node_id
            else:
                with self._session_factory() as session:
                    row = session.get(NodeCredential, principal.jti)
                    active = (
                        row is not None
                        and row.revoked_at is None
                        and row.node_id == principal.node_id
                    )
            # setdefault: a revocation `forget` recorded meanwhile wins over this answer.
            active = self._jti_active.setdefault(principal.jti, active)
        if not active:
            raise revoked()
        return principal

    def cached_active(self, token: str) -> NodePrincipal | None:
        """The principal only when this exact credential verified before and its `jti` is known
        active; None otherwise (the caller then calls `authenticate`). Never blocks."""
        principal = self._verified.get(token)
        if principal is None or self._jti_active.get(principal.jti) is not True:
            return None
        if self._expired(principal):
            return None  # `authenticate` refuses it
        return principal

    def _expired(self, principal: NodePrincipal) -> bool:
        return principal.expires is not None and self._clock.now().timestamp() >= principal.expires

    def has_expired(self, principal: NodePrincipal) -> bool:
        """Whether a principal authenticated earlier is past its credential's `exp` now, on this
        control plane's clock (for a connection that outlives the request that opened it, as
        a tunnel does). Memory only: never blocks."""
        return self._expired(principal)

    def still_active(self, principal: NodePrincipal) -> bool:
        """Whether a principal authenticated earlier is still unrevoked as far as this process
        knows (revoked here, or picked up by `refresh`). Memory only: never blocks."""
        return self._jti_active.get(principal.jti) is not False

    def recheck(self, principal: NodePrincipal) -> None:
        """`CredentialRevoked` once `still_active` says no; for requests that wait."""
        if not self.still_active(principal):
            raise revoked()

    def _verify_signature(self, token: str) -> NodePrincipal:
        try:
            header = _unverified_header(token)
            key = self._keys.get(str(header.get("kid", "")))
            if key is None:
                raise CredentialError(
                    "The node credential was not signed by this control plane.",
                    "Enroll the node again with a new enrollment token.",
                )
            if key.retired:
                raise CredentialRevoked(
                    "The node credential was revoked: the signing key was rotated.",
                    "Enroll the node again with a new enrollment token.",
                )
            claims: Any = self._jwt.decode(
                token,
                key.public_pem,
                claims_options={"iss": {"essential": True, "value": ISSUER}},
            )
            # On this control plane's clock; a credential verified once is cached, so
            # `_expired` judges its expiry again at every use.
            claims.validate(now=int(self._clock.now().timestamp()))
            node_id, jti, labels = claims["sub"], claims["jti"], claims.get("labels", {})
            expires = claims.get("exp")
        except ExpiredTokenError:
            raise expired() from None
        except (JoseError, ValueError, KeyError, TypeError):
            raise CredentialError(
                "The node credential is malformed or its signature is invalid.",
                "Check that the agent sends the credential it received at enrollment; "
                "if its state volume was lost, enroll again.",
            ) from None
        if (
            not isinstance(node_id, str)
            or not isinstance(jti, str)
            or not isinstance(labels, dict)
            or not (expires is None or isinstance(expires, int))
        ):
            raise CredentialError(
                "The node credential is missing required claims.",
                "Enroll the node again with a new enrollment token.",
            )
        return NodePrincipal(node_id=node_id, jti=jti, labels=labels, expires=expires)

    # -- revoke -----------------------------------------------------------------------------

    def revoke_for_node(self, session: Session, *, node_id: str, reason: str) -> list[str]:
        jtis = _revoke_active(session, node_id=node_id, at=self._clock.now(), reason=reason)
        if jtis:
            # The node's waiting claims and watches end once this commits (refused).
            jobs_changed(session, [node_key(node_id)])
        self.forget(jtis)
        return jtis

    def revoke_jti(self, session: Session, *, jti: str, reason: str) -> NodeCredential:
        """Revoke one credential by its `jti` (CR-3); that credential and no other is refused
        from then on. Revoking a revoked one changes nothing."""
        row = session.get(NodeCredential, jti, with_for_update=True)
        if row is None:
            raise NotFound(
                "No credential with this jti.",
                "List credentials with GET /api/v1/admin/credentials.",
                code="CREDENTIAL_NOT_FOUND",
            )
        if row.revoked_at is None:
            row.revoked_at, row.revoked_reason = self._clock.now(), reason
            jobs_changed(session, [node_key(row.node_id)])
            self.forget([jti])
        return row

    def forget(self, jtis: list[str]) -> None:
        """Mark `jtis` revoked in this process's cache (the database is the caller's job)."""
        for jti in jtis:
            self._jti_active[jti] = False
            self._active_at_start.pop(jti, None)

    def refresh(self) -> None:
        """Pick up revocations and key rotations committed by other processes."""
        now = self._clock.now()
        since = (self._refreshed_at or now) - _REFRESH_OVERLAP
        with self._session_factory() as session:
            revoked = list(
                session.scalars(
                    select(NodeCredential.jti).where(NodeCredential.revoked_at >= since)
                )
            )
            self._load_keys(session)
        self.forget(revoked)
        self._refreshed_at = now


def _revoke_active(session: Session, *, node_id: str, at: datetime, reason: str) -> list[str]:
    """Revoke every active credential of `node_id` in `session`; their `jti`s (the caller
    `forget`s them once it is done)."""
    jtis = list(
        session.scalars(
            select(NodeCredential.jti).where(
                NodeCredential.node_id == node_id, NodeCredential.revoked_at.is_(None)
            )
        )
    )
    if jtis:
        session.execute(
            update(NodeCredential)
            .where(NodeCredential.jti.in_(jtis))
            .values(revoked_at=at, revoked_reason=reason)
        )
    return jtis


def expired() -> CredentialExpired:
    return CredentialExpired(
        "The node credential has expired.",
        "Enroll the node again: mint an enrollment token, remove identity.json from the agent's "
        "state volume and start the agent with the new token (docs/nodes.md).",
    )


def revoked() -> CredentialRevoked:
    """The refusal of a revoked credential (also rendered by the agents' fast path)."""
    return CredentialRevoked(
        "The node credential was revoked.",
        "Stop this agent; if the node should return, enroll it again with a new token.",
    )


def _generate_private_pem() -> bytes:
    return Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _describe(private_pem: bytes) -> tuple[str, bytes]:
    key = serialization.load_pem_private_key(private_pem, password=None)
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "k_" + hashlib.sha256(public_pem).hexdigest()[:24], public_pem


def _unverified_header(token: str) -> dict[str, Any]:
    head = token.split(".", 1)[0]
    decoded = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
    if not isinstance(decoded, dict):
        raise ValueError("JWT header is not an object")
    return decoded
