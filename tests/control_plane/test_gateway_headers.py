"""The gateway's framing and forwarding rules for a client's request (`api/gateway_headers.py`;
the native front's `gateway.rs` has the same cases in its unit tests)."""

from __future__ import annotations

import pytest

from control_plane.api.gateway_headers import AMBIGUOUS_FRAMING, framing_refusal, with_forwarding


@pytest.mark.parametrize(
    "headers",
    [
        [(b"content-length", b"5"), (b"transfer-encoding", b"chunked")],
        [(b"Transfer-Encoding", b"chunked"), (b"Content-Length", b"5")],
        [(b"transfer-encoding", b"gzip")],
        [(b"transfer-encoding", b"gzip, chunked")],
        [(b"transfer-encoding", b"chunked"), (b"transfer-encoding", b"chunked")],
        [(b"content-length", b"5"), (b"content-length", b"7")],
        [(b"content-length", b"5, 5")],
        [(b"content-length", b"5x")],
        [(b"content-length", b"")],
        [(b"content-length", b"-1")],
    ],
)
def test_an_ambiguous_framing_is_refused(headers: list[tuple[bytes, bytes]]) -> None:
    assert framing_refusal(headers) == AMBIGUOUS_FRAMING


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"content-length", b"5")],
        [(b"content-length", b" 5 ")],
        [(b"content-length", b"5"), (b"content-length", b"5")],
        [(b"transfer-encoding", b"Chunked")],
    ],
)
def test_a_plain_framing_passes(headers: list[tuple[bytes, bytes]]) -> None:
    assert framing_refusal(headers) is None


def test_the_forwarding_headers_are_the_gateways_own() -> None:
    headers = [
        (b"host", b"cp.example:8000"),
        (b"x-forwarded-for", b"6.6.6.6"),
        (b"X-Forwarded-Host", b"evil.example"),
        (b"x-forwarded-proto", b"http"),
        (b"forwarded", b"for=6.6.6.6"),
        (b"x-real-ip", b"6.6.6.6"),
        (b"x-other", b"kept"),
    ]
    scope = {"headers": headers, "client": ("10.0.0.7", 4242), "scheme": "https"}
    assert with_forwarding(scope) == [
        (b"host", b"cp.example:8000"),
        (b"x-other", b"kept"),
        (b"x-forwarded-for", b"10.0.0.7"),
        (b"x-forwarded-proto", b"https"),
        (b"x-forwarded-host", b"cp.example:8000"),
    ]
    # No client address known, no Host: only what is known is said.
    assert with_forwarding({"headers": [(b"x-real-ip", b"1.2.3.4")]}) == [
        (b"x-forwarded-proto", b"http")
    ]
