"""Several boxes behind one proxy (issue 33): the proxy as a process, each box a fake vLLM and a
fake arbiter on real loopback sockets (:mod:`tests.unit.proxy.conftest`).

Each arbiter can fail the four ways an edge fails: refused (stopped), garbage (not JSON, or
JSON without a mode), hang (answers nothing), error status (500). The proxy polls every 0.05 s,
so its poll timeout is 1 s (``max(1, min(5, 2 x 0.05))``): a box leaves the rotation within
about a second of its arbiter failing, and comes back at the first good answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import struct
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from cardshare.arbiter.rules import parse_proxy_state

from .conftest import FakeArbiter, FakeUpstream, free_port, wait_for

SRC = Path(__file__).resolve().parents[3] / "src"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
#: How long a box may take to leave or rejoin the rotation here: the poll timeout (1 s) and a
#: poll period, with room for a loaded machine (a safety limit, not a timing assertion).
ROTATION_LIMIT = 10.0
ARTIFACTS = Path(
    os.environ.get("CARDSHARE_ARTIFACTS", Path(__file__).parents[3] / ".cache/artifacts")
)


@dataclass
class FaultyArbiter(FakeArbiter):
    """A fake arbiter that can answer garbage, an error status, or hang."""

    fault: str | None = None
    released: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle_mode(self, request: web.Request) -> web.Response:
        if self.fault == "garbage":
            return web.Response(body=b"<html>oops", content_type="application/json")
        if self.fault == "no-mode":
            return web.json_response({"state": "fine"})
        if self.fault == "error":
            return web.json_response({"error": "boom"}, status=500)
        if self.fault == "hang":
            await self.released.wait()
        return await super().handle_mode(request)

    async def stop(self) -> None:
        self.released.set()
        await super().stop()


@dataclass
class FleetBox:
    name: str
    upstream: FakeUpstream
    arbiter: FaultyArbiter
    models: list[str]

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "upstream_url": self.upstream.url,
            "arbiter_url": self.arbiter.url,
            "models": self.models,
        }


@dataclass
class Fleet:
    url: str
    boxes: dict[str, FleetBox]
    client: aiohttp.ClientSession
    process: asyncio.subprocess.Process
    log: Path

    async def post(self, model: str, **extra: Any) -> tuple[int, Any]:
        doc = {**CHAT, "model": model, **extra}
        async with self.client.post(self.url + "/v1/chat/completions", json=doc) as resp:
            return resp.status, await resp.json(content_type=None)

    async def state(self) -> dict[str, Any]:
        async with self.client.get(self.url + "/proxy/state") as resp:
            doc: dict[str, Any] = await resp.json()
            return doc

    async def box_state(self, name: str) -> dict[str, Any]:
        for b in (await self.state())["boxes"]:
            if b["name"] == name:
                return dict(b)
        raise AssertionError(f"no box {name} in /proxy/state")

    async def until(self, name: str, pred: Callable[[dict[str, Any]], bool], what: str) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + ROTATION_LIMIT
        while True:
            b = await self.box_state(name)
            if pred(b):
                return
            if loop.time() > end:
                raise AssertionError(f"box {name} never {what}: {b}")
            await asyncio.sleep(0.02)

    async def set_mode(self, name: str, mode: str) -> None:
        """Flip a box's arbiter and wait until the proxy has seen it."""
        self.boxes[name].arbiter.mode = mode
        await self.until(name, lambda b: b["mode"] == mode and b["error"] is None, f"in {mode}")

    def seen(self, name: str) -> int:
        return len(self.boxes[name].upstream.seen)


FleetFactory = Callable[..., Awaitable[Fleet]]


