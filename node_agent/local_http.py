"""A small HTTP/1.1 client for the replicas' local ports (the tunnel's far end, issue 27).

The tunnel forwards every gateway request to a replica on this node (`127.0.0.1:<port>`), so its
client's cost is paid per request. A general client (`httpx`: a request and a response object,
header models, a pool behind locks, anyio cancel scopes) cost more per request than the rest of
the agent's end of the tunnel; this one holds only what the tunnel needs:

- keep-alive connections on asyncio streams, a pool of idle ones per port (the newest reused
  first; one the replica closed while idle is noticed and dropped, one idle longer than
  `IDLE_SECONDS` too, before the replica's own idle timeout can race a request);
- the request framed here, from the bytes that arrive, never by the client's headers: the
  `Content-Length` the gateway passes (the length it read the body by) only with a body held to
  it (a body longer or shorter fails, its request never completed: `LengthMismatch`), else a
  body sent whole with its own length (one write with the head) or streamed chunked; a stream
  cancelled in the middle closes the connection without the last chunk;
- a response body by `Content-Length`, chunked (de-chunked, as `httpx`'s raw bytes were), or
  read until the replica closes; interim 1xx answers skipped; none after HEAD, 204 or 304. An
  answer whose framing contradicts itself (`Content-Length` with `Transfer-Encoding`, or two
  lengths) fails, and its connection is closed, never reused.

A connection goes back to the pool only when both bodies were complete and neither side asked
to close it. Failures raise `LocalHTTPError` (or `OSError`): `reached` says whether the replica
had sent any of its answer, which decides how the tunnel resets the stream.

It never logs a header or a body.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from modelforge_contracts.tunnel import HOP_BY_HOP, Headers

#: How long a connection to a replica may take to open.
CONNECT_TIMEOUT = 5.0
#: An idle connection older than this is closed rather than reused.
IDLE_SECONDS = 4.0
#: Idle connections kept per port.
MAX_IDLE = 64
#: The most a response's head may take (the tunnel's RESPONSE frame holds less anyway).
MAX_HEAD = 64 * 1024
_READ = 64 * 1024
_NO_BODY_STATUS = frozenset({204, 304})
#: Numbers as HTTP writes them: ASCII digits only (`str.isdigit` takes '²' and '٥'; `int` takes
#: '0x10', '1_0', '+a' and '-5').
_DIGITS = re.compile(r"[0-9]+")
_HEX = re.compile(rb"[0-9A-Fa-f]+")


class LocalHTTPError(Exception):
    """The exchange with the replica failed; `reached`: after its answer had begun."""

    def __init__(self, message: str, *, reached: bool) -> None:
        super().__init__(message)
        self.reached = reached


class LengthMismatch(LocalHTTPError):
    """The request's body is longer or shorter than its declared length (or that is not one
    number): the request was not completed at the replica."""

    def __init__(self, message: str = "the request's body is not the length it declared") -> None:
        super().__init__(message, reached=False)


@dataclass(eq=False, slots=True)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def usable(self, now: float) -> bool:
        return (
            not self.reader.at_eof()
            and not self.writer.is_closing()
            and now - self.idle_since < IDLE_SECONDS
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


@dataclass(eq=False, slots=True)
class LocalResponse:
    """A replica's answer: `status` and `headers` (one hop's left out) read, the body to come
    through `chunks()` (at most once). `release()` when done, read to the end or not."""

    status: int
    headers: Headers
    #: The body's length, when the replica declared it (or 0 when there is none).
    length: int | None
    _pool: LocalHTTP
    _port: int
    _connection: _Connection | None
    _chunked: bool
    _keep: bool
    _complete: bool = field(default=False)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (transfer coding removed)."""
        connection = self._connection
        if connection is None:
            return
        reader = connection.reader
        try:
            if self._chunked:
                async for piece in _dechunk(reader):
                    yield piece
            elif self.length is not None:
                left = self.length
                while left:
                    piece = await reader.read(min(left, _READ))
                    if not piece:
                        raise LocalHTTPError("the replica closed inside its body", reached=True)
                    left -= len(piece)
                    yield piece
            else:
                while piece := await reader.read(_READ):
                    yield piece
                self._keep = False
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            raise LocalHTTPError(
                f"the replica broke off ({type(exc).__name__})", reached=True
            ) from None
        self._complete = True

    async def read(self) -> bytes:
        """The whole body (for one whose `length` is known to be small)."""
        return b"".join([piece async for piece in self.chunks()])

    def release(self) -> None:
        """The connection back to the pool when the exchange ended cleanly, else closed."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if self._keep and (self._complete or self.length == 0):
            self._pool._put(self._port, connection)
        else:
            connection.close()


class LocalHTTP:
    """Keep-alive HTTP/1.1 to `host`'s ports (see the module's docstring)."""

    def __init__(self, host: str = "127.0.0.1", *, connect_timeout: float = CONNECT_TIMEOUT):
        self.host = host
        self.connect_timeout = connect_timeout
        self._idle: dict[int, list[_Connection]] = {}
        #: Connections opened since the start (tests read it: reuse shows as fewer).
        self.opened = 0

    async def request(
        self,
        port: int,
        method: str,
        target: str,
        headers: Headers,
        body: bytes | AsyncIterator[bytes] | None,
    ) -> LocalResponse:
        """Send `method target` with `headers` (one hop's left out here) and `body` (whole,
        streamed, or none); the answer's head once it came."""
        connection = await self._connection(port)
        try:
            await self._send(connection, port, method, target, headers, body)
            return await self._head(connection, port, method)
        except BaseException:
            connection.close()
            raise

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    # -- inside ---------------------------------------------------------------------------------

    async def _connection(self, port: int) -> _Connection:
        idle = self._idle.get(port)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.usable(now):
                return connection
            connection.close()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, port, limit=MAX_HEAD), self.connect_timeout
            )
        except (OSError, TimeoutError) as exc:
            raise LocalHTTPError(
                f"the replica's port {port} did not answer ({type(exc).__name__})", reached=False
            ) from None
        self.opened += 1
        return _Connection(reader, writer)

    def _put(self, port: int, connection: _Connection) -> None:
        idle = self._idle.setdefault(port, [])
        if len(idle) >= MAX_IDLE:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    async def _send(
        self,
        connection: _Connection,
        port: int,
        method: str,
        target: str,
        headers: Headers,
        body: bytes | AsyncIterator[bytes] | None,
    ) -> None:
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host}:{port}"]
        declared = _declared_length(headers)
        for name, value in headers:
            lowered = name.lower()
            if lowered in HOP_BY_HOP or lowered == "content-length":
                continue  # the framing is this end's: below
            lines.append(f"{name}: {value}")
        writer = connection.writer
        try:
            if body is None or isinstance(body, bytes):
                data = body or b""
                if declared is not None and declared != len(data):
                    raise LengthMismatch
                if declared is not None or data or method in ("POST", "PUT", "PATCH"):
                    lines.append(f"Content-Length: {len(data)}")
                lines.append("\r\n")
                writer.write("\r\n".join(lines).encode("latin-1") + data)
                await writer.drain()
                return
            chunked = declared is None
            lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {declared}")
            lines.append("\r\n")
            writer.write("\r\n".join(lines).encode("latin-1"))
            sent = 0
            async for piece in body:
                if not piece:
                    continue
                sent += len(piece)
                if chunked:
                    writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
                elif declared is not None and sent > declared:
                    raise LengthMismatch  # nothing of this piece written
                else:
                    writer.write(piece)
                await writer.drain()
            if declared is not None and sent != declared:
                raise LengthMismatch
            if chunked:
                writer.write(b"0\r\n\r\n")
            await writer.drain()
        except OSError as exc:
            raise LocalHTTPError(
                f"the replica's port {port} broke off the request ({type(exc).__name__})",
                reached=False,
            ) from None

    async def _head(self, connection: _Connection, port: int, method: str) -> LocalResponse:
        reader = connection.reader
        while True:
            try:
                raw = await reader.readuntil(b"\r\n\r\n")
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                raise LocalHTTPError(
                    f"the replica's port {port} did not answer ({type(exc).__name__})",
                    reached=False,
                ) from None
            status_line, *header_lines = raw[:-4].decode("latin-1").split("\r\n")
            version, _, rest = status_line.partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise LocalHTTPError("the replica's answer is not HTTP/1.1", reached=True)
            status = int(code)
            if status < 200 and status != 101:
                continue  # an interim answer (100 Continue): the final one follows
            break
        headers: Headers = []
        length: int | None = None
        chunked = coded = False
        keep = version == "HTTP/1.1"
        for line in header_lines:
            name, _, value = line.partition(":")
            value = value.strip()
            lowered = name.strip().lower()
            if lowered == "content-length":
                if not _DIGITS.fullmatch(value) or length not in (None, int(value)):
                    raise LocalHTTPError(
                        "the replica's Content-Length is not one number", reached=True
                    )
                length = int(value)
            elif lowered == "transfer-encoding":
                # As hyper reads it: the last coding decides, and only chunked frames a body.
                coded = True
                chunked = value.lower().rsplit(",", 1)[-1].strip() == "chunked"
                if not chunked:
                    raise LocalHTTPError(
                        f"the replica's Transfer-Encoding {value!r} does not end with chunked",
                        reached=True,
                    )
            elif lowered == "connection":
                tokens = value.lower()
                if "close" in tokens:
                    keep = False
                elif "keep-alive" in tokens:
                    keep = True
            if lowered not in HOP_BY_HOP:
                headers.append((name.strip(), value))
        if coded and length is not None:  # which one a reader believes decides the next answer
            raise LocalHTTPError(
                "the replica's answer declares both Content-Length and Transfer-Encoding",
                reached=True,
            )
        if method == "HEAD" or status in _NO_BODY_STATUS:
            length, chunked = 0, False
        elif chunked:
            length = None
        return LocalResponse(status, headers, length, self, port, connection, chunked, keep)


async def _dechunk(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size_line = await reader.readuntil(b"\r\n")
        digits = size_line.split(b";", 1)[0].strip()
        if not _HEX.fullmatch(digits):
            raise ValueError("a chunk size that is not hexadecimal digits")
        size = int(digits, 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailers: dropped, as one hop's
            return
        left = size
        while left:
            piece = await reader.read(min(left, _READ))
            if not piece:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(piece)
            yield piece
        if await reader.readexactly(2) != b"\r\n":
            raise ValueError("a chunk without its CRLF")


def _declared_length(headers: Headers) -> int | None:
    """The gateway's `Content-Length` (None: none); `LengthMismatch` unless one number."""
    values = {value.strip() for name, value in headers if name.lower() == "content-length"}
    if not values:
        return None
    if len(values) > 1 or not all(_DIGITS.fullmatch(value) for value in values):
        raise LengthMismatch("the request's Content-Length is not one number")
    return int(values.pop())
