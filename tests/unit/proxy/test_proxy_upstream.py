"""The proxy's upstream client against real sockets: a server per test that writes exactly the
bytes an HTTP/1.1 server (vLLM's uvicorn, or a broken one) would, split as TCP may split them.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from cardshare.proxy import upstream
from cardshare.proxy.upstream import Origin, Pool

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """A TCP server running ``script`` for each connection; it counts connections and keeps the
    request heads it read."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.open_now = 0
        self.most_open = 0
        self.heads: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.ended = asyncio.Event()

    async def start(self) -> Origin:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return Origin("http", "127.0.0.1", port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            await self.script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open_now -= 1
            self.ended.set()
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One request: its head (kept) and its body (by Content-Length)."""
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return await reader.readexactly(length) if length else b""

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


Serve = Callable[[Script], Awaitable[tuple[Server, Origin]]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[Server] = []

    async def start(script: Script) -> tuple[Server, Origin]:
        server = Server(script)
        servers.append(server)
        return server, await server.start()

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    pool = Pool(4, connect_timeout=2.0)
    yield pool
    pool.close()


OK_BODY = b'{"id":"cmpl-1","object":"chat.completion"}'


def answer(body: bytes = OK_BODY, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + extra
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )


async def dribble(writer: asyncio.StreamWriter, data: bytes, size: int = 3) -> None:
    """Write ``data`` a few bytes at a time, each piece its own TCP segment."""
    for n in range(0, len(data), size):
        writer.write(data[n : n + size])
        await writer.drain()
        await asyncio.sleep(0.001)


async def answering(serve: Serve, wire: bytes) -> Origin:
    """A server that reads one request, writes ``wire`` and closes the connection."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(wire)
        await writer.drain()

    server, origin = await serve(script)
    return origin


async def get(
    pool: Pool, origin: Origin, method: str = "POST", body: bytes | None = b"{}"
) -> tuple[int, list[tuple[str, str]], bytes]:
    resp = await pool.request(origin, method, "/v1/chat/completions", [("X-A", "1")], body)
    try:
        return resp.status, resp.headers, await resp.read()
    finally:
        resp.close()


# --------------------------------------------------------------------------- the request


async def test_the_request_is_sent_as_given_with_host_and_length(serve: Serve, pool: Pool) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await server.read_request(reader)
        assert body == b'{"model":"m"}'
        writer.write(answer())

    server, origin = await serve(script)
    resp = await pool.request(
        origin,
        "POST",
        "/v1/chat/completions?x=%20y",
        [("Content-Type", "application/json"), ("X-Trace", "a"), ("X-Trace", "b")],
        b'{"model":"m"}',
    )
    resp.close()
    assert server.heads == [
        b"POST /v1/chat/completions?x=%%20y HTTP/1.1\r\n"
        b"Host: 127.0.0.1:%d\r\n"
        b"Content-Type: application/json\r\nX-Trace: a\r\nX-Trace: b\r\n"
        b"Content-Length: 13\r\n\r\n" % origin.port
    ]


async def test_a_request_without_a_body_has_no_length(serve: Serve, pool: Pool) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(answer())

    server, origin = await serve(script)
    await get(pool, origin, "GET", None)
    assert b"content-length" not in server.heads[0].lower()


def test_the_host_header_leaves_out_the_default_port() -> None:
    assert Origin.from_url("http://gpu5:80/").host_header == "gpu5"
    assert Origin.from_url("https://gpu5/").host_header == "gpu5"
    assert Origin.from_url("https://gpu5:8443").host_header == "gpu5:8443"
    assert Origin.from_url("http://[::1]:8000").host_header == "[::1]:8000"
    with pytest.raises(ValueError, match="not an http"):
        Origin.from_url("ftp://gpu5")


# --------------------------------------------------------------------------- framing


async def test_an_answer_of_known_length_split_anywhere_and_the_connection_reused(
    serve: Serve, pool: Pool
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(3):
            await server.read_request(reader)
            await dribble(writer, answer(extra=b"x-request-id: 7\r\n"))

    server, origin = await serve(script)
    for _ in range(3):
        status, headers, body = await get(pool, origin)
        assert (status, body) == (200, OK_BODY)
        assert ("x-request-id", "7") in headers
    assert server.connections == 1
    assert pool.idle_connections(origin) == 1


async def test_a_chunked_stream_is_decoded_piece_by_piece(serve: Serve, pool: Pool) -> None:
    events = [b'data: {"n": %d}\n\n' % n for n in range(5)] + [b"data: [DONE]\n\n"]
    wire = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    wire += b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in events)
    wire += b"0\r\nx-trailer: t\r\n\r\n"

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await server.read_request(reader)
            await dribble(writer, wire, size=5)

    server, origin = await serve(script)
    for _ in range(2):
        resp = await pool.request(origin, "POST", "/v1/chat/completions", [], b"{}")
        assert resp.content_length is None
        got = b""
        while piece := await resp.readany():
            got += piece
        resp.close()
        assert got == b"".join(events)
    assert server.connections == 1  # the trailer was read: the connection was reused


async def test_an_answer_until_close_is_read_to_the_end_and_not_reused(
    serve: Serve, pool: Pool
) -> None:
    origin = await answering(serve, b"HTTP/1.1 200 OK\r\n\r\nall of it")
    assert (await get(pool, origin))[2] == b"all of it"
    assert pool.open_connections(origin) == 0


@pytest.mark.parametrize(
    ("method", "status_line", "headers"),
    [
        ("HEAD", b"200 OK", b"content-length: 42\r\n"),
        ("POST", b"204 No Content", b""),
        ("GET", b"304 Not Modified", b"content-length: 42\r\n"),
    ],
)
async def test_answers_without_a_body_end_at_their_head(
    serve: Serve, pool: Pool, method: str, status_line: bytes, headers: bytes
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 " + status_line + b"\r\n" + headers + b"\r\n")

    server, origin = await serve(script)
    for _ in range(2):
        assert (await get(pool, origin, method, None))[2] == b""
    assert server.connections == 1


async def test_an_interim_answer_is_skipped(serve: Serve, pool: Pool) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        await dribble(writer, b"HTTP/1.1 100 Continue\r\n\r\n" + answer(), size=7)

    server, origin = await serve(script)
    assert (await get(pool, origin))[::2] == (200, OK_BODY)


@pytest.mark.parametrize(
    "closing", [b"connection: close\r\n", b"Connection: Keep-Alive, Close\r\n"]
)
async def test_a_server_asking_to_close_gets_a_new_connection(
    serve: Serve, pool: Pool, closing: bytes
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(answer(extra=closing))

    server, origin = await serve(script)
    for _ in range(2):
        assert (await get(pool, origin))[0] == 200
    assert server.connections == 2


async def test_bytes_beyond_the_answer_keep_the_connection_out_of_the_pool(
    serve: Serve, pool: Pool
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(answer() + b"HTTP/1.1 200 OK\r\n")  # a second answer nobody asked for
        await asyncio.sleep(0.5)

    server, origin = await serve(script)
    assert (await get(pool, origin))[2] == OK_BODY
    await get(pool, origin)
    assert server.connections == 2


async def test_an_idle_connection_the_server_closed_is_not_used(serve: Serve, pool: Pool) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(answer())
        await writer.drain()
        # uvicorn closes a keep-alive connection idle for 5 s

    server, origin = await serve(script)
    await get(pool, origin)
    await server.ended.wait()
    await asyncio.sleep(0.05)
    assert pool.idle_connections(origin) == 0
    assert (await get(pool, origin))[0] == 200
    assert server.connections == 2


async def test_a_kept_alive_connection_closed_as_it_is_taken_is_tried_once_more(
    serve: Serve, pool: Pool
) -> None:
    """The server closes an idle connection just as the next request goes on it (uvicorn's
    5 s keep-alive): that request gets no answer there and goes again on a new connection."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(answer())
        if server.connections == 1:
            await server.read_request(reader)  # the second request, then closed unanswered

    server, origin = await serve(script)
    await get(pool, origin)
    assert (await get(pool, origin))[::2] == (200, OK_BODY)
    assert (server.connections, len(server.heads)) == (2, 3)


# --------------------------------------------------------------------------- faults


async def test_a_refused_connection_is_connect_failed(pool: Pool) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(upstream.ConnectFailed, match=r"Connection refused|ConnectionRefused"):
        await get(pool, Origin("http", "127.0.0.1", port))
    assert pool.open_connections(Origin("http", "127.0.0.1", port)) == 0


async def test_a_close_before_any_answer_is_closed_before_answer(serve: Serve, pool: Pool) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)

    server, origin = await serve(script)
    with pytest.raises(upstream.ClosedBeforeAnswer):
        await get(pool, origin)


async def test_a_reset_before_any_answer_is_reset_before_answer(serve: Serve, pool: Pool) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        sock = writer.get_extra_info("socket")
        # SO_LINGER 0: close sends RST, as a killed process's socket does with unread data
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server, origin = await serve(script)
    with pytest.raises(upstream.ResetBeforeAnswer):
        await get(pool, origin)


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "not a header line"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5, 6\r\n\r\n", "Content-Length not one number"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n", "Content-Length not one number"),
        (b"HTTP/1.1 200 OK\r\nx: " + b"a" * 70000, "head over"),
        (b"HTTP/1.1 200 OK\r\ncontent-le", "closed inside the answer's head"),
    ],
)
async def test_garbage_for_a_head_is_a_bad_answer(
    serve: Serve, pool: Pool, wire: bytes, match: str
) -> None:
    origin = await answering(serve, wire)
    with pytest.raises(upstream.BadAnswer, match=match):
        await get(pool, origin)
    assert pool.open_connections(origin) == 0


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nten bytes.", "before the end"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", "before the end"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhello\r\n", "no CRLF"),
    ],
)
async def test_an_answer_cut_after_its_head_is_broken(
    serve: Serve, pool: Pool, wire: bytes, match: str
) -> None:
    origin = await answering(serve, wire)
    resp = await pool.request(origin, "POST", "/", [], b"{}")
    try:
        assert resp.status == 200
        with pytest.raises(upstream.BrokenAnswer, match=match):
            await resp.read()
    finally:
        resp.close()
    assert pool.open_connections(origin) == 0


async def test_closing_an_answer_before_its_end_closes_the_connection(
    serve: Serve, pool: Pool
) -> None:
    """The client went away: vLLM must see its connection close (it stops the generation)."""
    seen_eof = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        assert await reader.read() == b""
        seen_eof.set()

    server, origin = await serve(script)
    resp = await pool.request(origin, "POST", "/", [], b"{}")
    assert await resp.readany() == b"hello"
    resp.close()
    await asyncio.wait_for(seen_eof.wait(), 5)
    assert pool.open_connections(origin) == 0


async def test_a_hung_upstream_is_left_by_cancelling(serve: Serve, pool: Pool) -> None:
    """No read timeout (a generation may take minutes): the proxy's handler is cancelled when
    its client goes, and the connection to the upstream closes with it."""
    seen_eof = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        assert await reader.read() == b""
        seen_eof.set()

    server, origin = await serve(script)
    task = asyncio.ensure_future(get(pool, origin))
    await asyncio.sleep(0.2)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(seen_eof.wait(), 5)
    assert pool.open_connections(origin) == 0


# --------------------------------------------------------------------------- the pool


async def test_at_most_limit_connections_and_every_request_answered(serve: Serve) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.read_request(reader)
            await asyncio.sleep(0.05)
            writer.write(answer())

    server, origin = await serve(script)
    pool = Pool(2)
    try:
        results = await asyncio.gather(*(get(pool, origin) for _ in range(10)))
    finally:
        pool.close()
    assert [r[0] for r in results] == [200] * 10
    assert (server.most_open, server.connections) == (2, 2)


async def test_a_waiter_cancelled_gives_its_turn_on(serve: Serve) -> None:
    release = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.read_request(reader)
            await release.wait()
            writer.write(answer())

    server, origin = await serve(script)
    pool = Pool(1)
    try:
        first = asyncio.ensure_future(get(pool, origin))
        await asyncio.sleep(0.05)
        cancelled = asyncio.ensure_future(get(pool, origin))
        third = asyncio.ensure_future(get(pool, origin))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        release.set()
        assert (await first)[0] == 200
        assert (await asyncio.wait_for(third, 5))[0] == 200
    finally:
        pool.close()
    assert server.connections == 1


async def test_reading_pauses_while_the_answer_waits(serve: Serve, pool: Pool) -> None:
    """A client slower than vLLM: no more than about READ_HIGH_WATER waits in the proxy."""
    piece = b"x" * 65536
    count = 64  # 4 MiB

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(piece) * count))
        for _ in range(count):
            writer.write(piece)
            await writer.drain()

    server, origin = await serve(script)
    resp = await pool.request(origin, "POST", "/", [], b"{}")
    conn = resp._conn  # the connection's own queue is what is measured
    await asyncio.sleep(0.3)
    assert conn._paused
    assert conn._queued <= upstream.READ_HIGH_WATER + 256 * 1024
    total = 0
    while chunk := await resp.readany():
        total += len(chunk)
    resp.close()
    assert total == len(piece) * count