@pytest.fixture
async def make_fleet(tmp_path: Path) -> AsyncIterator[FleetFactory]:
    fleets: list[Fleet] = []
    started: list[FleetBox] = []

    async def factory(
        models: dict[str, list[str]] | None = None,
        box_settings: dict[str, dict[str, Any]] | None = None,
        **settings: Any,
    ) -> Fleet:
        models = models or {"a": ["m"], "b": ["m"]}
        boxes = {}
        for name, served in models.items():
            b = FleetBox(name, FakeUpstream(), FaultyArbiter(), served)
            await b.upstream.start()
            await b.arbiter.start()
            started.append(b)
            boxes[name] = b
        port = free_port()
        config = {
            "listen_port": port,
            "mode_poll_seconds": 0.05,
            "hold_max_seconds": 30.0,
            "boxes": [
                {**b.config(), **(box_settings or {}).get(b.name, {})} for b in boxes.values()
            ],
            **settings,
        }
        path = tmp_path / "proxy.json"
        path.write_text(json.dumps(config))
        log = tmp_path / "proxy.log"
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "cardshare.proxy",
            "--config",
            str(path),
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.getenv("PYTHONPATH")])),
            },
            stderr=log.open("wb"),
        )
        fleet = Fleet(f"http://127.0.0.1:{port}", boxes, aiohttp.ClientSession(), process, log)
        fleets.append(fleet)
        for _ in range(300):
            try:
                state = await fleet.state()
                if all(b["in_rotation"] for b in state["boxes"]):
                    return fleet
            except aiohttp.ClientError:
                pass
            if process.returncode is not None:
                raise AssertionError(f"the proxy exited: {log.read_text()}")
            await asyncio.sleep(0.05)
        raise AssertionError(f"the fleet never came up: {log.read_text()}")

    yield factory
    for fleet in fleets:
        if fleet.process.returncode is None:
            fleet.process.terminate()
            await fleet.process.wait()
        await fleet.client.close()
    for b in started:
        await b.upstream.stop()
        await b.arbiter.stop()


