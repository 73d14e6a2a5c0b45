"""How control-plane replicas sign the requests they forward to one another, and how the holder
checks them (issue 40): `peers.py` signs, `api/gateway_peers.py` checks.

A request's head is signed with HMAC-SHA256 under the replicas' shared key over, each field
length-prefixed (`len:bytes`, so no field can run into the next): a version, the method, the
path (decoded, as every server gives it), the query (as sent), the holder it is for (the
process's id in `gateway_tunnels`), the time, a random nonce, the list of signed header names
(`SIGNED_HEADER`), and each of those headers' values in order. The forwarding replica signs
every header it sends on; the holder passes on to the replica only the signed ones, so a header
added on the way reaches no one, and a signed one added, changed or removed breaks the
signature. The client's `Content-Length` travels as `LENGTH_HEADER` (signed): the peer request's
own body is framed.

The body goes as frames, `u32 length | payload | mac`, each mac an HMAC of the previous one (the
head's signature first), the frame's length and its payload; a frame of length 0 ends it. So the
holder checks each piece before passing it on, and a body changed, cut short, lengthened or
reordered on the way is refused at its first changed frame (`BodyCheck`); the first frame is
checked before the replica is asked for anything.

The holder accepts a head within `VALIDITY` seconds of its clock, for itself only (another
holder's is misdirected: it never forwards), and each nonce once (`NonceStore`, per process:
a request is signed for one holder, one process). Every refusal is a `PeerRefused` with its
code. Nothing here logs a header, a body or the key.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import re
import secrets
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

VERSION = b"modelforge-peer-3"
TIME_HEADER = "x-modelforge-peer-time"
NONCE_HEADER = "x-modelforge-peer-nonce"
HOLDER_HEADER = "x-modelforge-peer-holder"
#: The names of the signed headers, comma-separated, lowercase, each once.
SIGNED_HEADER = "x-modelforge-peer-signed"
#: The client's declared body length, when it declared one.
LENGTH_HEADER = "x-modelforge-peer-length"
SIGNATURE_HEADER = "x-modelforge-peer-signature"
#: On the holder's answer: the stream failed before any response (its cause), not the replica.
FAILURE_HEADER = "x-modelforge-peer-failure"
PEER_HEADERS = frozenset(
    {
        TIME_HEADER,
        NONCE_HEADER,
        HOLDER_HEADER,
        SIGNED_HEADER,
        LENGTH_HEADER,
        SIGNATURE_HEADER,
        FAILURE_HEADER,
    }
)
#: How far a signed request's time may be from the holder's clock, in seconds.
VALIDITY = 30.0
#: A body frame's payload at most (a larger chunk goes as several frames).
MAX_FRAME = 64 * 1024
#: Nonces remembered at once per process (each for up to 2 x VALIDITY): past it, a request is
#: refused (503, `PEER_BUSY`) rather than one forgotten early.
NONCE_CAPACITY = 200_000
_MAC = 32
_LENGTH = 4
_NONCE = re.compile(r"[0-9a-f]{32}")
_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")


class PeerRefused(Exception):
    """A peer request the holder refuses: `status`, `code` and what is wrong. `transport`: the
    caller may try elsewhere (the holder's answer carries `FAILURE_HEADER`)."""

    def __init__(self, status: int, code: str, message: str, *, transport: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.transport = status, code, message, transport


def _invalid(message: str) -> PeerRefused:
    return PeerRefused(401, "PEER_SIGNATURE_INVALID", message)


def _field(value: str) -> bytes:
    # Every character as itself: a lossy encoding ("replace") would sign `/r/€` and `/r/?` alike.
    data = value.encode("utf-8", "surrogatepass")
    return str(len(data)).encode() + b":" + data


def head_signature(
    key: bytes,
    *,
    method: str,
    path: str,
    query: str,
    holder: str,
    timestamp: str,
    nonce: str,
    names: Sequence[str],
    headers: Iterable[tuple[str, str]],
) -> bytes:
    """The head's MAC; `headers` are the signed ones (their names in `names`), in order."""
    fields = [method.upper(), path, query, holder, timestamp, nonce, ",".join(names)]
    for name, value in headers:
        fields += [name.lower(), value]
    message = VERSION + b"\n" + b"".join(_field(item) for item in fields)
    return hmac.new(key, message, hashlib.sha256).digest()


class BodySeal:
    """The forwarding replica's side of the body: each chunk framed and chained."""

    def __init__(self, key: bytes, seed: bytes) -> None:
        self._key, self._mac = key, seed

    def _frame(self, payload: bytes) -> bytes:
        head = len(payload).to_bytes(_LENGTH, "big")
        self._mac = hmac.new(self._key, self._mac + head + payload, hashlib.sha256).digest()
        return head + payload + self._mac

    def frames(self, chunk: bytes) -> Iterator[bytes]:
        for start in range(0, len(chunk), MAX_FRAME):
            yield self._frame(chunk[start : start + MAX_FRAME])

    def end(self) -> bytes:
        return self._frame(b"")


class BodyCheck:
    """The holder's side: bytes in, checked payloads out; `PeerRefused` at the first frame that
    does not hold, a body longer than `declared`, bytes past the end, or an end short of it."""

    def __init__(self, key: bytes, seed: bytes, *, declared: int | None) -> None:
        self._key, self._mac, self.declared = key, seed, declared
        self._buffer = bytearray()
        self.size = 0
        self.ended = False

    def feed(self, data: bytes) -> bytes:
        """The payload of every whole frame `data` completes, checked."""
        if self.ended and data:
            raise _body("bytes follow the body's last frame")
        self._buffer += data
        out = bytearray()
        while len(self._buffer) >= _LENGTH:
            length = int.from_bytes(self._buffer[:_LENGTH], "big")
            if length > MAX_FRAME:
                raise _body("a body frame is longer than a frame may be")
            end = _LENGTH + length + _MAC
            if len(self._buffer) < end:
                break
            head_payload = bytes(self._buffer[: _LENGTH + length])
            mac = hmac.new(self._key, self._mac + head_payload, hashlib.sha256).digest()
            if not hmac.compare_digest(mac, bytes(self._buffer[_LENGTH + length : end])):
                raise _body("a body frame's signature does not match: the body was changed")
            del self._buffer[:end]
            self._mac = mac
            self.size += length
            if self.declared is not None and self.size > self.declared:
                raise _body("the body is longer than its declared length")
            if length == 0:
                self.ended = True
                if self._buffer:
                    raise _body("bytes follow the body's last frame")
                if self.declared is not None and self.size != self.declared:
                    raise _body("the body is shorter than its declared length")
                break
            out += head_payload[_LENGTH:]
        return bytes(out)

    def finish(self) -> None:
        """The peer request's body ended: it must have ended with its last frame."""
        if not self.ended:
            raise _body("the body ended before its last frame")


def _body(message: str) -> PeerRefused:
    return PeerRefused(401, "PEER_BODY_INVALID", message)


class NonceStore:
    """The nonces accepted in the last 2 x `VALIDITY` s by this process, each refused again."""

    def __init__(self, *, capacity: int = NONCE_CAPACITY) -> None:
        self.capacity = capacity
        self._until: dict[str, float] = {}
        self._expiry: list[tuple[float, str]] = []

    def claim(self, nonce: str, *, until: float, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            _, old = heapq.heappop(self._expiry)
            self._until.pop(old, None)
        if nonce in self._until:
            raise PeerRefused(401, "PEER_NONCE_REPLAYED", "this request was accepted before")
        if len(self._until) >= self.capacity:
            raise PeerRefused(
                503, "PEER_BUSY", "too many peer requests in the window", transport=True
            )
        self._until[nonce] = until
        heapq.heappush(self._expiry, (until, nonce))

    def __len__(self) -> int:
        return len(self._until)


@dataclass(frozen=True, slots=True)
class SignedRequest:
    """What the forwarding replica sends: its headers (the peer ones added) and the body's seal."""

    headers: list[tuple[str, str]]
    seal: BodySeal


def sign_request(
    key: bytes,
    *,
    method: str,
    path: str,
    query: str,
    holder: str,
    timestamp: str,
    headers: Iterable[tuple[str, str]],
) -> SignedRequest:
    """Sign a request for `holder`: every header in `headers` (the client's `content-length`
    becomes `LENGTH_HEADER`), a fresh nonce."""
    sent: list[tuple[str, str]] = []
    length: str | None = None
    for name, value in headers:
        lower = name.lower()
        if lower == "content-length":
            length = value
        elif lower not in PEER_HEADERS:
            sent.append((lower, value))
    if length is not None:
        sent.append((LENGTH_HEADER, length))
    names = sorted({name for name, _ in sent})
    ordered = _in_order(sent, names)
    nonce = secrets.token_hex(16)
    mac = head_signature(
        key,
        method=method,
        path=path,
        query=query,
        holder=holder,
        timestamp=timestamp,
        nonce=nonce,
        names=names,
        headers=ordered,
    )
    peer = [
        (TIME_HEADER, timestamp),
        (NONCE_HEADER, nonce),
        (HOLDER_HEADER, holder),
        (SIGNED_HEADER, ",".join(names)),
        (SIGNATURE_HEADER, mac.hex()),
    ]
    return SignedRequest(headers=ordered + peer, seal=BodySeal(key, mac))


def _in_order(headers: Iterable[tuple[str, str]], names: Sequence[str]) -> list[tuple[str, str]]:
    """The headers named in `names`, by name in that order, each name's values as they came."""
    wanted = set(names)
    picked = [(name.lower(), value) for name, value in headers if name.lower() in wanted]
    return sorted(picked, key=lambda pair: names.index(pair[0]))


@dataclass(frozen=True, slots=True)
class Verified:
    """A head that holds: the headers to pass on (the signed ones, but the length) and the
    body's check (`body.declared`: the client's length, which the body is held to)."""

    headers: list[tuple[str, str]]
    body: BodyCheck


def verify_request(
    key: bytes,
    *,
    method: str,
    path: str,
    query: str,
    headers: Sequence[tuple[str, str]],
    holder: str,
    now: float,
    nonces: NonceStore,
) -> Verified:
    """Check a peer request's head (see the module's docstring); `PeerRefused` when it fails."""
    found: dict[str, str] = {}
    for name, value in headers:
        lower = name.lower()
        if lower in PEER_HEADERS:
            if lower in found:
                raise _invalid(f"{lower} appears twice")
            found[lower] = value
    timestamp, nonce = found.get(TIME_HEADER, ""), found.get(NONCE_HEADER, "")
    signature, listed = found.get(SIGNATURE_HEADER, ""), found.get(SIGNED_HEADER, "")
    signed_for = found.get(HOLDER_HEADER, "")
    if not (timestamp and signature and _NONCE.fullmatch(nonce) and signed_for):
        raise _invalid("the request is not signed")
    names = listed.split(",") if listed else []
    if any(not _NAME.fullmatch(name) for name in names) or names != sorted(set(names)):
        raise _invalid("the list of signed headers is malformed")
    ordered = _in_order(
        [(n, v) for n, v in headers if n.lower() not in PEER_HEADERS - {LENGTH_HEADER}], names
    )
    expected = head_signature(
        key,
        method=method,
        path=path,
        query=query,
        holder=signed_for,
        timestamp=timestamp,
        nonce=nonce,
        names=names,
        headers=ordered,
    )
    if not hmac.compare_digest(expected.hex().encode(), signature.encode("latin-1", "replace")):
        raise _invalid("the signature does not match the request")
    try:
        at = float(timestamp)
    except ValueError:
        at = math.nan
    if not abs(now - at) <= VALIDITY:  # also refuses NaN
        raise PeerRefused(401, "PEER_SIGNATURE_EXPIRED", "the signature is outside its window")
    if signed_for != holder:
        raise PeerRefused(
            421, "PEER_WRONG_HOLDER", "the request was signed for another process", transport=True
        )
    declared: int | None = None
    forwarded: list[tuple[str, str]] = []
    for name, value in ordered:
        if name == LENGTH_HEADER:
            if not value.isdigit() or declared is not None:
                raise _invalid("the declared length is malformed")
            declared = int(value)
        else:
            forwarded.append((name, value))
    nonces.claim(nonce, until=at + VALIDITY, now=now)
    return Verified(headers=forwarded, body=BodyCheck(key, expected, declared=declared))
