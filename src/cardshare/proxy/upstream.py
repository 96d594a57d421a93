"""The proxy's client to vLLM: HTTP/1.1 over a pool of keep-alive connections per upstream.

The proxy sends every agent request through here, so its cost is the proxy's cost: measured
on two shared cores at one client (benchmarks/proxy), aiohttp's general client took about a
quarter of a millisecond more a request than this one, most of what the proxy added on top of
the upstream's own time. The proxy needs little of a general client: one request per
connection at a time, the body already in memory, no cookies, redirects, proxies or
compression, the answer relayed as it comes. What it does need is here:

- **Framing of the answer:** ``Content-Length``, ``Transfer-Encoding: chunked`` (vLLM's
  streams) decoded, or until the connection closes; none for ``HEAD``, 204 and 304; interim
  1xx answers skipped. A head over :data:`MAX_HEAD_BYTES` or that is not HTTP/1.x is
  :class:`BadAnswer`.
- **Keep-alive:** a connection goes back to its pool only when its answer was read to the
  end, the server did not ask to close it and sent nothing more; one the server closes while
  idle leaves the pool at once; one it closes as it is taken (no byte of an answer) gets the
  request again on a new connection, once. At most ``limit`` connections per upstream; more
  requests wait for one.
- **Back-pressure:** reading from vLLM pauses while more than :data:`READ_HIGH_WATER` bytes of
  an answer wait for the client.
- **Errors by what can still be done** (the proxy's retry and fail-over rules read them):
  :class:`ConnectFailed` (nothing sent), :class:`ClosedBeforeAnswer` (the connection closed
  with no byte of an answer: Docker's userland proxy in front of a container not listening
  yet, or a server closing a reused keep-alive connection), :class:`ResetBeforeAnswer` (reset
  with no byte of an answer: vLLM died under the request), :class:`BadAnswer`,
  :class:`BrokenAnswer` (cut after the head).

Closing a :class:`Response` before its end closes the connection: vLLM sees the client gone
and stops the generation.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

__all__ = [
    "BadAnswer",
    "BrokenAnswer",
    "ClosedBeforeAnswer",
    "ConnectFailed",
    "Origin",
    "Pool",
    "ResetBeforeAnswer",
    "Response",
    "UpstreamError",
]

#: Most bytes of an answer's head (status line and headers) accepted.
MAX_HEAD_BYTES = 64 * 1024
#: Bytes of an answer waiting for the client before reading from the upstream pauses; it
#: resumes below a quarter of this.
READ_HIGH_WATER = 256 * 1024
#: Longest chunk-size or trailer line of a chunked answer accepted.
MAX_CHUNK_LINE = 4096


class UpstreamError(Exception):
    """The upstream request failed; the subclass says how far it got."""


class ConnectFailed(UpstreamError):
    """No connection (refused, unreachable, timed out): nothing was sent."""


class ClosedBeforeAnswer(UpstreamError):
    """The connection closed before any byte of an answer."""


class ResetBeforeAnswer(UpstreamError):
    """The connection was reset before any byte of an answer."""


class BadAnswer(UpstreamError):
    """What came back is not an HTTP/1.x answer this client reads."""


class BrokenAnswer(UpstreamError):
    """The answer broke off after its head."""


@dataclass(frozen=True)
class Origin:
    """Where an upstream listens: scheme, host and port, and its ``Host`` header."""

    scheme: str
    host: str
    port: int

    @classmethod
    def from_url(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http:// or https:// URL with a host: {url!r}")
        default = 443 if parts.scheme == "https" else 80
        return cls(parts.scheme, parts.hostname, parts.port or default)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _parse_head(head: bytes) -> tuple[int, str, bool, list[tuple[str, str]]]:
    """Status, reason, whether HTTP/1.1, and the headers (order and repeats kept)."""
    lines = head.decode("utf-8", "surrogateescape").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise BadAnswer(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadAnswer(f"not a header line: {line[:80]!r}")
        headers.append((name, value.strip(" \t")))
    return int(code), reason, version == "HTTP/1.1", headers


# the framing of an answer's body
_NONE, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(4)
# where a chunked body is
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)
# where the connection is
_IDLE, _HEAD, _BODY, _DONE = range(4)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an upstream; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = False
        #: Answers read on it to their end (a kept-alive connection has at least one).
        self.answered = 0
        self.on_idle_lost: Callable[[_Connection], None] | None = None
        self._phase = _IDLE
        self._buf = bytearray()
        self._head_only = False
        self._head: asyncio.Future[None] | None = None
        self.status = 0
        self.reason = ""
        self.headers: list[tuple[str, str]] = []
        self.content_length: int | None = None
        self._framing = _NONE
        self._left = 0
        self._chunk_state = _SIZE
        self._keep_alive = False
        self._queue: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._eof = False

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._phase == _BODY:
            self._body(data)
        elif self._phase == _HEAD:
            self._buf += data
            self._heads()
        elif data:
            # bytes nobody asked for (idle, or after a complete answer): not HTTP we can follow
            self.reusable = False
            self._close()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        if self._phase == _HEAD:
            if self._buf:
                self._fail(BadAnswer(f"closed inside the answer's head ({len(self._buf)} bytes)"))
            elif exc is None:
                self._fail(ClosedBeforeAnswer("closed before any answer"))
            else:
                self._fail(ResetBeforeAnswer(_describe(exc)))
        elif self._phase == _BODY:
            if self._framing == _UNTIL_CLOSE and exc is None:
                self._end()
            else:
                what = _describe(exc) if exc is not None else "closed"
                self._fail(BrokenAnswer(f"{what} before the end of the answer"))
        elif self._phase in (_IDLE, _DONE) and self.on_idle_lost is not None:
            self.on_idle_lost(self)

    # ------------------------------------------------------------------ the request

    def send(self, head: bytes, body: bytes | None, head_only: bool) -> asyncio.Future[None]:
        """Write a request; the future is done when the answer's head is in."""
        assert self.transport is not None and self._phase in (_IDLE, _DONE)
        loop = asyncio.get_running_loop()
        self._phase, self._head_only, self.reusable = _HEAD, head_only, False
        self._queue.clear()
        self._queued, self._error, self._eof, self._waiter = 0, None, False, None
        self._head = loop.create_future()
        self.transport.write(head + body if body else head)
        return self._head

    def _heads(self) -> None:
        while self._phase == _HEAD:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD_BYTES:
                    self._fail(BadAnswer(f"answer head over {MAX_HEAD_BYTES} bytes"))
                    self._close()
                return
            head = bytes(self._buf[:end])
            del self._buf[: end + 4]
            try:
                status, reason, http11, headers = _parse_head(head)
                framing, length = self._framing_of(status, headers)
            except BadAnswer as exc:
                self._fail(exc)
                self._close()
                return
            if 100 <= status < 200:
                continue  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            self.status, self.reason, self.headers = status, reason, headers
            self.content_length = length if framing == _LENGTH else None
            self._framing, self._left, self._chunk_state = framing, length, _SIZE
            tokens = {
                t.strip().lower()
                for k, v in headers
                if k.lower() == "connection"
                for t in v.split(",")
            }
            self._keep_alive = "close" not in tokens if http11 else "keep-alive" in tokens
            self._phase = _BODY
            rest = bytes(self._buf)
            self._buf.clear()
            if self._head is not None and not self._head.done():
                self._head.set_result(None)
            if framing == _NONE or (framing == _LENGTH and length == 0):
                self._end()
            if rest:
                self.data_received(rest)

    def _framing_of(self, status: int, headers: list[tuple[str, str]]) -> tuple[int, int]:
        if self._head_only or status in (204, 304) or 100 <= status < 200:
            return _NONE, 0
        lengths: set[str] = set()
        chunked = False
        for name, value in headers:
            lower = name.lower()
            if lower == "transfer-encoding":
                chunked = value.rsplit(",", 1)[-1].strip().lower() == "chunked"
            elif lower == "content-length":
                lengths.update(v.strip() for v in value.split(","))
        if chunked:
            return _CHUNKED, 0
        if lengths:
            if len(lengths) > 1 or not all(v.isdigit() for v in lengths):
                raise BadAnswer(f"Content-Length not one number: {sorted(lengths)}")
            return _LENGTH, int(lengths.pop())
        return _UNTIL_CLOSE, 0

    # ------------------------------------------------------------------ the body

    def _body(self, data: bytes) -> None:
        if self._framing == _CHUNKED:
            self._buf += data
            self._chunks()
        elif self._framing == _LENGTH:
            if len(data) > self._left:
                self._keep_alive = False  # more than announced: the connection cannot be trusted
                data = data[: self._left]
            self._left -= len(data)
            self._push(data)
            if not self._left:
                self._end()
        else:
            self._push(data)

    def _chunks(self) -> None:
        buf = self._buf
        while self._phase == _BODY:
            if self._chunk_state == _DATA:
                if not buf:
                    return
                piece = bytes(buf[: self._left])
                del buf[: len(piece)]
                self._left -= len(piece)
                self._push(piece)
                if not self._left:
                    self._chunk_state = _DATA_END
                continue
            if self._chunk_state == _DATA_END:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    self._broken("no CRLF after a chunk")
                    return
                del buf[:2]
                self._chunk_state = _SIZE
                continue
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > MAX_CHUNK_LINE:
                    self._broken(f"chunk line over {MAX_CHUNK_LINE} bytes")
                return
            line = bytes(buf[:end])
            del buf[: end + 2]
            if self._chunk_state == _TRAILER:
                if not line:
                    self._end()
                continue
            size = line.split(b";", 1)[0].strip()
            try:
                self._left = int(size, 16)
            except ValueError:
                self._broken(f"not a chunk size: {size[:40]!r}")
                return
            self._chunk_state = _DATA if self._left else _TRAILER

    def _push(self, data: bytes) -> None:
        if not data:
            return
        self._queue.append(data)
        self._queued += len(data)
        if self._queued > READ_HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _end(self) -> None:
        self._phase = _DONE
        self._eof = True
        self.answered += 1
        self.reusable = self._keep_alive and not self._buf and not self.closed
        self._wake()

    def _broken(self, why: str) -> None:
        self._fail(BrokenAnswer(why))
        self._close()

    def _fail(self, exc: UpstreamError) -> None:
        self.reusable = False
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)
            self._phase = _DONE
            return
        self._error = exc
        self._phase = _DONE
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    async def readany(self) -> bytes:
        """The next piece of the answer's body; ``b""`` at its end."""
        while not self._queue:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._queue.popleft()
        self._queued -= len(data)
        if self._paused and self._queued < READ_HIGH_WATER // 4 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data


