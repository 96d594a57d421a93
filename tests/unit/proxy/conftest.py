"""A fake vLLM upstream, a fake arbiter and the proxy, all on loopback in the test's loop.

The fake upstream speaks just enough of vLLM's OpenAI API (shapes from the OpenAI API
reference: ``chat.completion`` and ``chat.completion.chunk`` objects, SSE ``data:`` lines ending
with ``data: [DONE]``). Its streaming answer stops after the first chunk until the test opens
``gate``, so a test can see chunks arrive while the upstream still holds the rest.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from cardshare.proxy.config import ProxyConfig, build_config
from cardshare.proxy.rules import Backoff
from cardshare.proxy.server import Proxy, runner_kwargs


def free_port() -> int:
    """A loopback port nobody listens on (bound and released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def completion(text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "fake-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def chunk(text: str | None, finish: str | None = None) -> bytes:
    doc = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "fake-model",
        "choices": [
            {
                "index": 0,
                "delta": {"content": text} if text is not None else {},
                "finish_reason": finish,
            }
        ],
    }
    return f"data: {json.dumps(doc)}\n\n".encode()


@dataclass
class FakeUpstream:
    """A vLLM-like server that can be started late (refusing connections until then)."""

    port: int = field(default_factory=free_port)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    seen: list[dict[str, Any]] = field(default_factory=list)
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    #: What ``GET /v1/models`` lists (vLLM's shape: its --served-model-name).
    models: list[str] = field(default_factory=lambda: ["fake-model"])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def chat(self, request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        self.seen.append({"path": request.path_qs, "body": doc})
        if not doc.get("stream"):
            return web.json_response(completion("hello there"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("hello"))
        if doc.get("gated"):
            await self.gate.wait()
        await resp.write(chunk(" there"))
        await resp.write(chunk(None, "stop"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": m,
                        "object": "model",
                        "created": 1700000000,
                        "owned_by": "vllm",
                        "root": f"/models/{m}",
                        "parent": None,
                        "max_model_len": 8192,
                    }
                    for m in self.models
                ],
            }
        )

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response(
            {
                "method": request.method,
                "path_qs": request.raw_path,
                "headers": [[k, v] for k, v in request.headers.items()],
                "body": body.decode(),
            },
            headers={"X-Upstream": "yes", "Set-Cookie": "a=1"},
        )

    async def size(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append({"path": request.path_qs, "size": len(body)})
        return web.json_response({"size": len(body), "sha256": hashlib.sha256(body).hexdigest()})

    async def dead(self, request: web.Request) -> web.Response:
        return web.Response(
            status=503, body=b'{"error": "engine dead"}', content_type="application/json"
        )

    async def broken(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("partial"))
        assert request.transport is not None
        request.transport.close()
        return resp

    async def short(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 1000
        await resp.prepare(request)
        await resp.write(b'{"partial": ')
        assert request.transport is not None
        request.transport.close()
        return resp

    async def endless(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while True:
                await resp.write(chunk("more"))
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):
            self.gone.set()
            raise

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_route("*", "/v1/echo", self.echo)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/size", self.size)
        app.router.add_post("/v1/dead", self.dead)
        app.router.add_post("/v1/broken", self.broken)
        app.router.add_post("/v1/endless", self.endless)
        app.router.add_post("/v1/short", self.short)
        self.runner = web.AppRunner(app, **runner_kwargs())
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@dataclass
class FakeArbiter:
    """An arbiter that answers ``/v1/mode`` (or only ``/v1/status``) with a settable mode."""

    mode: str = "llm"
    status_only: bool = False
    port: int = field(default_factory=free_port)
    polls: int = 0
    polled: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle_mode(self, request: web.Request) -> web.Response:
        if self.status_only:
            raise web.HTTPNotFound()
        self.polls += 1
        self.polled.set()
        return web.json_response({"mode": self.mode, "since": 1700000000.0})

    async def handle_status(self, request: web.Request) -> web.Response:
        self.polls += 1
        self.polled.set()
        return web.json_response({"mode": self.mode, "since": 1700000000.0, "queue": []})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/mode", self.handle_mode)
        app.router.add_get("/v1/status", self.handle_status)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def read_response(
    reader: asyncio.StreamReader, limit: float
) -> tuple[int, dict[str, str], Any]:
    """One response with a Content-Length from a raw connection: status, headers, JSON."""

    async def read() -> tuple[bytes, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        return head, await reader.readexactly(length)

    try:
        raw_head, body = await asyncio.wait_for(read(), limit)
    except TimeoutError:
        raise AssertionError(f"no response within {limit} s") from None
    lines = raw_head.decode().rstrip("\r\n").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


async def wait_for(cond: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    """Wait until ``cond()`` holds (a safety limit only, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.01)


@dataclass
class Stand:
    """The proxy in front of a fake upstream, polling a fake arbiter."""

    upstream: FakeUpstream
    arbiter: FakeArbiter
    proxy: Proxy
    client: aiohttp.ClientSession
    url: str
    runner: web.AppRunner

    async def set_mode(self, mode: str) -> None:
        """Flip the arbiter's mode and wait until the proxy has seen it."""
        self.arbiter.mode = mode
        await self.poll()
        assert self.proxy.view.mode == mode

    async def poll(self) -> None:
        await self.proxy.poll_mode_once()

    async def state(self) -> dict[str, Any]:
        async with self.client.get(self.url + "/proxy/state") as resp:
            doc: dict[str, Any] = await resp.json()
            return doc


StandFactory = Callable[..., Awaitable[Stand]]


@pytest.fixture
async def make_stand() -> AsyncIterator[StandFactory]:
    """Build stands; ``start_upstream=False`` leaves the upstream port refusing connections."""
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def factory(start_upstream: bool = True, **settings: Any) -> Stand:
        upstream = FakeUpstream()
        arbiter = FakeArbiter(status_only=settings.pop("status_only", False))
        await arbiter.start()
        if start_upstream:
            await upstream.start()
        port = free_port()
        config: ProxyConfig = build_config(
            {
                "listen_port": port,
                "upstream_url": upstream.url,
                "arbiter_url": arbiter.url,
                # long poll period: the tests poll by hand (Stand.poll) for determinism
                "mode_poll_seconds": 3600.0,
                **settings,
            }
        )
        proxy = Proxy(
            config, backoff=Backoff(initial=0.01, cap=0.05), disconnect_check_seconds=0.02
        )
        runner = proxy.make_runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        client = aiohttp.ClientSession()
        # the proxy's first poll runs at start-up: let it land before tests flip the mode
        await wait_for(lambda: proxy.view.source != "default", "first mode poll")
        cleanups.extend([client.close, runner.cleanup, upstream.stop, arbiter.stop])
        return Stand(upstream, arbiter, proxy, client, f"http://127.0.0.1:{port}", runner)

    yield factory
    for cleanup in cleanups:
        await cleanup()
