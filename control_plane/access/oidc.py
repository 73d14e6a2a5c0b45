"""Single sign-on through the organisation's OpenID provider (issue 45): the authorization code
flow with PKCE, through Authlib's client.

- `begin` starts a sign-in: a random `state`, `nonce` and PKCE verifier; the row kept
  (`OidcLogin`, 10 minutes, found by the state's SHA-256) holds the nonce and the verifier's
  SHA-256; the verifier itself goes to the browser as a cookie, so only that browser can finish.
- `take` and `finish` take the provider's answer: the row is deleted as it is read, in a
  transaction of its own (a replayed callback finds nothing), the verifier checked against it;
  then the code is exchanged (the provider refuses a code twice) and the ID token checked: its
  signature against the provider's keys (JWKS, read again once when a token names a key not
  seen, so a rotation is followed), `iss`, `aud`, `exp`/`iat` on the control plane's clock, and
  the `nonce`.
- The person: found by `<issuer> <sub>`, made at their first sign-in with the name of the
  username claim, their role the highest their groups map to (`MODELFORGE_OIDC_ROLES`), again at
  every sign-in.

The provider's metadata is read from its discovery document and kept an hour; every call to it
has a 10 s timeout. The client secret, codes and tokens are never logged or put in a message.
"""

from __future__ import annotations

import re
import secrets
import threading
import warnings
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

import authlib.deprecate
import httpx
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from control_plane.access import people
from control_plane.access.roles import Role
from control_plane.clock import Clock
from control_plane.db import rowcount
from control_plane.errors import AdminAuthError, Conflict, ModelForgeError, NotFound
from control_plane.models import OidcLogin, User
from control_plane.security import sha256_hex
from control_plane.settings import Settings

with warnings.catch_warnings():
    warnings.simplefilter("ignore", authlib.deprecate.AuthlibDeprecationWarning)
    from authlib.integrations.base_client.errors import OAuthError
    from authlib.integrations.httpx_client import OAuth2Client

LOGIN_LIFETIME = timedelta(minutes=10)
#: Seconds of clock difference with the provider an ID token's times may show.
LEEWAY_SECONDS = 60
METADATA_SECONDS = 3600.0
_TIMEOUT = 10.0
#: The highest role of several groups wins.
_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.OPERATOR: 2, Role.ADMIN: 3}
_ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "ES256", "ES384", "EdDSA"]
_AGAIN = "Start again from the console's sign-in page."


class OidcRefused(ModelForgeError):
    """A sign-in through the provider that cannot finish."""

    http_status = 401
    code = "OIDC_SIGN_IN_FAILED"


@dataclass(frozen=True)
class Taken:
    """A sign-in's row, once taken."""

    nonce: str
    verifier_hash: str
    expires_at: datetime


@dataclass(frozen=True)
class Begun:
    url: str
    #: The browser's half of the sign-in (its cookie): the PKCE verifier.
    verifier: str


