"""A small ASGI app served through `control_plane.api.rsgi.ASGIOverRSGI` by a real Granian
process (`tests/e2e/test_rsgi_bridge.py`): each path shows one thing the bridge must carry.

Set `BRIDGE_TEST_FAIL_STARTUP=1` to make its lifespan fail, `BRIDGE_TEST_RECORD` to a file the
app appends what it saw after answering (disconnects, shutdown) to, `BRIDGE_TEST_FILE` to the
file `/file` sends.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from typing import Any

from control_plane.api.asgi import Receive, Scope, Send
from control_plane.api.rsgi import ASGIOverRSGI

#: Put in an exception's message: never in an answer.
SECRET = "bridge-secret-5f1c"


def _record(line: str) -> None:
    with open(os.environ["BRIDGE_TEST_RECORD"], "a", encoding="utf-8") as out:
        out.write(line + "\n")


async def _json(send: Send, status: int, value: Any) -> None:
    body = json.dumps(value).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(scope: Scope, receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            if os.environ.get("BRIDGE_TEST_FAIL_STARTUP"):
                await send({"type": "lifespan.startup.failed", "message": SECRET})
                raise RuntimeError(f"cannot start ({SECRET})")
            scope["state"]["started"] = "yes"
            await send({"type": "lifespan.startup.complete"})
        else:
            _record("shutdown")
            await send({"type": "lifespan.shutdown.complete"})
            return


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await _lifespan(scope, receive, send)
        return
    path = scope["path"]
    if path == "/echo":
        digest, size, messages = hashlib.sha256(), 0, 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                _record(f"echo: disconnect after {size} bytes")
                return
            messages += 1
            digest.update(message.get("body", b""))
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        seen = {key: scope[key] for key in ("method", "path", "http_version", "scheme")}
        await _json(
            send,
            200,
            {
                **seen,
                "query_string": scope["query_string"].decode("latin-1"),
                "headers": [[k.decode(), v.decode()] for k, v in scope["headers"]],
                "client": list(scope["client"]),
                "server": list(scope["server"]),
                "state": scope["state"],
                "size": size,
                "sha256": digest.hexdigest(),
                "messages": messages,
            },
        )
    elif path == "/stream":
        headers = [(b"content-type", b"application/octet-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for index in range(64):
            chunk = bytes([index]) * 16384
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    elif path == "/forever":
        # Streams until the client goes away; the bridge must tell it so.
        await receive()  # the (empty) body
        headers = [(b"content-type", b"text/plain")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        sender = asyncio.ensure_future(_tick(send))
        message = await receive()
        sender.cancel()
        _record(f"forever: {message['type']}")
    elif path == "/wait":
        await receive()  # the (empty) body
        message = await receive()  # nothing is answered: the next message is the disconnect
        _record(f"wait: {message['type']}")
    elif path == "/file":
        # Sent by the server from the path (the extension Granian's ASGI server offers too).
        assert "http.response.pathsend" in scope["extensions"]  # noqa: S101 - else a 500
        headers = [(b"content-type", b"application/octet-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.pathsend", "path": os.environ["BRIDGE_TEST_FILE"]})
    elif path == "/bad-header":
        headers = [(b"x-note", b"line\r\nbreak")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"never"})
    elif path == "/raise":
        raise RuntimeError(f"failed ({SECRET})")
    elif path == "/silent":
        return
    elif path == "/started-only":
        await send({"type": "http.response.start", "status": 202, "headers": []})
    else:
        await _json(send, 404, {"path": path})


async def _tick(send: Send) -> None:
    while True:
        await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
        await asyncio.sleep(0.05)


served = ASGIOverRSGI(app)
