"""What an artifact digest is on this node: `sha256:` and exactly 64 lowercase hex digits.

A digest names a file in the artifact cache and a path on the control plane, and job code can
hand the agent any string as one; so every place a digest enters the agent (the local socket,
the cache, the client) checks it here first, and nothing else ever becomes a file name or a URL.
"""

from __future__ import annotations

from modelforge_contracts.digests import is_digest

_SHOWN = 80


class InvalidDigest(ValueError):
    """A value that is not an artifact digest; the message shows (the start of) the value."""


def check_digest(value: object) -> str:
    """`value` when it is a digest; `InvalidDigest` otherwise."""
    if is_digest(value):
        return value
    shown = repr(value)
    if len(shown) > _SHOWN:
        shown = shown[:_SHOWN] + "…"
    raise InvalidDigest(
        f"{shown} is not an artifact digest: expected sha256: and 64 lowercase hex digits"
    )


def digest_hex(digest: str) -> str:
    """The 64 hex digits of a checked digest: its file name in the cache."""
    return check_digest(digest).removeprefix("sha256:")
