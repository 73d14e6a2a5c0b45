"""Which of a replica's `Content-Length`s reach the client (`gateway_forward._headers_out`): only
an answer with no body for it to frame (to HEAD, or a 304) keeps the replica's, and only its one
value of ASCII digits; every other answer is framed by its real body."""

from __future__ import annotations

import pytest

from control_plane.api.gateway_forward import _headers_out


def _lengths(method: str, status: int, *lengths: str) -> list[bytes]:
    raw = [("Content-Type", "text/plain"), *(("Content-Length", value) for value in lengths)]
    headers = _headers_out(raw, method=method, status=status)
    assert (b"content-type", b"text/plain") in headers
    return [value for name, value in headers if name == b"content-length"]


def test_head_and_304_answers_keep_the_replicas_one_length() -> None:
    assert _lengths("HEAD", 200, "1234") == [b"1234"]
    assert _lengths("head", 404, "17") == [b"17"]
    assert _lengths("GET", 304, "0") == [b"0"]
    assert _lengths("HEAD", 200) == []


def test_every_other_answers_length_is_dropped() -> None:
    assert _lengths("GET", 200, "1234") == []
    assert _lengths("POST", 204, "0") == []


@pytest.mark.parametrize(
    "lengths",
    [
        ("12", "12"),
        ("12", "13"),
        ("12, 12",),
        (" 12",),
        ("+12",),
        ("-1",),
        ("0x10",),
        ("",),
        ("١٢",),
    ],
)
def test_a_length_that_is_not_one_number_never_crosses(lengths: tuple[str, ...]) -> None:
    assert _lengths("HEAD", 200, *lengths) == []
