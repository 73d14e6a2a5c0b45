"""Which of the gateway's requests a path is (`gateway_target`), read as the client sent it.

The path is percent-encoded (`api/gateway_forward.received_path`), read one segment at a time,
each decoded once: the service's name is decoded exactly once, and what follows it goes to the
replica still encoded, so `%2F`, `%3F`, `%23` or `%25` in it mean there what they meant to the
client. The Python gateway (`api/gateway.py`) and the native front's decisions
(`api/gateway_native.py`) both read paths here.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

#: A request whose decoded path starts so may be the gateway's (`gateway_target` decides).
PREFIXES = ("/v2", "/services/")


@dataclass(frozen=True, slots=True)
class Target:
    """What a gateway path asks: `what` is live, ready, server, model, model_ready or proxy."""

    what: str
    name: str = ""
    path: str = ""


def gateway_target(method: str, path: str) -> Target | None:
    """Which of the gateway's requests `method path` is, if one. `path` is percent-encoded
    (`received_path`): each segment is decoded once to be read, and a target's `path` (what the
    replica gets) keeps the segments as they came."""
    raw = path.split("/")
    if len(raw) < 2 or raw[0]:
        return None
    words = [unquote(segment) for segment in raw[1:4]]
    if words[0] == "services":
        if len(raw) < 4 or not words[1]:
            return None  # `/services/{id}`: the console's
        return Target("proxy", words[1], "/" + "/".join(raw[3:]))
    if words[0] != "v2":
        return None
    if len(raw) == 2 or raw[2:] == [""]:
        return Target("server")
    if words[1:] == ["health", "live"] and len(raw) == 4:
        return Target("live")
    if words[1:] == ["health", "ready"] and len(raw) == 4:
        return Target("ready")
    if words[1] != "models" or len(raw) < 4 or not words[2]:
        return None
    name, rest = words[2], raw[4:]
    if rest and not rest[-1]:
        rest = rest[:-1]  # one trailing slash
    versioned = ""
    if len(rest) >= 2 and unquote(rest[0]) == "versions" and rest[1]:
        versioned, rest = f"/versions/{rest[1]}", rest[2:]
    action = unquote(rest[0]) if len(rest) == 1 else None
    if rest and action not in ("ready", "infer"):
        return None
    if action == "ready":
        return Target("model_ready", name)
    # The replica's server answers its model's name; the name part is replaced later.
    return Target("model", name, versioned + (f"/{action}" if action else ""))
