"""The gateway's framing and forwarding rules for a client's request (issue 40), the same on
both ends of the control plane: the Python gateway (`gateway.py`) and the native front
(`native/gateway_front/src/gateway.rs`, which applies them before it asks or carries).

- A request whose body's framing is ambiguous is refused 400 before anything of it is carried:
  `Content-Length` with `Transfer-Encoding`, a `Transfer-Encoding` other than `chunked`, or
  `Content-Length` values that differ or are not numbers. (A front's HTTP server refuses most of
  these already; the one it passes is a `Content-Length` sent before `Transfer-Encoding`.)
- The client's own `X-Forwarded-For`, `-Host`, `-Proto`, `Forwarded` and `X-Real-IP` are
  dropped; the gateway sets `X-Forwarded-For` (the client's address as the gateway sees it),
  `X-Forwarded-Proto` and `X-Forwarded-Host` (the request's `Host`) itself.

The client's `Content-Length` and `Transfer-Encoding` never reach a replica as sent
(`gateway_forward.crossing`): the gateway passes the length it read and checked, and the
agent's relay frames the replica's request from the bytes that arrive.
"""

from __future__ import annotations

from control_plane.api.asgi import Scope

#: What the gateway answers a request whose framing is ambiguous (400).
AMBIGUOUS_FRAMING = (
    "the request declares its body's framing ambiguously (Content-Length with "
    "Transfer-Encoding, a Transfer-Encoding other than chunked, or differing Content-Length "
    "values); send one Content-Length, or Transfer-Encoding: chunked alone"
)
#: A client's word on who it is or came through: never passed on (the gateway says it).
CLIENT_FORWARDING = frozenset(
    {b"x-forwarded-for", b"x-forwarded-host", b"x-forwarded-proto", b"forwarded", b"x-real-ip"}
)


def framing_refusal(headers: list[tuple[bytes, bytes]]) -> str | None:
    """`AMBIGUOUS_FRAMING` when the request's body framing is ambiguous, else None."""
    lengths: set[bytes] = set()
    codings: list[bytes] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"content-length":
            lengths.add(value.strip())  # a list ("5, 5") is not a number either
        elif lowered == b"transfer-encoding":
            codings += [part.strip().lower() for part in value.split(b",")]
    if codings and (lengths or codings != [b"chunked"]):
        return AMBIGUOUS_FRAMING
    if len(lengths) > 1 or any(not length.isdigit() for length in lengths):
        return AMBIGUOUS_FRAMING
    return None


def with_forwarding(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The request's headers less the client's forwarding headers, plus the gateway's own."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    kept = [(name, value) for name, value in headers if name.lower() not in CLIENT_FORWARDING]
    host = next((value for name, value in headers if name.lower() == b"host"), None)
    if (client := scope.get("client")) is not None:
        kept.append((b"x-forwarded-for", str(client[0]).encode("latin-1")))
    kept.append((b"x-forwarded-proto", str(scope.get("scheme", "http")).encode("latin-1")))
    if host is not None:
        kept.append((b"x-forwarded-host", host))
    return kept