class OidcProvider:
    """One per control-plane process, when single sign-on is configured."""

    def __init__(self, settings: Settings, clock: Clock) -> None:
        assert settings.oidc_issuer and settings.oidc_client_id  # noqa: S101 - Settings checked
        assert settings.oidc_client_secret is not None  # noqa: S101
        self.issuer = settings.oidc_issuer.rstrip("/")
        self.client_id = settings.oidc_client_id
        self._secret = settings.oidc_client_secret
        self.display_name = settings.oidc_display_name
        self._scopes = settings.oidc_scopes
        self._redirect = settings.oidc_redirect_uri
        self._username_claim = settings.oidc_username_claim
        self._groups_claim = settings.oidc_groups_claim
        self._roles = {group: Role(role) for group, role in settings.oidc_role_map.items()}
        self._default = (
            None if settings.oidc_default_role is None else Role(settings.oidc_default_role)
        )
        self._clock = clock
        self._lock = threading.Lock()
        self._metadata: dict[str, Any] | None = None
        self._metadata_at = 0.0
        self._keys: KeySet | None = None

    # -- the flow --------------------------------------------------------------------------

    def begin(self, session: Session) -> Begun:
        """A new sign-in: the provider's authorization URL (its discovery document read first,
        outside the transaction `session` writes the sign-in's row in)."""
        endpoint = self._meta("authorization_endpoint")
        state, nonce = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        verifier = secrets.token_urlsafe(48)
        with self._client() as client:
            url, _ = client.create_authorization_url(
                endpoint, state=state, code_verifier=verifier, nonce=nonce
            )
        now = self._clock.now()
        session.execute(delete(OidcLogin).where(OidcLogin.expires_at <= now))
        session.add(
            OidcLogin(
                state_hash=sha256_hex(state),
                nonce=nonce,
                verifier_hash=sha256_hex(verifier),
                expires_at=now + LOGIN_LIFETIME,
            )
        )
        return Begun(url=url, verifier=verifier)

    def take(self, session: Session, *, state: str) -> Taken | None:
        """The sign-in `state` names, deleted as it is read (used once, whatever follows: commit
        before `finish`); None when there is none."""
        row = session.get(OidcLogin, sha256_hex(state)) if len(state) <= 200 else None
        if row is None:
            return None
        deleted = session.execute(delete(OidcLogin).where(OidcLogin.state_hash == row.state_hash))
        if not rowcount(deleted):  # another callback took it first
            return None
        return Taken(nonce=row.nonce, verifier_hash=row.verifier_hash, expires_at=row.expires_at)

    def finish(self, taken: Taken | None, *, code: str, verifier: str | None) -> dict[str, Any]:
        """The ID token's claims once the sign-in is this browser's and not expired, the code
        exchanged (PKCE) and the token checked; `OidcRefused` otherwise. It calls the provider:
        no transaction is open."""
        if taken is None or taken.expires_at <= self._clock.now():
            raise OidcRefused(
                "This sign-in was already finished, has expired, or was not started here.",
                _AGAIN,
                code="OIDC_STATE_INVALID",
            )
        if not secrets.compare_digest(sha256_hex(verifier or ""), taken.verifier_hash):
            raise OidcRefused(
                "This sign-in was started in another browser (its cookie is missing or differs).",
                "Start again in this browser, with cookies allowed for the control plane.",
                code="OIDC_STATE_INVALID",
            )
        return self.check_id_token(self._exchange(code, verifier or ""), nonce=taken.nonce)

    def check_id_token(self, id_token: str, *, nonce: str) -> dict[str, Any]:
        """The claims of `id_token` once its signature, issuer, audience, times and nonce hold."""
        try:
            token = self._decode(id_token)
            now = int(self._clock.now().timestamp())
            jwt.JWTClaimsRegistry(
                now=now,
                leeway=LEEWAY_SECONDS,
                iss={"essential": True, "value": self.issuer},
                aud={"essential": True, "value": self.client_id},
                sub={"essential": True},
                exp={"essential": True},
                iat={"essential": True},
                nonce={"essential": True, "value": nonce},
            ).validate(token.claims)
        except JoseError as exc:
            claim = getattr(exc, "claim", None)
            raise OidcRefused(
                "The provider's ID token was refused"
                + (f" (its `{claim}` claim)." if claim else f" ({exc.error}).")
                + " A token for another client, from another issuer, expired, or not the one "
                "this sign-in asked for is never accepted.",
                _AGAIN + " If it persists, check MODELFORGE_OIDC_ISSUER and "
                "MODELFORGE_OIDC_CLIENT_ID, and the clocks of both hosts.",
                code="OIDC_TOKEN_INVALID",
            ) from None
        return dict(token.claims)

    def person(self, session: Session, claims: dict[str, Any]) -> User:
        """The user these claims sign in as: found by subject, or made; their role set."""
        role = self._role(claims.get(self._groups_claim))
        subject = f"{self.issuer} {claims['sub']}"
        user = session.scalar(select(User).where(User.oidc_subject == subject))
        now = self._clock.now()
        if user is None:
            name = str(claims.get(self._username_claim) or "").strip().lower()
            if not re.fullmatch(people.USER_NAME_PATTERN, name):
                raise OidcRefused(
                    f"The provider's `{self._username_claim}` claim is not a usable name "
                    "(lower case letters, digits, '.', '_', '-'; 32 at most).",
                    "Ask the operator to set MODELFORGE_OIDC_USERNAME_CLAIM to a claim that is.",
                    code="OIDC_NAME_INVALID",
                )
            try:
                user = people.create_user(
                    session=session,
                    clock=self._clock,
                    actor="oidc",
                    name=name,
                    role=role,
                    password=None,
                    oidc_subject=subject,
                )
            except Conflict:  # USER_EXISTS: the name is another user's
                raise Conflict(
                    "Another user has this name (a local user, or another of the provider's "
                    "people).",
                    "An admin removes that user (or changes the provider's username claim, "
                    "MODELFORGE_OIDC_USERNAME_CLAIM), then sign in again.",
                    code="OIDC_NAME_TAKEN",
                ) from None
        elif user.role != role.value:
            user.role, user.updated_at = role.value, now
        if user.disabled:
            raise AdminAuthError(
                "This user is disabled.",
                "Ask an admin to enable the user again, then sign in.",
                code="USER_DISABLED",
            )
        session.flush()
        return user

    # -- inside -------------------------------------------------------------------------------

    def _role(self, groups: object) -> Role:
        names = [str(g) for g in groups] if isinstance(groups, list) else []
        mapped = [self._roles[g] for g in names if g in self._roles]
        if mapped:
            return max(mapped, key=_RANK.__getitem__)
        if self._default is not None:
            return self._default
        raise OidcRefused(
            f"None of your {len(names)} groups in the `{self._groups_claim}` claim maps to a role.",
            "Ask the operator to map one of your groups (MODELFORGE_OIDC_ROLES).",
            code="OIDC_NO_ROLE",
        )

    def _client(self) -> OAuth2Client:
        return OAuth2Client(
            client_id=self.client_id,
            client_secret=self._secret.get_secret_value(),
            token_endpoint_auth_method="client_secret_basic",  # noqa: S106 - a method's name
            scope=self._scopes,
            redirect_uri=self._redirect,
            code_challenge_method="S256",
            timeout=_TIMEOUT,
        )

    def _exchange(self, code: str, verifier: str) -> str:
        try:
            with self._client() as client:
                token = client.fetch_token(
                    self._meta("token_endpoint"), code=code, code_verifier=verifier
                )
        except (OAuthError, httpx.HTTPError) as exc:
            reason = getattr(exc, "error", None) or type(exc).__name__
            raise OidcRefused(
                f"The provider refused the sign-in's code ({reason}): used already, expired, or "
                "not issued to this client.",
                _AGAIN,
                code="OIDC_CODE_REFUSED",
            ) from None
        id_token = token.get("id_token")
        if not isinstance(id_token, str):
            raise OidcRefused("The provider answered without an ID token.", _AGAIN)
        return id_token

    def _decode(self, id_token: str) -> jwt.Token:
        try:
            return jwt.decode(id_token, self._key_set(refresh=False), algorithms=_ALGORITHMS)
        except JoseError as exc:
            if type(exc).__name__ not in ("MissingKeyError", "InvalidKeyIdError"):
                raise
        # A key not seen: the provider may have rotated its keys. Read them once more.
        return jwt.decode(id_token, self._key_set(refresh=True), algorithms=_ALGORITHMS)

    def _key_set(self, *, refresh: bool) -> KeySet:
        with self._lock:
            if self._keys is not None and not refresh:
                return self._keys
        keys = KeySet.import_key_set(cast(Any, self._get(self._meta("jwks_uri"))))
        with self._lock:
            self._keys = keys
        return keys

    def _meta(self, field: str) -> str:
        with self._lock:
            fresh = self._metadata is not None and (
                self._clock.monotonic() - self._metadata_at < METADATA_SECONDS
            )
            metadata = self._metadata
        if not fresh or metadata is None:
            metadata = self._get(f"{self.issuer}/.well-known/openid-configuration")
            if str(metadata.get("issuer", "")).rstrip("/") != self.issuer:
                raise _unreachable("its discovery document names another issuer")
            with self._lock:
                self._metadata, self._metadata_at = metadata, self._clock.monotonic()
        value = metadata.get(field)
        if not isinstance(value, str):
            raise _unreachable(f"its discovery document has no {field}")
        return value

    def _get(self, url: str) -> dict[str, Any]:
        try:
            response = httpx.get(url, timeout=_TIMEOUT)
            response.raise_for_status()
            answer = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise _unreachable(type(exc).__name__) from None
        if not isinstance(answer, dict):
            raise _unreachable("it answered something other than a JSON object")
        return answer


class OidcUnavailable(OidcRefused):
    """The provider could not be asked (down, or its documents unusable)."""

    http_status = 502
    code = "OIDC_PROVIDER_UNAVAILABLE"


def _unreachable(why: str) -> OidcUnavailable:
    return OidcUnavailable(
        f"The OpenID provider could not be used: {why}.",
        "Try again shortly; if it persists, check MODELFORGE_OIDC_ISSUER and that the control "
        "plane reaches the provider.",
    )


def not_configured() -> NotFound:
    return NotFound(
        "Single sign-on is not configured on this control plane.",
        "Sign in with your name and password, or ask the operator to set MODELFORGE_OIDC_ISSUER "
        "(docs/access.md).",
        code="OIDC_NOT_CONFIGURED",
    )
