"""Limits on a parsed JSON document, checked without recursion (the depth is what is being
checked): how deep its arrays and objects nest, and whether every number is finite. The control
plane's request edge and the release tool's bundle reader both ask this one walk."""

from __future__ import annotations

import math
from typing import Any, Literal

Problem = Literal["too_deep", "not_finite"]


def tree_problem(value: Any, *, max_depth: int, finite: bool) -> Problem | None:
    """The first problem found in `value` (a result of `json.loads` or `from_json`): arrays and
    objects nested deeper than `max_depth` (the document itself is level 1), or — when `finite`
    is asked for — a NaN or infinite number. None when there is none."""
    if isinstance(value, float):
        return "not_finite" if finite and not math.isfinite(value) else None
    if not isinstance(value, dict | list):
        return None
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        container, depth = pending.pop()
        if depth > max_depth:
            return "too_deep"
        for item in container.values() if isinstance(container, dict) else container:
            if isinstance(item, float):
                if finite and not math.isfinite(item):
                    return "not_finite"
            elif isinstance(item, dict | list):
                pending.append((item, depth + 1))
    return None
