"""Slow clients and request bodies (issue 8), over real loopback sockets.

The proxy closes connections that never complete a request head, answers 408 to a body that
stalls, decides whether to hold a request on its head alone and leaves a held request's
body unread until the request is released.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
from typing import Any

from promtext import Exposition
from slow_clients import send_raw, until_closed

from cardshare.proxy.rules import body_timeout_message, count_message
from cardshare.proxy.server import HELD_BODY_WINDOW_BYTES

from .conftest import StandFactory, read_response, wait_for

SLACK = 1.0
EARLY = 0.05
CHAT = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}'


def post_head(path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


def port_of(stand: Any) -> int:
    return int(stand.url.rsplit(":", 1)[1])


async def test_incomplete_head_is_closed(make_stand: StandFactory) -> None:
    stand = await make_stand(header_timeout_seconds=0.4)
    loop = asyncio.get_running_loop()
    reader, writer = await send_raw(port_of(stand), b"POST /v1/chat/completions HTTP/1.1\r\nHo")
    started = loop.time()
    data, closed = await until_closed(reader, 0.4 + SLACK)
    writer.close()
    assert data == b""
    assert 0.4 - EARLY <= closed - started <= 0.4 + SLACK
    async with stand.client.get(stand.url + "/metrics") as resp:
        m = Exposition(await resp.text())
    assert m("cardshare_proxy_client_read_timeouts_total", phase="header") == 1


async def test_stalled_body_is_408_and_closed(make_stand: StandFactory) -> None:
    stand = await make_stand(body_timeout_seconds=0.4)
    loop = asyncio.get_running_loop()
    sent = post_head("/v1/chat/completions", 1000) + b'{"model": "'
    reader, writer = await send_raw(port_of(stand), sent)
    started = loop.time()
    status, headers, doc = await read_response(reader, 0.4 + SLACK)
    data, closed = await until_closed(reader, SLACK)
    writer.close()
    assert (status, headers["connection"], data) == (408, "close", b"")
    assert doc["error"] == {
        "message": body_timeout_message(0.4),
        "type": "invalid_request_error",
        "param": None,
        "code": "request_timeout",
    }
    assert doc["error"]["message"] == (
        "request body not received within 0.4 s (body_timeout_seconds)"
    )
    assert 0.4 - EARLY <= closed - started <= 0.4 + SLACK
    assert (stand.proxy.counters.outcomes["rejected_body_timeout"], stand.upstream.seen) == (1, [])
    assert (stand.proxy.in_flight, stand.proxy.guard_stats.body_timeouts) == (0, 1)


async def test_slow_sockets_do_not_block_the_proxy_and_are_closed(
    make_stand: StandFactory,
) -> None:
    stand = await make_stand(header_timeout_seconds=1.0, body_timeout_seconds=1.0)
    loop = asyncio.get_running_loop()
    port = port_of(stand)
    slow_sends = (
        [b""] * 20
        + [b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"] * 20
        + [post_head("/v1/chat/completions", 1000) + b'{"model": '] * 20
    )
    slow = [await send_raw(port, sent) for sent in slow_sends]
    opened = loop.time()
    for _ in range(3):
        async with stand.client.post(stand.url + "/v1/chat/completions", data=CHAT) as resp:
            doc = await resp.json()
        assert (resp.status, doc["choices"][0]["message"]["content"]) == (200, "hello there")
    assert loop.time() - opened < 1.0  # answered before any slow socket was cut off
    results = await asyncio.gather(*(until_closed(reader, 1.0 + SLACK) for reader, _ in slow))
    for _, writer in slow:
        writer.close()
    answers = [data.split(b" ", 2)[1] if data else None for data, _ in results]
    assert answers == [None] * 40 + [b"408"] * 20
    assert all(closed - opened <= 1.0 + SLACK for _, closed in results)
    outcomes = stand.proxy.counters.outcomes
    assert (outcomes["forwarded"], outcomes["rejected_body_timeout"]) == (3, 20)
    assert (stand.proxy.guard_stats.header_timeouts, stand.proxy.in_flight) == (40, 0)


async def test_full_queue_is_refused_on_the_head(make_stand: StandFactory) -> None:
    # the body never comes: the refusal must not wait for it
    stand = await make_stand(hold_max_requests=0, retry_after_seconds=7, body_timeout_seconds=30)
    await stand.set_mode("image")
    reader, writer = await send_raw(
        port_of(stand), post_head("/v1/chat/completions", 1000) + b'{"mo'
    )
    status, headers, doc = await read_response(reader, SLACK)
    writer.close()
    assert (status, headers["retry-after"], doc["error"]["code"]) == (503, "7", "hold_queue_full")
    assert doc["error"]["message"] == count_message("image", 0, 7)


async def test_too_large_is_refused_on_the_head(make_stand: StandFactory) -> None:
    stand = await make_stand(max_body_bytes=100, body_timeout_seconds=30)
    await stand.set_mode("image")
    reader, writer = await send_raw(port_of(stand), post_head("/v1/chat/completions", 1000))
    status, headers, doc = await read_response(reader, SLACK)
    writer.close()
    assert (status, headers["connection"], doc["error"]["code"]) == (413, "close", "too_large")
    assert len(stand.proxy.queue) == 0


async def test_held_body_is_read_only_after_release(make_stand: StandFactory) -> None:
    # held for longer than the body timeout without a 408; once released, the stalled body
    # gets the whole body timeout again, then its 408
    stand = await make_stand(body_timeout_seconds=0.3)
    await stand.set_mode("image")
    loop = asyncio.get_running_loop()
    reader, writer = await send_raw(
        port_of(stand), post_head("/v1/chat/completions", 1000) + b'{"model": '
    )
    await wait_for(lambda: len(stand.proxy.queue) == 1, "request held")
    await asyncio.sleep(0.6)
    assert len(stand.proxy.queue) == 1
    await stand.set_mode("llm")
    released = loop.time()
    status, _, doc = await read_response(reader, 0.3 + SLACK)
    answered = loop.time()
    writer.close()
    assert (status, doc["error"]["code"], stand.upstream.seen) == (408, "request_timeout", [])
    assert 0.3 - EARLY <= answered - released <= 0.3 + SLACK


async def test_held_large_bodies_are_forwarded_whole(make_stand: StandFactory) -> None:
    stand = await make_stand()
    await stand.set_mode("swapping")
    bodies = [bytes([n]) * (1024 * 1024) for n in range(3)]

    async def post(body: bytes) -> tuple[int, Any]:
        async with stand.client.post(stand.url + "/v1/size", data=body) as resp:
            return resp.status, await resp.json()

    tasks = [asyncio.ensure_future(post(body)) for body in bodies]
    try:
        await wait_for(lambda: len(stand.proxy.queue) == 3, "three requests held")
        state = await stand.state()
        assert 0 < state["held_body_bytes"] <= 3 * HELD_BODY_WINDOW_BYTES
        await stand.set_mode("llm")
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert sorted(doc["sha256"] for _, doc in results) == sorted(
        hashlib.sha256(body).hexdigest() for body in bodies
    )
    assert [status for status, _ in results] == [200] * 3
    assert (await stand.state())["held_body_bytes"] == 0


async def test_held_requests_do_not_keep_their_bodies(make_stand: StandFactory) -> None:
    # 50 held requests, each declaring a 2 MiB body and sending as much of it as TCP takes:
    # the proxy buffers at most its read window per request, not 100 MiB
    count, size = 50, 2 * 1024 * 1024
    assert size // 5 >= HELD_BODY_WINDOW_BYTES  # 384 KiB: the bound means something here
    stand = await make_stand(hold_max_requests=count)
    await stand.set_mode("image")
    body = memoryview(b"x" * size)
    head = post_head("/v1/chat/completions", size)
    socks: list[socket.socket] = []
    sent = [0] * count
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port_of(stand)))
        sock.sendall(head)
        sock.setblocking(False)
        socks.append(sock)

    def pump() -> None:
        for n, sock in enumerate(socks):
            while sent[n] < size:
                try:
                    sent[n] += sock.send(body[sent[n] : sent[n] + 65536])
                except BlockingIOError:
                    break

    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + 5.0
        while len(stand.proxy.queue) < count and loop.time() < end:
            pump()
            await asyncio.sleep(0.01)
        for _ in range(20):  # let TCP settle: whatever the proxy reads, it reads now
            pump()
            await asyncio.sleep(0.01)
        state = await stand.state()
        assert state["held"] == count
        assert 0 < state["held_body_bytes"] <= count * HELD_BODY_WINDOW_BYTES
        async with stand.client.get(stand.url + "/metrics") as resp:
            m = Exposition(await resp.text())
        assert m("cardshare_proxy_held_body_bytes") == state["held_body_bytes"]
    finally:
        for sock in socks:
            sock.close()
