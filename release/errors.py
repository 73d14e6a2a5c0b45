"""The release tool's one error class.

Every failure the tool can explain derives from `ReleaseError`, and its message is the reason
`modelforge-release` prints, on one line after the command's name, before it exits non-zero;
so a new error class needs no change to the CLI. This module imports nothing: every module of
the tool may import it.
"""

from __future__ import annotations


class ReleaseError(Exception):
    """A release step refused its input or failed; the message names the problem."""
