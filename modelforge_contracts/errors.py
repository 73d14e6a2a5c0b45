"""The error body of every HTTP refusal, on the network API and on a node's unix sockets:

    {"error": {"code": "STABLE_CODE", "message": "what happened", "next_step": "what to do"}}

`code` is stable and machine-readable; `message` and `next_step` are for people. Extra fields
(such as `component` for a protocol refusal) sit beside them. A body never holds a secret.
"""

from __future__ import annotations

from typing import Any


def error_body(code: str, message: str, next_step: str = "", **extra: Any) -> dict[str, Any]:
    """The body of a refusal: `{"error": {"code", "message", "next_step", **extra}}`."""
    return {"error": {"code": code, "message": message, "next_step": next_step, **extra}}


def error_code(body: Any) -> str | None:
    """The `code` of an error body as received, or None when `body` is not one."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        return code if isinstance(code, str) else None
    return None