class Response:
    """An upstream's answer: its head at once, its body as it comes."""

    __slots__ = ("_conn", "_origin", "_pool", "_released", "headers", "reason", "status")

    def __init__(self, pool: Pool, origin: Origin, conn: _Connection) -> None:
        self._pool, self._origin, self._conn = pool, origin, conn
        self._released = False
        self.status = conn.status
        self.reason = conn.reason
        #: The headers as sent (order and repeats kept).
        self.headers = conn.headers

    @property
    def content_length(self) -> int | None:
        return self._conn.content_length

    async def readany(self) -> bytes:
        """The next piece of the body; ``b""`` at its end (raises :class:`UpstreamError`)."""
        return await self._conn.readany()

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self._conn.readany():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Done with the answer: its connection goes back to the pool if read to the end,
        else it is closed."""
        if not self._released:
            self._released = True
            self._pool._release(self._origin, self._conn)


class Pool:
    """Keep-alive connections per upstream, at most ``limit`` each."""

    def __init__(self, limit: int, connect_timeout: float = 10.0) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self.connect_timeout = connect_timeout
        self._idle: dict[Origin, list[_Connection]] = {}
        self._count: dict[Origin, int] = {}
        self._waiting: dict[Origin, collections.deque[asyncio.Future[None]]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def request(
        self,
        origin: Origin,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
    ) -> Response:
        """Send a request; the answer once its head is in.

        ``target`` is the request target as sent (path and query, already encoded); ``Host``
        and, with a ``body``, ``Content-Length`` are added here and must not be in ``headers``.
        """
        lines = [f"{method} {target} HTTP/1.1", f"Host: {origin.host_header}"]
        lines += [f"{name}: {value}" for name, value in headers]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
        conn = await self._acquire(origin)
        try:
            await conn.send(head, body, method == "HEAD")
        except ClosedBeforeAnswer:
            self._release(origin, conn)
            if not conn.answered:
                raise
            # a kept-alive connection the server closed as it was taken (uvicorn closes one
            # idle for 5 s): the server read nothing of this request; once more, on a new one
            conn = await self._acquire(origin, fresh=True)
            try:
                await conn.send(head, body, method == "HEAD")
            except BaseException:
                self._release(origin, conn)
                raise
        except BaseException:
            self._release(origin, conn)
            raise
        return Response(self, origin, conn)

    async def _acquire(self, origin: Origin, fresh: bool = False) -> _Connection:
        while True:
            if self._closed:
                raise ConnectFailed("the proxy is closing")
            idle = None if fresh else self._idle.get(origin)
            while idle:
                conn = idle.pop()  # the one used last: its server side is warm
                if not conn.closed:
                    return conn
            if self._count.get(origin, 0) < self.limit:
                break
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(origin, collections.deque()).append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one(origin)  # hand the slot given to us to the next one
                raise
        self._count[origin] = self._count.get(origin, 0) + 1
        try:
            return await self._connect(origin)
        except BaseException:
            self._forget(origin)
            raise

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    _Connection,
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls else None,
                )
        except TimeoutError as exc:
            raise ConnectFailed(
                f"connect to {origin.host_header} timed out after {self.connect_timeout:g} s"
            ) from exc
        except OSError as exc:
            raise ConnectFailed(f"connect to {origin.host_header}: {_describe(exc)}") from exc
        conn.on_idle_lost = lambda lost: self._idle_lost(origin, lost)
        return conn

    def _release(self, origin: Origin, conn: _Connection) -> None:
        if conn.reusable and not conn.closed and not self._closed:
            self._idle.setdefault(origin, []).append(conn)
            self._wake_one(origin)
            return
        conn.on_idle_lost = None
        if not conn.closed and conn.transport is not None:
            conn.transport.close()
        self._forget(origin)

    def _idle_lost(self, origin: Origin, conn: _Connection) -> None:
        idle = self._idle.get(origin, [])
        if conn in idle:
            idle.remove(conn)
            self._forget(origin)

    def _forget(self, origin: Origin) -> None:
        self._count[origin] -= 1
        self._wake_one(origin)

    def _wake_one(self, origin: Origin) -> None:
        waiting = self._waiting.get(origin)
        while waiting:
            waiter = waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def idle_connections(self, origin: Origin) -> int:
        """Connections to ``origin`` in the pool now (for tests and state)."""
        return sum(1 for c in self._idle.get(origin, []) if not c.closed)

    def open_connections(self, origin: Origin) -> int:
        """Connections to ``origin`` open or being opened, idle or not."""
        return self._count.get(origin, 0)

    def close(self) -> None:
        """Close the idle connections; answers being read end as their connections close."""
        self._closed = True
        for origin, idle in self._idle.items():
            for conn in idle:
                conn.on_idle_lost = None
                if conn.transport is not None:
                    conn.transport.close()
                self._count[origin] -= 1
            idle.clear()
        for waiting in self._waiting.values():
            for waiter in waiting:
                if not waiter.done():
                    waiter.set_result(None)
