"""The agent's end of the tunnel: the frames it reads are checked, the replicas' ports come from
the worker's view. The whole path (a real control plane, a real replica) is
tests/control_plane/test_tunnel.py's."""

from __future__ import annotations

from typing import Any

import pytest

from modelforge_contracts.tunnel import (
    INITIAL_WINDOW,
    MAX_PAYLOAD,
    FrameType,
    OpenRequest,
    ReceiveWindow,
    TunnelProtocolError,
    decode,
    encode,
)
from node_agent.tunnel import LocalPorts, tls_context


def test_frames_round_trip_and_bad_ones_are_refused() -> None:
    request = OpenRequest("r1", "POST", "/v2/x", "a=1", [("content-type", "application/json")])
    frame = decode(encode(FrameType.OPEN, 7, request.to_payload()))

    assert (frame.kind, frame.stream) == (FrameType.OPEN, 7)
    assert OpenRequest.from_payload(frame.payload) == request
    for bad in (b"\x02\x00", b"\x09\x00\x00\x00\x01", encode(FrameType.DATA, 0, b"x")):
        with pytest.raises(TunnelProtocolError):
            decode(bad)
    with pytest.raises(TunnelProtocolError):
        decode(encode(FrameType.DATA, 1, b"x" * (MAX_PAYLOAD + 1)))


def test_a_peer_past_its_window_is_refused_and_consumption_grants_more() -> None:
    window = ReceiveWindow()
    window.received(INITIAL_WINDOW)
    with pytest.raises(TunnelProtocolError):
        window.received(1)

    assert window.consumed(INITIAL_WINDOW // 2 - 1) == 0
    assert window.consumed(1) == INITIAL_WINDOW // 2
    window.received(INITIAL_WINDOW // 2)  # exactly what was granted back


def test_ports_come_from_the_worker_view_and_an_unknown_id_asks_again() -> None:
    views: list[dict[str, Any]] = [
        {"services": [{"service_id": "r1", "port": 4001}]},
        {"services": [{"service_id": "r1", "port": 4001}, {"service_id": "r2", "port": 4002}]},
    ]
    asked: list[int] = []

    def view() -> dict[str, Any]:
        asked.append(1)
        return views[min(len(asked), len(views)) - 1]

    ports = LocalPorts(view)

    assert ports.port("r1") == 4001
    assert ports.port("r1") == 4001 and len(asked) == 1  # cached
    assert ports.port("r2") == 4002 and len(asked) == 2  # unknown: asked again at once
    assert ports.port("r3") is None


def test_plain_http_has_no_tls_context() -> None:
    assert tls_context("http://cp:8000", verify=True, ca_cert_path=None) is None
    assert tls_context("https://cp", verify=True, ca_cert_path=None) is not None
