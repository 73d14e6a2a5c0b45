"""How an agent request the fast path may answer is framed, on either transport (HB-4).

The agents' fast path (`agent_fast.py`) decides what to answer; this module is how its requests
and answers are put on the wire, once for both of the ways it is served: as an ASGI seam (the
tests' in-process app, and a chunked agent request in the served app) and straight on Granian's
RSGI protocol object (`rsgi.ServedApp`). So both read the same bounded body and answer with the
same status, body and headers, apart from what each server adds itself (Granian writes RSGI's
Content-Length).

What the fast path decides is one `Outcome`:

- `Reply(status, body)`: it answers, with compact JSON (or no body, for a 204);
- `HandOn(body, more)`: the routes answer; the request goes on with the body read so far
  (`more`: the rest of it is still to be read from the client);
- `CLIENT_GONE`: the agent closed the connection first; nobody is answered.

It never reads more than `FAST_BODY_LIMIT` of a body and never decides an answer itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from control_plane.api.asgi import Receive, Send
from control_plane.api.edge import SECURITY_HEADERS

#: The most the fast path reads before it hands a request on; a real heartbeat is ~150 bytes.
FAST_BODY_LIMIT = 16 * 1024

_JSON_TYPE = (b"content-type", b"application/json")
#: RSGI's headers for a reply without a body and with a JSON one: text, built once (Granian
#: adds Content-Length). The RSGI bridge answers its own 500 with the JSON ones.
RSGI_SECURITY_HEADERS = [(name.decode(), value.decode()) for name, value in SECURITY_HEADERS]
RSGI_JSON_HEADERS = [(_JSON_TYPE[0].decode(), _JSON_TYPE[1].decode()), *RSGI_SECURITY_HEADERS]


@dataclass(frozen=True, slots=True)
class Reply:
    """The fast path answers: `status`, and `body`, compact JSON (empty for a 204).

    A reply the same for every request (a judged heartbeat's, a claim without work) is built
    once and kept, so answering it allocates nothing."""

    status: int
    body: bytes

    async def send_asgi(self, send: Send) -> None:
        """Send it as ASGI messages: Content-Type (when there is a body), Content-Length, then
        the security headers."""
        length = (b"content-length", str(len(self.body)).encode())
        if self.body:
            headers = [_JSON_TYPE, length, *SECURITY_HEADERS]
        else:
            headers = [length, *SECURITY_HEADERS]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})

    def send_rsgi(self, protocol: Any) -> None:
        """Send it through Granian's RSGI protocol object, whole."""
        headers = RSGI_JSON_HEADERS if self.body else RSGI_SECURITY_HEADERS
        protocol.response_bytes(self.status, headers, self.body)


@dataclass(frozen=True, slots=True)
class HandOn:
    """The routes answer: the request goes on with `body`, what was read of it, then (when
    `more`) the rest from the client."""

    body: bytes
    more: bool = False


class ClientGone:
    """The agent closed the connection before it was answered: nobody to answer."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CLIENT_GONE"


CLIENT_GONE: Final = ClientGone()

#: What the fast path decides for one agent request.
Outcome = Reply | HandOn | ClientGone


async def read_bounded(receive: Receive) -> bytes | HandOn | ClientGone:
    """An ASGI request's body, read until it ends or passes `FAST_BODY_LIMIT`: the body when it
    is complete within the limit (the fast path may answer it), else the `HandOn` of what was
    read; `CLIENT_GONE` when the client went away meanwhile.

    (On RSGI the served app reads a body in one piece only when its Content-Length is within the
    limit; any other it serves through the ASGI seam, which reads it here.)"""
    chunks: list[bytes] = []
    size = 0
    more = True
    while more and size <= FAST_BODY_LIMIT:
        message = await receive()
        if message["type"] != "http.request":
            return CLIENT_GONE
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        more = bool(message.get("more_body"))
    body = b"".join(chunks)
    if more or size > FAST_BODY_LIMIT:
        return HandOn(body, more)
    return body
