"""Console sessions: the admin token, or a user's name and password, is exchanged once for a
short-lived session.

The cookie carries a random session id; the database keeps only its SHA-256. The CSRF token is
an HMAC of the session id, so it is bound to exactly one session and never stored. Ending a
session deletes its row: a copied cookie stops working at once, in every replica.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.orm import Session

from control_plane.clock import Clock
from control_plane.db import rowcount
from control_plane.errors import AdminAuthError, CsrfError, TooManyRequests
from control_plane.models import ConsoleSession, User
from control_plane.security import sha256_hex

_SIGN_IN_AGAIN = "Sign in to the console again (your name and password, or the admin token)."


@dataclass(frozen=True)
class SignedIn:
    session_id: str = field(repr=False)
    expires_at: datetime
    #: The user a password sign-in made it for; None: made with the admin token.
    user_id: str | None = None
    #: That user's row, read with the session's (None when `user_id` is None).
    user: User | None = field(default=None, repr=False, compare=False)

    @property
    def csrf_token(self) -> str:
        return csrf_token_for(self.session_id)


class SignInThrottle:
    """Slows down guessing the admin token, wherever it is presented (the console's sign-in and
    the X-ModelForge-Admin-Token header share one count): after `limit` wrong tokens from one
    client address within `window`, that address is refused — even with the right token, so the
    refusal tells a guesser nothing — until the oldest of them leaves the window. In memory, per
    process; a right token (accepted while not refused) clears the address's record."""

    def __init__(
        self,
        *,
        limit: int = 10,
        window: timedelta = timedelta(minutes=5),
        what: str = "admin tokens",
        source: str = "the token from the control plane's admin-token file or "
        "MODELFORGE_ADMIN_TOKEN",
    ) -> None:
        self.limit = limit
        self.window = window
        #: What is guessed, and where the right one comes from (the refusal names both).
        self.what, self.source = what, source
        self._failures: dict[str, deque[datetime]] = {}
        self._lock = threading.Lock()

    def check(self, address: str, now: datetime, *, then: str = "sign in") -> None:
        """`TooManyRequests` while `address` is refused; `then` completes the next step
        ("Wait N s, then <then> with the token from …")."""
        with self._lock:
            failures = self._recent(address, now)
            if len(failures) < self.limit:
                return
            wait = int((failures[0] + self.window - now).total_seconds()) + 1
        raise TooManyRequests(
            f"Too many wrong {self.what} from this address ({self.limit} within "
            f"{int(self.window.total_seconds() // 60)} minutes).",
            f"Wait {wait} s, then {then} with {self.source}.",
            code="SIGN_IN_RATE_LIMITED",
        )

    def failed(self, address: str, now: datetime) -> None:
        with self._lock:
            self._recent(address, now).append(now)

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._failures.pop(address, None)

    def _recent(self, address: str, now: datetime) -> deque[datetime]:
        failures = self._failures.setdefault(address, deque())
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        if len(self._failures) > 10_000:  # bounded: forget addresses with nothing recent
            for key in [k for k, v in self._failures.items() if not v and k != address]:
                del self._failures[key]
        return failures


def csrf_token_for(session_id: str) -> str:
    return hmac.new(session_id.encode(), b"modelforge-console-csrf", hashlib.sha256).hexdigest()


def start_session(
    *, session: Session, clock: Clock, lifetime: timedelta, user: User | None = None
) -> SignedIn:
    """A new session (a new random id at every sign-in: a session id is never carried over)."""
    session_id = secrets.token_urlsafe(32)
    now = clock.now()
    session.add(
        ConsoleSession(
            id_hash=sha256_hex(session_id),
            created_at=now,
            expires_at=now + lifetime,
            user_id=None if user is None else user.id,
        )
    )
    return SignedIn(
        session_id=session_id,
        expires_at=now + lifetime,
        user_id=None if user is None else user.id,
        user=user,
    )


def find_session(*, session: Session, clock: Clock, session_id: str) -> SignedIn:
    """The session a cookie names, with its user's row (read in the same session)."""
    row = session.get(ConsoleSession, sha256_hex(session_id))
    if row is None:
        raise AdminAuthError(
            "This console session has ended (signed out, or the control plane forgot it).",
            _SIGN_IN_AGAIN,
            code="SESSION_INVALID",
        )
    if row.expires_at <= clock.now():
        raise AdminAuthError(
            "This console session has expired.", _SIGN_IN_AGAIN, code="SESSION_EXPIRED"
        )
    user = None if row.user_id is None else session.get(User, row.user_id)
    return SignedIn(
        session_id=session_id, expires_at=row.expires_at, user_id=row.user_id, user=user
    )


def check_csrf(signed_in: SignedIn, presented: str | None) -> None:
    if not presented:
        raise CsrfError(
            "This change needs the console's CSRF token and the request carried none.",
            "Use the console; scripts should send X-ModelForge-Admin-Token instead of a cookie.",
            code="CSRF_TOKEN_MISSING",
        )
    # Bytes: compare_digest refuses non-ASCII str, and a header may carry anything.
    if not hmac.compare_digest(presented.encode(), signed_in.csrf_token.encode()):
        raise CsrfError(
            "The CSRF token does not belong to this console session.",
            "Reload the console page; if it persists, sign out and sign in again.",
            code="CSRF_TOKEN_INVALID",
        )


def end_session(*, session: Session, session_id: str) -> bool:
    result = session.execute(
        delete(ConsoleSession).where(ConsoleSession.id_hash == sha256_hex(session_id))
    )
    return rowcount(result) > 0


def prune_sessions(*, session: Session, clock: Clock) -> int:
    result = session.execute(delete(ConsoleSession).where(ConsoleSession.expires_at <= clock.now()))
    return rowcount(result)
