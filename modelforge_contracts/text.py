"""Text that people will read (in the console, a terminal, a log) must not carry control
characters — ANSI escapes among them — or the marks that reorder bidirectional text. The control
plane refuses such text in what it is sent; a node cleans what its jobs produce (a traceback, a
message) before it reports it, so a job's own bytes can never make its outcome unreportable.
"""

from __future__ import annotations

import re

_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029"
#: Anything not allowed on one line of text.
UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f" + _BIDI + "]")
#: Anything not allowed in text of several lines (tab and line breaks are).
UNSAFE_TEXT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f" + _BIDI + "]")
REPLACEMENT = "\ufffd"


def clean_line(value: str) -> str:
    """`value` with every character a line may not hold replaced by U+FFFD."""
    return UNSAFE_LINE.sub(REPLACEMENT, value)


def clean_text(value: str) -> str:
    """`value` with every character text may not hold (all but tab and line breaks) replaced."""
    return UNSAFE_TEXT.sub(REPLACEMENT, value)
