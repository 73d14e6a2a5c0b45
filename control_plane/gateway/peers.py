"""Several control-plane replicas, one gateway: a stream for a node whose tunnel another process
holds is carried through that process (issue 27).

Each process records the tunnels it holds in `gateway_tunnels` (`tunnels.HolderRecord`: its
holder id and `MODELFORGE_GATEWAY_PEER_ADDRESS`). A gateway that holds no tunnel to a replica's
node asks `Peers.open_stream`, which finds the holder (`HolderDirectory`: the table read at most
every `interval` seconds, and only on a miss, never per request) and sends the request to the
holder's internal route, `PEER_PREFIX{node_id}/{replica_id}{path}` (`api/gateway_peers.py`),
as one HTTP request whose body and answer stream both ways: `PeerStream` is the tunnel
`Stream`'s shape, so the gateway carries it as it carries a local one (limits, retry, relay).

The replicas trust one another through a random key they share in the database
(`gateway_peer_keys`, made once by whichever starts first): each internal request is signed for
its holder (`peer_signature.py`: the method, path, query, every header passed on, the time, a
nonce, and the body frame by frame), never carrying the key; the holder checks it and accepts
each nonce once. The holder trusts nothing else: the client's token was checked by the
forwarding replica and never travels.

A holder that is gone (its row stale), or that no longer holds the tunnel, is a transport
failure before the response (`StreamReset` from `response()`), which the gateway retries once
on another replica. It never logs a request's data, its headers, a token or the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import quote

import httpx
from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import Clock
from control_plane.db import dialect_insert
from control_plane.gateway.peer_signature import (
    FAILURE_HEADER,
    PEER_HEADERS,
    BodySeal,
    sign_request,
)
from control_plane.gateway.tunnels import HolderRecord, StreamReset, TunnelHub, TunnelUnavailable
from control_plane.models import GatewayPeerKey, GatewayTunnel
from modelforge_contracts.tunnel import HOP_BY_HOP, Headers, OpenRequest

log = logging.getLogger(__name__)

#: The holder's internal route: `{PEER_PREFIX}{node_id}/{replica_id}{path}`.
PEER_PREFIX = "/api/v1/internal/gateway/"
#: How long the forwarding replica waits for the holder's answer to start, and between two
#: pieces of it (the replica's own work included).
READ_TIMEOUT = 300.0
CONNECT_TIMEOUT = 2.0
_KEY_NAME = "gateway-peer"
#: Request-body chunks queued towards the holder before `send` waits.
_QUEUED = 4


def new_holder_id() -> str:
    """This process's id in `gateway_tunnels` (a fresh one each start)."""
    return "cp-" + secrets.token_hex(8)


def attach(
    hub: TunnelHub,
    *,
    session_factory: sessionmaker[Session],
    read_session_factory: sessionmaker[Session],
    clock: Clock,
    address: str,
    body_timeout: float,
) -> None:
    """At start (blocking): the shared key read (or made), this address's leftover rows gone,
    and `hub` told to record its tunnels and to reach others' through their holders."""
    with session_factory.begin() as session:
        key = ensure_peer_key(session, now=clock.now())
        forget_address(session, address=address)

    def read() -> dict[str, Holder]:
        with read_session_factory() as session:
            return read_holders(session)

    holder = new_holder_id()
    hub.record = HolderRecord(holder, address, session_factory, clock)
    hub.peer_key = key
    hub.peers = Peers(
        holder=holder,
        key=key,
        directory=HolderDirectory(read=read, clock=clock),
        clock=clock,
        body_timeout=body_timeout,
    )


def ensure_peer_key(session: Session, *, now: datetime) -> bytes:
    """The replicas' shared key, made by the first to ask: an insert that does nothing when
    another replica's insert won, then the one read, so replicas starting together agree."""
    values = {"name": _KEY_NAME, "key": secrets.token_urlsafe(48), "created_at": now}
    session.execute(dialect_insert(session, GatewayPeerKey).values(values).on_conflict_do_nothing())
    key = session.execute(select(GatewayPeerKey.key).where(GatewayPeerKey.name == _KEY_NAME))
    return key.scalar_one().encode()


def forget_address(session: Session, *, address: str) -> None:
    """Rows left by an earlier run of this process (same address, killed before it forgot)."""
    if address:
        session.execute(delete(GatewayTunnel).where(GatewayTunnel.holder_address == address))


@dataclass(frozen=True, slots=True)
class Holder:
    holder: str
    address: str


def read_holders(session: Session) -> dict[str, Holder]:
    rows = session.execute(
        select(GatewayTunnel.node_id, GatewayTunnel.holder, GatewayTunnel.holder_address)
    )
    return {node_id: Holder(holder, address) for node_id, holder, address in rows}


class HolderDirectory:
    """Which process holds each node's tunnel, read on a miss at most every `interval` s."""

    def __init__(
        self, *, read: Callable[[], dict[str, Holder]], clock: Clock, interval: float = 0.25
    ) -> None:
        self._read = read
        self._clock = clock
        self.interval = interval
        self._holders: dict[str, Holder] = {}
        self._read_at = float("-inf")
        self._reading: asyncio.Task[None] | None = None

    async def find(self, node_id: str, *, fresh: bool = False) -> Holder | None:
        """The node's holder; read first when unknown (or `fresh`) and the last read is older
        than `interval`."""
        held = self._holders.get(node_id)
        if (held is None or fresh) and self._clock.monotonic() - self._read_at > self.interval:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(self._read_once())
            await asyncio.shield(self._reading)
            held = self._holders.get(node_id)
        return held

    def forget(self, node_id: str) -> None:
        """The holder failed us: the next `find` reads again."""
        self._holders.pop(node_id, None)

    async def _read_once(self) -> None:
        started = self._clock.monotonic()
        self._holders = await asyncio.to_thread(self._read)
        self._read_at = started