async def test_requests_spread_over_two_boxes(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet()
    # the proxy says which event loop it runs on (uvloop's where installed)
    assert "event loop: " in fleet.log.read_text()
    for _ in range(6):
        status, doc = await fleet.post("m")
        assert (status, doc["object"]) == (200, "chat.completion")
    # one client: each box idle in turn, ties go to the box sent fewer
    assert (fleet.seen("a"), fleet.seen("b")) == (3, 3)
    results = await asyncio.gather(*(fleet.post("m") for _ in range(20)))
    assert [r[0] for r in results] == [200] * 20
    assert fleet.seen("a") + fleet.seen("b") == 26
    assert min(fleet.seen("a"), fleet.seen("b")) >= 6


async def test_model_decides_the_box(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet({"a": ["m1"], "b": ["m2", "m3"]})
    for model in ("m1", "m2", "m3", "m1"):
        assert (await fleet.post(model))[0] == 200
    assert [s["body"]["model"] for s in fleet.boxes["a"].upstream.seen] == ["m1", "m1"]
    assert [s["body"]["model"] for s in fleet.boxes["b"].upstream.seen] == ["m2", "m3"]
    status, doc = await fleet.post("gpt-4")
    assert (status, doc["error"]["code"], doc["error"]["type"]) == (
        404,
        "model_not_found",
        "invalid_request_error",
    )
    assert doc["error"]["message"] == (
        "The model `gpt-4` does not exist on any box of this fleet; the boxes serve: m1, m2, m3"
    )


async def test_box_in_image_mode_is_skipped_without_a_hold(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet()
    await fleet.set_mode("a", "image")
    results = await asyncio.gather(*(fleet.post("m") for _ in range(5)))
    assert [r[0] for r in results] == [200] * 5
    assert (fleet.seen("a"), fleet.seen("b")) == (0, 5)
    state = await fleet.state()
    assert (state["mode"], state["held"]) == ("llm", 0)
    async with fleet.client.get(fleet.url + "/metrics") as resp:
        text = await resp.text()
    assert "cardshare_proxy_hold_seconds_count 0.0" in text


async def test_held_while_no_box_serves_and_released_to_the_first_back(
    make_fleet: FleetFactory,
) -> None:
    fleet = await make_fleet({"a": ["m1"], "b": ["m1", "m2"]})
    await fleet.set_mode("a", "image")
    await fleet.set_mode("b", "swapping")
    held = [asyncio.ensure_future(fleet.post(m)) for m in ("m1", "m2", "m1")]
    await wait_for_state(fleet, lambda s: s["held"] == 3, "three requests held")
    state = await fleet.state()
    assert (state["mode"], state["in_flight"]) == ("image", 0)
    # a comes back: it serves m1 only; the request for m2 is held again (its body read by
    # then, its model known)
    await fleet.set_mode("a", "llm")
    await wait_for(lambda: fleet.seen("a") == 2, "the m1 requests answered by a")
    await wait_for_state(fleet, lambda s: s["held"] == 1, "the m2 request held again")
    assert (fleet.seen("a"), fleet.seen("b")) == (2, 0)
    assert (await fleet.state())["held_body_bytes"] == len(json.dumps({**CHAT, "model": "m2"}))
    await fleet.set_mode("b", "llm")
    results = await asyncio.gather(*held)
    assert [r[0] for r in results] == [200, 200, 200]
    assert [s["body"]["model"] for s in fleet.boxes["b"].upstream.seen] == ["m2"]
    assert (await fleet.state())["held"] == 0


async def wait_for_state(
    fleet: Fleet, pred: Callable[[dict[str, Any]], bool], what: str, limit: float = 10.0
) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not pred(await fleet.state()):
        if loop.time() > end:
            raise AssertionError(f"never happened: {what}: {await fleet.state()}")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("fault", ["refused", "garbage", "no-mode", "hang", "error"])
async def test_failing_arbiter_takes_its_box_out_and_back(
    make_fleet: FleetFactory, fault: str
) -> None:
    fleet = await make_fleet()
    arbiter = fleet.boxes["a"].arbiter
    if fault == "refused":
        await arbiter.stop()
    else:
        arbiter.fault = fault
    await fleet.until("a", lambda b: not b["in_rotation"], "out of rotation")
    a = await fleet.box_state("a")
    assert a["error"].startswith("arbiter: ")
    assert a["mode"] == "llm"  # what it last said; not trusted for a fleet
    expected = {
        "refused": ("ClientConnectorError", "ServerDisconnectedError"),
        "garbage": ("ModePayloadError: not JSON",),
        "no-mode": ("ModePayloadError: mode must be one of",),
        "hang": ("TimeoutError", "ServerTimeoutError", "ConnectionTimeoutError"),
        "error": ("ModePayloadError: HTTP 500",),
    }[fault]
    assert a["error"].removeprefix("arbiter: ").startswith(expected), a["error"]
    state = await fleet.state()
    assert state["arbiter_error"].startswith("a: ")
    before = fleet.seen("a")
    results = await asyncio.gather(*(fleet.post("m") for _ in range(6)))
    assert [r[0] for r in results] == [200] * 6
    assert (fleet.seen("a"), state["held"]) == (before, 0)
    # it answers well again: back in rotation
    if fault == "refused":
        await arbiter.start()
    else:
        arbiter.fault = None
        arbiter.released.set()
    await fleet.until("a", lambda b: b["in_rotation"] and b["error"] is None, "back in rotation")
    results = await asyncio.gather(*(fleet.post("m") for _ in range(6)))
    assert fleet.seen("a") > before


async def test_refused_vllm_retried_on_the_other_box(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet()
    await fleet.boxes["a"].upstream.stop()  # its arbiter still says llm
    results = await asyncio.gather(*(fleet.post("m") for _ in range(8)))
    assert [r[0] for r in results] == [200] * 8
    assert (fleet.seen("a"), fleet.seen("b")) == (0, 8)
    async with fleet.client.get(fleet.url + "/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    failovers = families["cardshare_proxy_box_failovers"].samples[0].value
    assert failovers >= 1
    outcomes = {s.labels["outcome"]: s.value for s in families["cardshare_proxy_requests"].samples}
    assert (outcomes["forwarded"], outcomes["upstream_error"]) == (8, 0)
    # back in rotation at its arbiter's next answer; a refused connection moves again
    await fleet.until("a", lambda b: b["in_rotation"], "back in rotation")


async def _resetting_server(port: int) -> asyncio.Server:
    """A vLLM that dies under the request: it reads the request head, then resets the
    connection (SO_LINGER 0) before any answer."""

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    return await asyncio.start_server(reset, "127.0.0.1", port)


async def test_a_reset_before_any_answer_moves_to_the_other_box(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet()
    a = fleet.boxes["a"].upstream
    await a.stop()  # its arbiter still says llm; its port now resets what it reads
    server = await _resetting_server(a.port)
    try:
        results = await asyncio.gather(*(fleet.post("m") for _ in range(8)))
    finally:
        server.close()
        await server.wait_closed()
    assert [r[0] for r in results] == [200] * 8, results
    assert fleet.seen("b") == 8
    async with fleet.client.get(fleet.url + "/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    assert families["cardshare_proxy_box_failovers"].samples[0].value >= 1


async def test_stream_stays_on_its_box_when_the_box_swaps(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet({"a": ["m"]})
    async with fleet.client.post(
        fleet.url + "/v1/chat/completions",
        json={**CHAT, "model": "m", "stream": True, "gated": True},
    ) as resp:
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        fleet.boxes["a"].arbiter.mode = "swapping"
        await fleet.until("a", lambda b: not b["in_rotation"], "out of rotation")
        assert (await fleet.box_state("a"))["in_flight"] == 1
        # a new request is held meanwhile, the stream goes on
        later = asyncio.ensure_future(fleet.post("m"))
        await wait_for_state(fleet, lambda s: s["held"] == 1, "the new request held")
        fleet.boxes["a"].upstream.gate.set()
        rest = await resp.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    await fleet.set_mode("a", "llm")
    assert (await later)[0] == 200


async def test_state_and_metrics_per_box(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet({"a": ["m1"], "b": ["m2"]})
    await fleet.post("m1")
    await fleet.set_mode("b", "image")
    state = await fleet.state()
    assert {k: state[k] for k in ("mode", "mode_source", "held", "in_flight")} == {
        "mode": "llm",
        "mode_source": "arbiter",
        "held": 0,
        "in_flight": 0,
    }
    a, b = state["boxes"]
    assert {k: a[k] for k in ("name", "mode", "in_rotation", "in_flight", "error", "routed")} == {
        "name": "a",
        "mode": "llm",
        "in_rotation": True,
        "in_flight": 0,
        "error": None,
        "routed": 1,
    }
    assert (b["mode"], b["in_rotation"], b["mode_source"]) == ("image", False, "arbiter")
    assert a["last_seen"] > 1.7e9
    async with fleet.client.get(fleet.url + "/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}

    def per_box(name: str) -> dict[tuple[str, ...], float]:
        return {
            tuple(v for k, v in sorted(s.labels.items())): s.value
            for s in families[name].samples
            if not s.name.endswith("_created")
        }

    assert per_box("cardshare_proxy_box_requests") == {("a",): 1.0, ("b",): 0.0}
    assert per_box("cardshare_proxy_box_in_flight") == {("a",): 0.0, ("b",): 0.0}
    assert per_box("cardshare_proxy_box_in_rotation") == {("a",): 1.0, ("b",): 0.0}
    assert per_box("cardshare_proxy_box_mode") == {
        ("a", "llm"): 1.0,
        ("a", "swapping"): 0.0,
        ("a", "image"): 0.0,
        ("b", "llm"): 0.0,
        ("b", "swapping"): 0.0,
        ("b", "image"): 1.0,
    }
    # the one mode of the fleet
    assert per_box("cardshare_proxy_mode")[("llm",)] == 1.0


async def test_each_boxs_arbiter_reads_its_own_requests(make_fleet: FleetFactory) -> None:
    """A box's arbiter judges its own box idle: a stream in flight on box a keeps a busy and
    leaves b free to lend its card (the fleet's totals would hold both); held requests count
    fleet-wide, as a held request waits for any box."""
    fleet = await make_fleet({"a": ["m1"], "b": ["m2"]})
    async with fleet.client.post(
        fleet.url + "/v1/chat/completions",
        json={**CHAT, "model": "m1", "stream": True, "gated": True},
    ) as resp:
        assert (await resp.content.readline()).startswith(b"data: ")
        state = await fleet.state()
        a, b, total = (parse_proxy_state(state, n) for n in ("a", "b", ""))
        assert (total.in_flight, a.in_flight, b.in_flight) == (1, 1, 0)
        assert total.last_request_started is not None
        assert a.last_request_started == state["boxes"][0]["last_request_started"]
        assert a.last_request_started is not None and a.last_request_finished is None
        assert (b.last_request_started, b.last_request_finished) == (None, None)
        fleet.boxes["a"].upstream.gate.set()
        await resp.read()
    await fleet.until("a", lambda s: s["in_flight"] == 0, "idle")
    a = parse_proxy_state(await fleet.state(), "a")
    assert a.last_request_finished is not None and a.last_request_started is not None
    assert a.last_request_finished >= a.last_request_started
    with pytest.raises(ValueError, match=r"the proxy lists no box 'c' \(its boxes: a, b\)"):
        parse_proxy_state(state, "c")
    # a proxy of one box has no boxes: a named box reads the totals
    single = {k: v for k, v in state.items() if k != "boxes"}
    assert parse_proxy_state(single, "a").in_flight == 1


async def test_openai_client_through_two_boxes(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet()
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "hi"}
    ]
    try:
        for _ in range(2):
            reply = await client.chat.completions.create(model="m", messages=messages)
            assert reply.choices[0].message.content == "hello there"
            stream = await client.chat.completions.create(model="m", messages=messages, stream=True)
            parts = [c.choices[0].delta.content async for c in stream]
            assert parts == ["hello", " there", None]
        assert (fleet.seen("a"), fleet.seen("b")) == (2, 2)
        await fleet.set_mode("a", "image")
        await fleet.set_mode("b", "image")
        task = asyncio.ensure_future(client.chat.completions.create(model="m", messages=messages))
        await wait_for_state(fleet, lambda s: s["held"] == 1, "request held")
        await fleet.set_mode("b", "llm")
        assert (await task).choices[0].message.content == "hello there"
        assert fleet.seen("b") == 3
    finally:
        await client.close()


async def test_fleet_view_says_which_box_serves(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet({"a": ["m1"], "b<x>": ["m2"]})
    await fleet.set_mode("b<x>", "image")
    held = asyncio.ensure_future(fleet.post("m2"))
    await wait_for_state(fleet, lambda s: s["held"] == 1, "request held")
    async with fleet.client.get(fleet.url + "/proxy/fleet") as resp:
        assert resp.content_type == "text/html"
        page = await resp.text()
    assert "Serving: a. 1 held" in page
    assert "<h2>b&lt;x&gt;</h2>" in page and "b<x>" not in page
    assert '<span class="mode mode-image">image</span>' in page
    # nothing from outside: no script, no stylesheet or image by URL
    assert "<script" not in page and "src=" not in page and 'href="http' not in page
    await fleet.set_mode("b<x>", "llm")
    assert (await held)[0] == 200


async def test_fleet_view_at_390_px(make_fleet: FleetFactory) -> None:
    playwright_api = pytest.importorskip("playwright.async_api")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.skip("Chromium is missing: tools/deps.sh installs Debian's chromium")
    fleet = await make_fleet({"gpu-box-one": ["qwen3-8b"], "gpu-box-two": ["qwen3-8b"]})
    await fleet.set_mode("gpu-box-two", "image")
    async with playwright_api.async_playwright() as pw:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        browser = await pw.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            context = await browser.new_context(
                viewport={"width": 390, "height": 844}, is_mobile=True
            )
            page = await context.new_page()
            response = await page.goto(fleet.url + "/proxy/fleet")
            assert response is not None and response.status == 200
            seen = await page.evaluate(
                """() => ({
                  scrollWidth: document.documentElement.scrollWidth,
                  innerWidth: window.innerWidth,
                  innerHeight: window.innerHeight,
                  boxes: [...document.querySelectorAll('ul.boxes > li')].map(li => {
                    const r = li.getBoundingClientRect();
                    return {left: r.left, right: r.right, bottom: r.bottom,
                            text: li.innerText};
                  }),
                  summary: document.querySelector('p.summary').innerText,
                })"""
            )
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "proxy-fleet-phone.png"), full_page=True)
        finally:
            await browser.close()
    assert seen["scrollWidth"] <= seen["innerWidth"], seen
    assert seen["summary"].startswith("Serving: gpu-box-one. Nothing held.")
    assert len(seen["boxes"]) == 2
    for box in seen["boxes"]:
        assert box["left"] >= 0 and box["right"] <= seen["innerWidth"], box
    # both boxes, their modes, on a phone's first screen
    assert seen["boxes"][1]["bottom"] <= seen["innerHeight"], seen
    assert "image" in seen["boxes"][1]["text"] and "llm" in seen["boxes"][0]["text"]


async def test_models_of_the_fleet_merged(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet({"a": ["m1"], "b": ["m2", "m1"]})
    fleet.boxes["a"].upstream.models = ["m1"]
    fleet.boxes["b"].upstream.models = ["m2", "m1"]

    async def listed() -> list[str]:
        async with fleet.client.get(fleet.url + "/v1/models") as resp:
            assert resp.status == 200
            doc = await resp.json()
        assert doc["object"] == "list"
        assert all(e["object"] == "model" for e in doc["data"])
        return [e["id"] for e in doc["data"]]

    assert await listed() == ["m1", "m2"]
    # a box out of rotation: its models are not offered; one box left answers alone
    await fleet.set_mode("b", "image")
    assert await listed() == ["m1"]
    # none in rotation: held until one comes back, as any request
    await fleet.set_mode("a", "swapping")
    task = asyncio.ensure_future(listed())
    await wait_for_state(fleet, lambda s: s["held"] == 1, "the list held")
    await fleet.set_mode("b", "llm")
    assert await task == ["m2", "m1"]


async def test_no_retry_once_the_answer_has_started(make_fleet: FleetFactory) -> None:
    # a box breaks off a stream after its first chunk: the client's connection is cut (the
    # only honest signal left), and the request is not sent to the other box
    fleet = await make_fleet()
    url = fleet.url + "/v1/broken"
    for _ in range(2):  # idle boxes take turns: one request on each
        with pytest.raises(aiohttp.ClientPayloadError):
            async with fleet.client.post(url, json={**CHAT, "model": "m"}) as resp:
                assert resp.status == 200
                await resp.read()
    a, b = (await fleet.state())["boxes"]
    assert (a["routed"], b["routed"]) == (1, 1)
    async with fleet.client.get(fleet.url + "/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    assert families["cardshare_proxy_box_failovers"].samples[0].value == 0


async def test_a_request_held_twice_counts_its_time_once(make_fleet: FleetFactory) -> None:
    fleet = await make_fleet({"a": ["m1"], "b": ["m2"]})
    await fleet.set_mode("a", "image")
    await fleet.set_mode("b", "image")
    loop = asyncio.get_running_loop()
    sent = loop.time()
    task = asyncio.ensure_future(fleet.post("m2"))
    await wait_for_state(fleet, lambda s: s["held"] == 1, "held on its head")
    await asyncio.sleep(0.5)
    # a comes back: the request is released, its body read, and held again for m2
    await fleet.set_mode("a", "llm")
    await asyncio.sleep(0.5)
    await fleet.set_mode("b", "llm")
    assert (await task)[0] == 200
    elapsed = loop.time() - sent
    async with fleet.client.get(fleet.url + "/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    hold = {s.name: s.value for s in families["cardshare_proxy_hold_seconds"].samples}
    # two holds, whose times add up to at most the request's whole wait
    assert hold["cardshare_proxy_hold_seconds_count"] == 2
    assert 1.0 <= hold["cardshare_proxy_hold_seconds_sum"] <= elapsed


async def test_each_box_gets_its_own_key(make_fleet: FleetFactory, tmp_path: Path) -> None:
    shared, own = tmp_path / "vllm-key", tmp_path / "vllm-key-b"
    shared.write_text("shared-upstream-key\n")
    own.write_text("b-upstream-key\n")
    fleet = await make_fleet(
        upstream_api_key_file=str(shared), box_settings={"b": {"api_key_file": str(own)}}
    )
    sent: dict[str, str] = {}
    for _ in range(2):  # idle boxes take turns: one request on each
        async with fleet.client.post(
            fleet.url + "/v1/echo",
            json={"model": "m"},
            headers={"Authorization": "Bearer agent-key"},
        ) as resp:
            doc = await resp.json()
        headers = {k.lower(): v for k, v in doc["headers"]}
        host_port = int(headers["host"].rsplit(":", 1)[1])
        name = next(n for n, b in fleet.boxes.items() if b.upstream.port == host_port)
        sent[name] = headers["authorization"]
    assert sent == {"a": "Bearer shared-upstream-key", "b": "Bearer b-upstream-key"}
