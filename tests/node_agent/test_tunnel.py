"""The tunnel's contract (modelforge_contracts.tunnel, the control plane's Python end): frames
are checked, windows enforced, writes batched; and the replicas' ports the agent tells its relay
come from the worker's view. The whole path (a real control plane, the agent's relay, a real
replica) is tests/control_plane/test_tunnel.py's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from modelforge_contracts.tunnel import (
    INITIAL_WINDOW,
    MAX_BATCH,
    MAX_PAYLOAD,
    FrameType,
    FrameWriter,
    OpenRequest,
    ReceiveWindow,
    TunnelProtocolError,
    batch,
    decode,
    decode_message,
    encode,
)
from node_agent.config import ConfigError
from node_agent.tunnel import check_relay, replica_ports


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


def test_ports_come_from_the_worker_view() -> None:
    view: dict[str, Any] = {
        "services": [
            {"service_id": "r1", "port": 4001},
            {"service_id": "r2", "port": 4002},
            {"service_id": "r3", "port": None},  # not listening yet
            "not an entry",
        ]
    }
    assert replica_ports(view) == {"r1": 4001, "r2": 4002}
    assert replica_ports({}) == {}


def test_a_missing_relay_is_a_configuration_error_naming_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "modelforge-tunnel-relay"
    with pytest.raises(ConfigError, match="run make install") as caught:
        check_relay(missing)
    assert str(missing) in str(caught.value)
    missing.write_text("#!/bin/sh\n")  # there, but not executable
    with pytest.raises(ConfigError):
        check_relay(missing)


class _Socket:
    """A WebSocket's write: each message kept, every write held until `release` is set."""

    def __init__(self, *, fail: bool = False) -> None:
        self.messages: list[bytes] = []
        self.release = asyncio.Event()
        self.release.set()
        self.fail = fail

    async def send(self, message: bytes) -> None:
        await self.release.wait()
        if self.fail:
            raise ConnectionResetError("gone")
        self.messages.append(message)


def _frames(messages: list[bytes]) -> list[tuple[FrameType, int, bytes]]:
    return [(f.kind, f.stream, f.payload) for m in messages for f in decode_message(m)]


def test_frames_sent_during_a_write_leave_together_in_order() -> None:
    async def scenario() -> None:
        socket = _Socket()
        writer = FrameWriter(socket.send)
        socket.release.clear()
        first = asyncio.ensure_future(writer.send(encode(FrameType.END, 1)))
        await asyncio.sleep(0)  # the first message is being written, and waits
        later = [
            asyncio.ensure_future(
                writer.send(encode(FrameType.DATA, stream, b"x"), encode(FrameType.END, stream))
            )
            for stream in (2, 3, 4)
        ]
        await asyncio.sleep(0)
        assert not any(task.done() for task in [first, *later])
        socket.release.set()
        await asyncio.gather(first, *later)

        assert len(socket.messages) == 2  # the first alone, the three streams' six as one BATCH
        assert _frames(socket.messages) == [
            (FrameType.END, 1, b""),
            *[(kind, s, body) for s in (2, 3, 4) for kind, body in ((FrameType.DATA, b"x"),
                                                                    (FrameType.END, b""))],
        ]  # fmt: skip
        assert (writer.messages, writer.frames) == (2, 7)

    asyncio.run(scenario())


def test_a_group_larger_than_a_batch_goes_as_several_messages_in_order() -> None:
    async def scenario() -> None:
        socket = _Socket()
        writer = FrameWriter(socket.send)
        socket.release.clear()
        pieces = [encode(FrameType.DATA, 1, bytes([n]) * MAX_PAYLOAD) for n in range(5)]
        sent = asyncio.ensure_future(writer.send(*pieces))
        await asyncio.sleep(0)
        socket.release.set()
        await sent

        assert all(len(message) <= MAX_BATCH + 5 for message in socket.messages)
        assert len(socket.messages) == 5  # two 64 KiB DATA frames never fit one BATCH
        assert [payload[0] for _, _, payload in _frames(socket.messages)] == [0, 1, 2, 3, 4]

    asyncio.run(scenario())


def test_a_failed_write_fails_every_waiting_sender_and_every_later_one() -> None:
    async def scenario() -> None:
        socket = _Socket(fail=True)
        writer = FrameWriter(socket.send)
        socket.release.clear()
        waiting = [asyncio.ensure_future(writer.send(encode(FrameType.END, s))) for s in (1, 2)]
        await asyncio.sleep(0)
        socket.release.set()
        results = await asyncio.gather(*waiting, return_exceptions=True)

        assert all(isinstance(result, ConnectionError) for result in results)
        assert isinstance(results[0].__cause__, ConnectionResetError)  # what the socket said
        with pytest.raises(ConnectionError):
            await writer.send(encode(FrameType.END, 3))

    asyncio.run(scenario())


def test_a_writer_takes_frames_only() -> None:
    async def scenario() -> None:
        writer = FrameWriter(_Socket().send)
        for bad in ((), (batch([encode(FrameType.END, 1), encode(FrameType.END, 2)]),)):
            with pytest.raises(ValueError):
                await writer.send(*bad)

    asyncio.run(scenario())


def test_a_cancelled_sender_leaves_the_others_frames_to_be_written() -> None:
    async def scenario() -> None:
        socket = _Socket()
        writer = FrameWriter(socket.send)
        socket.release.clear()
        first = asyncio.ensure_future(writer.send(encode(FrameType.END, 1)))
        await asyncio.sleep(0)
        cancelled = asyncio.ensure_future(writer.send(encode(FrameType.END, 2)))
        kept = asyncio.ensure_future(writer.send(encode(FrameType.END, 3)))
        await asyncio.sleep(0)
        cancelled.cancel()
        socket.release.set()
        await asyncio.gather(first, kept)

        assert cancelled.cancelled()
        assert [stream for _, stream, _ in _frames(socket.messages)] == [1, 2, 3]

    asyncio.run(scenario())


def test_lingering_gathers_frames_made_ready_together_where_writes_never_wait() -> None:
    async def scenario(linger: bool) -> int:
        socket = _Socket()  # released: every write completes at once, as a buffering client's
        writer = FrameWriter(socket.send, linger=linger)

        async def later(stream: int) -> None:  # woken in the same round as the first sender
            await asyncio.sleep(0)
            await writer.send(encode(FrameType.END, stream))

        await asyncio.gather(writer.send(encode(FrameType.END, 1)), later(2), later(3))
        assert [stream for _, stream, _ in _frames(socket.messages)] == [1, 2, 3]
        return len(socket.messages)

    assert asyncio.run(scenario(linger=True)) == 1
    assert asyncio.run(scenario(linger=False)) == 2
