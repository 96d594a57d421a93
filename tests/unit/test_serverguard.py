"""Read timeouts of aiohttp servers (cardshare.serverguard), over real loopback sockets.

The slow clients are raw sockets that send part of a request and stall, as in the report
of issue 8 (200 such sockets stayed open indefinitely). Timeouts are a fraction of a second;
each check allows up to a second of slack on a loaded machine, never less than the bound.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from slow_clients import send_raw, until_closed

from cardshare.serverguard import (
    BodyTimeoutError,
    GuardedAppRunner,
    body_timeout_paused,
    check_timeouts,
    guarded_runner,
    sweep_heads,
    sweep_interval,
)

SLACK = 1.0
EARLY = 0.05  # loop clock granularity


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def handle_root(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def handle_read(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response({"len": len(body)})


async def handle_paused(request: web.Request) -> web.Response:
    with body_timeout_paused(request):
        await asyncio.sleep(float(request.query["hold"]))
    body = await request.read()
    return web.json_response({"len": len(body)})


@dataclass
class Served:
    runner: GuardedAppRunner
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connections(self) -> int:
        assert self.runner.server is not None
        return len(self.runner.server.connections)


ServeFactory = Callable[..., Awaitable[Served]]


@pytest.fixture
async def serve() -> AsyncIterator[ServeFactory]:
    runners: list[web.AppRunner] = []

    async def factory(**timeouts: float) -> Served:
        app = web.Application()
        app.router.add_get("/", handle_root)
        app.router.add_post("/read", handle_read)
        app.router.add_post("/paused", handle_paused)
        runner = guarded_runner(app, access_log=None, **timeouts)
        await runner.setup()
        runners.append(runner)
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return Served(runner, port)

    yield factory
    for runner in runners:
        await runner.cleanup()


async def wait_until(cond: Callable[[], bool], what: str, limit: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.01)


def status_and_doc(data: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


# ------------------------------------------------------------------ pure parts


@pytest.mark.parametrize(
    ("first_seen", "live", "now", "kept", "closed"),
    [
        ({}, ["a"], 5.0, {"a": 5.0}, []),
        ({"a": 1.0}, ["a"], 5.0, {"a": 1.0}, []),
        ({"a": 1.0}, ["a"], 11.0, {}, ["a"]),
        ({"a": None}, ["a"], 100.0, {"a": None}, []),
        ({"a": 1.0, "gone": 0.0}, ["a", "b"], 2.0, {"a": 1.0, "b": 2.0}, []),
        ({"a": 0.0, "b": None, "c": 9.0}, ["a", "b", "c"], 10.0, {"b": None, "c": 9.0}, ["a"]),
    ],
)
def test_sweep_heads(
    first_seen: dict[str, float | None],
    live: list[str],
    now: float,
    kept: dict[str, float | None],
    closed: list[str],
) -> None:
    assert sweep_heads(first_seen, live, now, 10.0) == (kept, closed)


@pytest.mark.parametrize(
    ("header", "expected"), [(10.0, 0.5), (2.0, 0.2), (0.4, 0.04), (0.01, 0.01)]
)
def test_sweep_interval(header: float, expected: float) -> None:
    assert sweep_interval(header) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("timeouts", "message"),
    [
        ((0, 30, 75), "header_timeout must be a finite number of seconds > 0, got 0"),
        ((10, -1.0, 75), "body_timeout must be a finite number of seconds > 0, got -1.0"),
        (
            (10, 30, float("inf")),
            "keepalive_timeout must be a finite number of seconds > 0, got inf",
        ),
        (
            (10, 30, float("nan")),
            "keepalive_timeout must be a finite number of seconds > 0, got nan",
        ),
        ((10, "30", 75), "body_timeout must be a number of seconds, got '30'"),
        ((True, 30, 75), "header_timeout must be a number of seconds, got True"),
    ],
)
def test_check_timeouts_refuses(timeouts: tuple[Any, Any, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        check_timeouts(*timeouts)
    assert str(err.value) == message


def test_body_timeout_error_is_a_timeout() -> None:
    exc = BodyTimeoutError(30.0)
    assert isinstance(exc, TimeoutError)
    assert (str(exc), exc.seconds) == ("request body not received within 30 s", 30.0)


async def test_guarded_runner_needs_an_app_not_started() -> None:
    app = web.Application()
    app.freeze()
    with pytest.raises(RuntimeError) as err:
        guarded_runner(app)
    assert str(err.value) == "guarded_runner() needs an application that has not started yet"


# ------------------------------------------------------------------ over sockets


@pytest.mark.parametrize(
    "sent",
    [b"", b"GET / HT", b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow"],
    ids=["nothing", "half-request-line", "half-headers"],
)
async def test_incomplete_head_is_closed_at_header_timeout(
    serve: ServeFactory, sent: bytes
) -> None:
    served = await serve(header_timeout=0.4, body_timeout=5.0)
    loop = asyncio.get_running_loop()
    reader, writer = await send_raw(served.port, sent)
    started = loop.time()
    data, closed = await until_closed(reader, 0.4 + SLACK)
    writer.close()
    assert data == b""
    assert 0.4 - EARLY <= closed - started <= 0.4 + SLACK
    assert (served.runner.stats.header_timeouts, served.runner.stats.body_timeouts) == (1, 0)


@pytest.mark.parametrize(
    "sent",
    [
        b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10,
        b"POST /read HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n" + b"x" * 10,
    ],
    ids=["content-length", "chunked"],
)
async def test_stalled_body_gets_408_and_close(serve: ServeFactory, sent: bytes) -> None:
    served = await serve(header_timeout=5.0, body_timeout=0.4)
    loop = asyncio.get_running_loop()
    reader, writer = await send_raw(served.port, sent)
    started = loop.time()
    data, closed = await until_closed(reader, 0.4 + SLACK)
    writer.close()
    status, headers, doc = status_and_doc(data)
    assert (status, headers["Connection"]) == (408, "close")
    assert doc == {
        "error": "request body not received within 0.4 s; send the request body faster "
        "or raise the server's body timeout"
    }
    assert 0.4 - EARLY <= closed - started <= 0.4 + SLACK
    assert (served.runner.stats.header_timeouts, served.runner.stats.body_timeouts) == (0, 1)


@pytest.mark.parametrize("then", [b"", b"GET / HTTP/1.1\r\nHo"], ids=["idle", "half-second-head"])
async def test_kept_alive_connection_is_closed_at_keepalive_timeout(
    serve: ServeFactory, then: bytes
) -> None:
    served = await serve(header_timeout=5.0, body_timeout=5.0, keepalive_timeout=0.4)
    loop = asyncio.get_running_loop()
    reader, writer = await send_raw(served.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"Connection: close" not in head
    assert await reader.readexactly(2) == b"ok"
    answered = loop.time()
    if then:
        writer.write(then)
    data, closed = await until_closed(reader, 0.4 + SLACK)
    writer.close()
    assert data == b""
    assert 0.4 - EARLY <= closed - answered <= 0.4 + SLACK


async def test_paused_body_clock_restarts_when_the_pause_ends(serve: ServeFactory) -> None:
    # the handler leaves the body unread for 0.6 s (paused), then reads: the stalled body
    # times out 0.3 s after the pause, not 0.3 s after the head
    served = await serve(header_timeout=5.0, body_timeout=0.3)
    loop = asyncio.get_running_loop()
    reader, writer = await send_raw(
        served.port, b"POST /paused?hold=0.6 HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345"
    )
    started = loop.time()
    data, closed = await until_closed(reader, 0.9 + SLACK)
    writer.close()
    assert status_and_doc(data)[0] == 408
    assert 0.9 - EARLY <= closed - started <= 0.9 + SLACK


async def test_paused_body_that_completes_is_read(serve: ServeFactory) -> None:
    served = await serve(header_timeout=5.0, body_timeout=0.3)
    reader, writer = await send_raw(
        served.port,
        b"POST /paused?hold=0.6 HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
        b"Connection: close\r\n\r\n12345",
    )
    await asyncio.sleep(0.45)  # beyond the body timeout, inside the pause
    writer.write(b"67890")
    data, _ = await until_closed(reader, 0.6 + SLACK)
    writer.close()
    assert status_and_doc(data)[::2] == (200, {"len": 10})
    assert served.runner.stats.body_timeouts == 0


async def test_many_slow_sockets_neither_block_nor_linger(serve: ServeFactory) -> None:
    served = await serve(header_timeout=1.0, body_timeout=1.0)
    loop = asyncio.get_running_loop()
    slow_sends = (
        [b""] * 20
        + [b"GET / HTTP/1.1\r\nHost: x\r\n"] * 20
        + [b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10] * 20
    )
    slow = [await send_raw(served.port, sent) for sent in slow_sends]
    opened = loop.time()
    async with aiohttp.ClientSession() as client:
        for n in range(3):  # one kept-alive connection, bodies and no bodies
            async with client.get(served.url + "/") as resp:
                assert (resp.status, await resp.text()) == (200, "ok")
            async with client.post(served.url + "/read", data=b"y" * (1000 * n)) as resp:
                assert (resp.status, await resp.json()) == (200, {"len": 1000 * n})
        answered = loop.time()
        assert answered - opened < 1.0  # before any slow socket was cut off
    results = await asyncio.gather(*(until_closed(reader, 1.0 + SLACK) for reader, _ in slow))
    for _, writer in slow:
        writer.close()
    assert [status_and_doc(data)[0] if data else None for data, _ in results] == [None] * 40 + [
        408
    ] * 20
    assert all(closed - opened <= 1.0 + SLACK for _, closed in results)
    assert (served.runner.stats.header_timeouts, served.runner.stats.body_timeouts) == (40, 20)
    await wait_until(lambda: served.connections() == 0, "no connection left on the server")
