"""A content digest as every part writes it: `sha256:` and exactly 64 lowercase hex digits. It
names artifacts (in the control plane's API and the node's cache) and image configs and layers
(in the release manifest); anything else is refused wherever a digest is expected."""

from __future__ import annotations

import re
from typing import TypeGuard

#: The digest as a regular expression (unanchored: use `fullmatch`, or anchor it in a schema).
DIGEST_PATTERN = r"sha256:[0-9a-f]{64}"
_DIGEST = re.compile(DIGEST_PATTERN)


def is_digest(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None