class Peers:
    """Streams through another process's tunnel (see the module's docstring)."""

    def __init__(
        self,
        *,
        holder: str,
        key: bytes,
        directory: HolderDirectory,
        clock: Clock,
        body_timeout: float,
    ) -> None:
        self.holder = holder
        self.key = key
        self.directory = directory
        self._clock = clock
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=CONNECT_TIMEOUT, read=READ_TIMEOUT, write=body_timeout, pool=body_timeout
            ),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64),
            follow_redirects=False,
            trust_env=False,
        )

    async def open_stream(self, node_id: str, request: OpenRequest) -> PeerStream:
        """A stream through the process holding `node_id`'s tunnel; `TunnelUnavailable` when
        none is known (or it is this one, or it cannot be reached at any address)."""
        found = await self.directory.find(node_id)
        if found is None or found.holder == self.holder or not found.address:
            found = await self.directory.find(node_id, fresh=True)
        if found is None or found.holder == self.holder or not found.address:
            raise TunnelUnavailable(f"no process holds a tunnel to node {node_id}")
        method, query = request.method, request.query
        # The replica's path goes on as it is (percent-encoded: the holder passes it on so).
        route = quote(f"{PEER_PREFIX}{node_id}/{request.replica_id}", safe="/") + request.path
        url = httpx.URL(found.address.rstrip("/") + route + (f"?{query}" if query else ""))
        # Signed as the holder's server gives them: the path decoded, the query as it is sent;
        # for this holder alone, every header that goes on signed (the body framed: its length
        # travels signed, the peer request itself is chunked).
        signed = sign_request(
            self.key,
            method=method,
            path=url.path,
            query=url.query.decode("latin-1"),
            holder=found.holder,
            timestamp=f"{self._clock.now().timestamp():.3f}",
            headers=[
                (name, value) for name, value in request.headers if name.lower() not in HOP_BY_HOP
            ],
        )
        return PeerStream(
            self._client,
            method,
            url,
            signed.headers,
            seal=signed.seal,
            on_unreachable=lambda: self.directory.forget(node_id),
        )

    async def aclose(self) -> None:
        await self._client.aclose()


class PeerStream:
    """One request through a holder: the tunnel `Stream`'s shape over one HTTP exchange."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        method: str,
        url: httpx.URL,
        headers: list[tuple[str, str]],
        *,
        seal: BodySeal,
        on_unreachable: Callable[[], None],
    ) -> None:
        self._seal = seal
        self._body: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=_QUEUED)
        self._head: asyncio.Future[tuple[int, Headers]] = asyncio.get_running_loop().create_future()
        self._response: httpx.Response | None = None
        self._on_unreachable = on_unreachable
        self._reset: StreamReset | None = None
        self._ended = False
        request = client.build_request(method, url, headers=headers, content=self._content())
        self._exchange = asyncio.ensure_future(self._run(client, request))

    async def _content(self) -> AsyncIterator[bytes]:
        while (chunk := await self._body.get()) is not None:
            for frame in self._seal.frames(chunk):
                yield frame
        yield self._seal.end()

    async def _run(self, client: httpx.AsyncClient, request: httpx.Request) -> None:
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            self._on_unreachable()
            self._fail(StreamReset("PEER_UNREACHABLE", type(exc).__name__))
            return
        failure = response.headers.get(FAILURE_HEADER)
        if failure is not None:
            await response.aclose()
            self._on_unreachable()
            self._fail(StreamReset("PEER_TRANSPORT", failure[:100]))
            return
        self._response = response
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in response.headers.raw
            if name.decode("latin-1").lower() not in PEER_HEADERS
        ]
        if not self._head.done():
            self._head.set_result((response.status_code, headers))

    def _fail(self, reset: StreamReset) -> None:
        if self._reset is None:
            self._reset = reset
        if not self._head.done():
            self._head.set_exception(reset)
            self._head.exception()  # retrieved: nobody may be waiting for it

    async def send(self, data: bytes) -> None:
        await self._put(data)

    async def end(self) -> None:
        if not self._ended:
            self._ended = True
            await self._put(None)

    async def _put(self, item: bytes | None) -> None:
        if self._reset is not None:
            raise self._reset
        if self._exchange.done():
            if self._head.done() and not self._head.exception():
                return  # answered: the holder reads no more of the request
            raise self._reset or StreamReset("PEER_TRANSPORT", "the holder closed the stream")
        putting = asyncio.ensure_future(self._body.put(item))
        await asyncio.wait({putting, self._exchange}, return_when=asyncio.FIRST_COMPLETED)
        if not putting.done():
            putting.cancel()
            if self._reset is not None:
                raise self._reset

    async def response(self) -> tuple[int, Headers]:
        return await self._head

    async def body(self) -> AsyncIterator[bytes]:
        response = self._response
        if response is None:
            raise self._reset or StreamReset("PEER_TRANSPORT", "no response")
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise StreamReset("PEER_TRANSPORT", type(exc).__name__) from None
        finally:
            await response.aclose()

    async def reset(self, code: str = "CANCELLED", message: str = "") -> None:
        """End the exchange: the holder sees its client go and resets the tunnel's stream."""
        self._fail(StreamReset(code, message))
        self._exchange.cancel()
        with contextlib.suppress(BaseException):
            await self._exchange
        if self._response is not None:
            with contextlib.suppress(Exception):
                await self._response.aclose()


def peer_headers_dropped(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """`headers` without the peers' own (the holder sends none of them on to a replica)."""
    return [(name, value) for name, value in headers if name.lower() not in PEER_HEADERS]
