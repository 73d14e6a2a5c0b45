"""The replicas' shared key (gateway/peers.py): made once whoever asks first, the same for every
replica starting at once; and a signature (gateway/peer_signature.py) holds only for its method,
path, query, headers, holder, time and body, and once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session

from control_plane.gateway.peer_signature import (
    LENGTH_HEADER,
    NONCE_HEADER,
    TIME_HEADER,
    VALIDITY,
    NonceStore,
    PeerRefused,
    SignedRequest,
    Verified,
    sign_request,
    verify_request,
)
from control_plane.gateway.peers import ensure_peer_key
from control_plane.models import GatewayPeerKey


def test_replicas_starting_together_agree_on_one_key(pg_database_url: str) -> None:
    engine = create_engine(pg_database_url, pool_size=8)

    def start() -> bytes:
        with Session(engine) as session, session.begin():
            return ensure_peer_key(session, now=datetime.now(UTC))

    try:
        with ThreadPoolExecutor(8) as pool:
            keys = list(pool.map(lambda _: start(), range(8)))
        with Session(engine) as session:
            rows = session.scalar(select(func.count()).select_from(GatewayPeerKey))
    finally:
        engine.dispose()
    assert len(set(keys)) == 1 and len(keys[0]) >= 64
    assert rows == 1


KEY = b"k" * 64
PATH = "/api/v1/internal/gateway/n1/r1/infer"
CLIENT_HEADERS = [
    ("content-type", "application/json"),
    ("content-length", "11"),
    ("accept", "a"),
    ("accept", "b"),
]


def _signed(**changes: object) -> SignedRequest:
    request: dict[str, object] = {
        "method": "POST",
        "path": PATH,
        "query": "a=1",
        "holder": "cp-1",
        "timestamp": "1000.000",
        "headers": CLIENT_HEADERS,
    }
    request.update(changes)
    return sign_request(KEY, **request)  # type: ignore[arg-type]


def _verify(headers: list[tuple[str, str]], nonces: NonceStore, **changes: object) -> Verified:
    request: dict[str, object] = {
        "method": "POST",
        "path": PATH,
        "query": "a=1",
        "headers": headers,
        "holder": "cp-1",
        "now": 1000.0,
        "nonces": nonces,
    }
    request.update(changes)
    return verify_request(KEY, **request)  # type: ignore[arg-type]


def _code(headers: list[tuple[str, str]], **changes: object) -> str:
    with pytest.raises(PeerRefused) as refused:
        _verify(headers, NonceStore(), **changes)
    return refused.value.code


def test_a_signature_holds_for_its_request_holder_and_time_only() -> None:
    headers = _signed().headers
    verified = _verify(headers, NonceStore(), now=1000.0 + VALIDITY - 1)
    # Every header passed on was signed; the client's length travels signed, the body held to it.
    assert verified.headers == [
        ("accept", "a"),
        ("accept", "b"),
        ("content-type", "application/json"),
    ]
    assert verified.body.declared == 11
    assert _code(headers, now=1000.0 + VALIDITY + 1) == "PEER_SIGNATURE_EXPIRED"
    assert _code(headers, holder="cp-2") == "PEER_WRONG_HOLDER"
    for change in ({"method": "GET"}, {"path": PATH.replace("r1", "r2")}, {"query": "a=2"}):
        assert _code(headers, **change) == "PEER_SIGNATURE_INVALID", change
    # Characters beyond Latin-1 are signed as themselves, never folded into one another.
    accented = _signed(path=PATH + "/€").headers
    _verify(accented, NonceStore(), path=PATH + "/€")
    for path in (PATH + "/✓", PATH + "/?"):
        assert _code(accented, path=path) == "PEER_SIGNATURE_INVALID", path
    for name, value in (
        ("content-type", "text/html"),  # changed
        (LENGTH_HEADER, "12"),
        (TIME_HEADER, "1001.000"),
        (NONCE_HEADER, "0" * 32),
    ):
        changed = [(n, value if n == name else v) for n, v in headers]
        assert _code(changed) == "PEER_SIGNATURE_INVALID", name
    # A signed header added, or one of its values removed, breaks it too.
    assert _code([*headers, ("content-type", "text/html")]) == "PEER_SIGNATURE_INVALID"
    assert _code([h for h in headers if h != ("accept", "b")]) == "PEER_SIGNATURE_INVALID"
    assert _code([h for h in headers if h[0] != TIME_HEADER]) == "PEER_SIGNATURE_INVALID"
    assert _code([]) == "PEER_SIGNATURE_INVALID"
    other_key = sign_request(
        b"x" * 64,
        method="POST",
        path=PATH,
        query="a=1",
        holder="cp-1",
        timestamp="1000.000",
        headers=CLIENT_HEADERS,
    )
    assert _code(other_key.headers) == "PEER_SIGNATURE_INVALID"
    # An unsigned header added on the way is not refused, but never passed on.
    added = _verify([*headers, ("x-user", "admin")], NonceStore())
    assert "x-user" not in dict(added.headers)


def test_a_nonce_is_accepted_once_and_remembered_for_its_window_only() -> None:
    nonces = NonceStore(capacity=2)
    first = _signed().headers
    _verify(first, nonces)
    with pytest.raises(PeerRefused) as replayed:
        _verify(first, nonces, now=1000.0 + VALIDITY)
    assert (replayed.value.status, replayed.value.code) == (401, "PEER_NONCE_REPLAYED")
    _verify(_signed().headers, nonces)
    with pytest.raises(PeerRefused) as full:  # full: refused, none forgotten early
        _verify(_signed().headers, nonces)
    assert (full.value.code, full.value.transport) == ("PEER_BUSY", True)
    # Past their window the nonces are forgotten (a replay then fails on its time).
    later = _signed(timestamp=f"{1000.0 + 2 * VALIDITY + 1:.3f}").headers
    _verify(later, nonces, now=1000.0 + 2 * VALIDITY + 1)
    assert len(nonces) == 1


def _body_code(feed: list[bytes], *, finish: bool = True, declared: int | None = 11) -> str:
    signed = _signed(headers=[("content-length", str(declared))] if declared is not None else [])
    check = _verify(signed.headers, NonceStore()).body
    with pytest.raises(PeerRefused) as refused:
        for data in feed:
            check.feed(data)
        if finish:
            check.finish()
    return refused.value.code


def test_the_body_is_checked_frame_by_frame_against_its_head() -> None:
    signed = _signed()
    body = b"hello world"
    sealed = b"".join([*signed.seal.frames(body[:5]), *signed.seal.frames(body[5:])])
    end = signed.seal.end()
    check = _verify(signed.headers, NonceStore()).body
    # Split anywhere, the payloads come out as sent, each frame checked whole.
    out = b"".join(check.feed(sealed[i : i + 3]) for i in range(0, len(sealed), 3))
    assert out == body and check.feed(end) == b"" and check.ended
    check.finish()

    # The same frames under another request's head (another nonce): refused.
    assert _body_code([sealed, end]) == "PEER_BODY_INVALID"
    # One byte changed, frames reordered, cut short, past the end, longer than declared.
    replay = _signed()
    first, second = replay.seal.frames(body[:5]), replay.seal.frames(body[5:])
    frames = [next(first), next(second), replay.seal.end()]

    def code(feed: list[bytes], **options: object) -> str:
        check = _verify(replay.headers, NonceStore()).body
        with pytest.raises(PeerRefused) as refused:
            for data in feed:
                check.feed(data)
            if options.get("finish", True):
                check.finish()
        return refused.value.code

    changed = bytearray(frames[0])
    changed[5] ^= 1
    assert code([bytes(changed), *frames[1:]]) == "PEER_BODY_INVALID"
    assert code([frames[1], frames[0], frames[2]]) == "PEER_BODY_INVALID"
    assert code(frames[:2]) == "PEER_BODY_INVALID"  # no last frame
    assert code([*frames, b"x"]) == "PEER_BODY_INVALID"
    long = _signed(headers=[("content-length", "3")])
    check = _verify(long.headers, NonceStore()).body
    with pytest.raises(PeerRefused, match="longer than its declared"):
        check.feed(next(long.seal.frames(body)))
