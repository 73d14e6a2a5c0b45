"""What the pure-ASGI seams in front of FastAPI share (`edge.py`, `agent_fast.py`): the
ASGI types, and handing on a request whose body a seam has already read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def replay(body: bytes, receive: Receive, *, more: bool = False) -> Receive:
    """A `receive` that yields the `body` read so far as one message, then reads on from the
    client (the rest of the body when `more`, or whatever the client does next)."""
    replayed = False

    async def replay_first() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return replay_first
