"""The proxy over real sockets, in front of a fake upstream and a fake arbiter."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as text_string_to_openmetrics,
)
from promtext import Exposition

from cardshare.proxy.rules import count_message, stopping_message, time_message

from .conftest import StandFactory, wait_for

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def post_json(stand: Any, path: str, doc: dict[str, Any]) -> tuple[int, Any, Any]:
    async with stand.client.post(stand.url + path, json=doc) as resp:
        return resp.status, resp.headers, await resp.json(content_type=None)


async def test_forwards_in_llm_mode(make_stand: StandFactory) -> None:
    stand = await make_stand()
    status, _, doc = await post_json(stand, "/v1/chat/completions", CHAT)
    assert (status, doc["choices"][0]["message"]["content"]) == (200, "hello there")
    state = await stand.state()
    assert (state["in_flight"], state["held"], state["mode"], state["mode_source"]) == (
        0,
        0,
        "llm",
        "arbiter",
    )
    assert state["last_request_started"] <= state["last_request_finished"]


async def test_passes_method_path_query_headers_body_untouched(make_stand: StandFactory) -> None:
    stand = await make_stand()
    headers = {
        "Authorization": "Bearer k",
        "X-Agent": "a1",
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "1",
    }
    async with stand.client.put(
        stand.url + "/v1/echo?a=1&b=%20x", data=b"raw body", headers=headers
    ) as resp:
        doc = await resp.json()
        assert (resp.status, resp.headers["X-Upstream"], resp.headers["Set-Cookie"]) == (
            200,
            "yes",
            "a=1",
        )
        assert [len(resp.headers.getall(h)) for h in ("Content-Type", "Content-Length")] == [1, 1]
    sent = {k.lower(): v for k, v in doc["headers"]}
    assert (doc["method"], doc["path_qs"], doc["body"]) == (
        "PUT",
        "/v1/echo?a=1&b=%20x",
        "raw body",
    )
    assert (sent["authorization"], sent["x-agent"], sent["content-length"]) == (
        "Bearer k",
        "a1",
        "8",
    )
    assert "x-hop" not in sent
    assert sent["host"] == f"127.0.0.1:{stand.upstream.port}"


async def test_held_during_image_answered_back_in_llm(make_stand: StandFactory) -> None:
    stand = await make_stand()
    await stand.set_mode("image")
    task = asyncio.ensure_future(post_json(stand, "/v1/chat/completions", CHAT))
    await wait_for(lambda: len(stand.proxy.queue) == 1, "request held")
    state = await stand.state()
    assert (state["held"], state["in_flight"], state["mode"]) == (1, 0, "image")
    assert state["oldest_held_seconds"] >= 0
    assert stand.upstream.seen == []
    await stand.set_mode("llm")
    status, _, doc = await task
    assert (status, doc["object"], len(stand.proxy.queue)) == (200, "chat.completion", 0)
    assert stand.proxy.counters.outcomes["forwarded"] == 1
    assert stand.proxy.counters.hold_seconds.count == 1


def held_count(stand: Any, n: int) -> Callable[[], bool]:
    return lambda: len(stand.proxy.queue) == n


async def test_all_held_requests_are_forwarded_on_release(make_stand: StandFactory) -> None:
    # release is oldest first (test_proxy_state); once released the requests travel on
    # concurrent upstream connections, so the upstream may see them in any order
    stand = await make_stand()
    await stand.set_mode("swapping")
    tasks = []
    for n in range(5):
        tasks.append(
            asyncio.ensure_future(post_json(stand, "/v1/chat/completions", {**CHAT, "n": n}))
        )
        await wait_for(held_count(stand, n + 1), f"request {n} held")
    await stand.set_mode("llm")
    results = await asyncio.gather(*tasks)
    assert [r[0] for r in results] == [200] * 5
    assert sorted(s["body"]["n"] for s in stand.upstream.seen) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("mode", ["image", "swapping"])
async def test_count_bound_answers_503_with_retry_after(
    make_stand: StandFactory, mode: str
) -> None:
    stand = await make_stand(hold_max_requests=2, retry_after_seconds=17)
    await stand.set_mode(mode)
    held = [asyncio.ensure_future(post_json(stand, "/v1/chat/completions", CHAT)) for _ in range(2)]
    await wait_for(lambda: len(stand.proxy.queue) == 2, "two requests held")
    status, headers, doc = await post_json(stand, "/v1/chat/completions", CHAT)
    assert (status, headers["Retry-After"]) == (503, "17")
    assert doc == {
        "error": {
            "message": count_message(mode, 2, 17),
            "type": "service_unavailable",
            "param": None,
            "code": "hold_queue_full",
        }
    }
    await stand.set_mode("llm")
    assert [r[0] for r in await asyncio.gather(*held)] == [200, 200]
    assert stand.proxy.counters.outcomes["rejected_count"] == 1


async def test_time_bound_answers_503(make_stand: StandFactory) -> None:
    stand = await make_stand(hold_max_seconds=0.2, retry_after_seconds=5)
    await stand.set_mode("image")
    status, headers, doc = await post_json(stand, "/v1/chat/completions", CHAT)
    assert (status, headers["Retry-After"], doc["error"]["code"]) == (503, "5", "hold_timeout")
    assert doc["error"]["message"] == time_message("image", 0.2, 5)
    assert doc["error"]["message"] == (
        "the card is lent to image jobs; waited 0.2 s (hold_max_seconds); retry after 5 s"
    )
    assert (len(stand.proxy.queue), stand.proxy.counters.outcomes["rejected_time"]) == (0, 1)


@pytest.mark.parametrize("trust", [True, False])
async def test_arbiter_down(make_stand: StandFactory, trust: bool) -> None:
    stand = await make_stand(trust_mode_when_arbiter_down=trust, hold_max_seconds=0.3)
    await stand.set_mode("image")
    await stand.arbiter.stop()
    await stand.poll()
    state = await stand.state()
    expected = ("image", "last-known") if trust else ("llm", "default")
    assert (state["mode"], state["mode_source"]) == expected
    # refused, or a pooled keep-alive connection closed by the stopped arbiter
    assert state["arbiter_error"].startswith(("ClientConnectorError", "ServerDisconnectedError"))
    status, _, _ = await post_json(stand, "/v1/chat/completions", CHAT)
    assert status == (503 if trust else 200)


async def test_arbiter_never_seen_means_default_llm(make_stand: StandFactory) -> None:
    stand = await make_stand()
    await stand.arbiter.stop()
    stand.proxy.view = type(stand.proxy.view)()  # as if the proxy had just started
    await stand.poll()
    state = await stand.state()
    assert (state["mode"], state["mode_source"]) == ("llm", "default")
    async with stand.client.get(stand.url + "/metrics") as resp:
        m = Exposition(await resp.text())
    assert m("cardshare_proxy_mode_source", source="default") == 1


async def test_mode_read_from_status_when_no_mode_endpoint(make_stand: StandFactory) -> None:
    stand = await make_stand(status_only=True)
    await stand.set_mode("image")
    assert stand.proxy.view.source == "arbiter"


async def test_streaming_chunk_arrives_before_upstream_finishes(
    make_stand: StandFactory,
) -> None:
    stand = await make_stand()
    async with stand.client.post(
        stand.url + "/v1/chat/completions", json={**CHAT, "stream": True, "gated": True}
    ) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        first = await resp.content.readline()
        # the upstream is still waiting on the gate: the rest has not been produced
        assert not stand.upstream.gate.is_set()
        assert json.loads(first.removeprefix(b"data: "))["choices"][0]["delta"] == {
            "content": "hello"
        }
        stand.upstream.gate.set()
        rest = await resp.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    assert rest.count(b"data: ") == 3


async def test_refused_connections_retried_until_upstream_starts(
    make_stand: StandFactory,
) -> None:
    stand = await make_stand(start_upstream=False, connect_retry_seconds=30)
    task = asyncio.ensure_future(post_json(stand, "/v1/chat/completions", CHAT))
    await wait_for(lambda: stand.proxy.counters.connect_retries >= 2, "connection retried")
    state = await stand.state()
    assert (state["in_flight"], state["connecting"]) == (1, 1)
    await stand.upstream.start()
    status, _, doc = await task
    assert (status, doc["object"]) == (200, "chat.completion")


@pytest.mark.parametrize(
    ("settings", "bound"),
    [
        ({"connect_retry_seconds": 0.2}, "connect_retry_seconds"),
        ({"connect_retry_seconds": 60, "hold_max_seconds": 0.2}, "hold_max_seconds"),
    ],
)
async def test_upstream_down_past_bound_is_503_never_502(
    make_stand: StandFactory, settings: dict[str, Any], bound: str
) -> None:
    stand = await make_stand(start_upstream=False, retry_after_seconds=9, **settings)
    status, headers, doc = await post_json(stand, "/v1/chat/completions", CHAT)
    assert (status, headers["Retry-After"], doc["error"]["code"]) == (
        503,
        "9",
        "upstream_unavailable",
    )
    assert doc["error"]["message"].startswith(
        "the LLM server is not accepting connections (starting?) after "
    )
    assert doc["error"]["message"].endswith("; retry after 9 s")
    assert stand.proxy.counters.outcomes["upstream_error"] == 1
    assert stand.proxy.in_flight == 0


async def test_upstream_503_passes_through(make_stand: StandFactory) -> None:
    stand = await make_stand()
    status, headers, doc = await post_json(stand, "/v1/dead", CHAT)
    assert (status, doc, "Retry-After" in headers) == (503, {"error": "engine dead"}, False)


async def test_upstream_breaking_mid_stream_ends_the_stream(make_stand: StandFactory) -> None:
    stand = await make_stand()
    async with stand.client.post(stand.url + "/v1/broken", json=CHAT) as resp:
        assert resp.status == 200
        first = await resp.content.readline()
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    assert first.startswith(b"data: ")
    assert stand.proxy.in_flight == 0


async def test_upstream_breaking_a_short_answer_is_503(make_stand: StandFactory) -> None:
    stand = await make_stand(retry_after_seconds=3)
    status, headers, doc = await post_json(stand, "/v1/short", CHAT)
    assert (status, headers["Retry-After"], doc["error"]["code"]) == (503, "3", "upstream_broken")
    assert doc["error"]["message"].startswith("the LLM server broke off its answer: ")
    outcomes = stand.proxy.counters.outcomes
    assert (outcomes["upstream_error"], outcomes["forwarded"]) == (1, 0)


async def test_client_gone_mid_stream_closes_upstream(make_stand: StandFactory) -> None:
    stand = await make_stand()
    async with stand.client.post(stand.url + "/v1/endless", json=CHAT) as resp:
        await resp.content.readline()
    await wait_for(stand.upstream.gone.is_set, "upstream saw the disconnect")
    await wait_for(lambda: stand.proxy.in_flight == 0, "nothing in flight")


async def test_client_gone_while_held_leaves_the_queue(make_stand: StandFactory) -> None:
    stand = await make_stand()
    await stand.set_mode("image")
    task = asyncio.ensure_future(post_json(stand, "/v1/chat/completions", CHAT))
    await wait_for(lambda: len(stand.proxy.queue) == 1, "request held")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: len(stand.proxy.queue) == 0, "held request dropped")
    assert stand.proxy.counters.outcomes["client_gone"] == 1
    await stand.set_mode("llm")
    assert stand.upstream.seen == []


async def test_body_too_large_is_413(make_stand: StandFactory) -> None:
    stand = await make_stand(max_body_bytes=16)
    status, headers, doc = await post_json(stand, "/v1/chat/completions", CHAT)
    assert (status, "Retry-After" in headers) == (413, False)
    assert doc["error"] == {
        "message": "request body exceeds 16 bytes (max_body_bytes)",
        "type": "invalid_request_error",
        "param": None,
        "code": "too_large",
    }


async def test_paths_not_proxied_are_404(make_stand: StandFactory) -> None:
    stand = await make_stand()
    async with stand.client.get(stand.url + "/health") as resp:
        doc = await resp.json()
    assert (resp.status, doc["error"]["message"]) == (404, "/health is not proxied (only /v1/)")


async def test_health_and_metrics(make_stand: StandFactory) -> None:
    stand = await make_stand()
    await post_json(stand, "/v1/chat/completions", CHAT)
    async with stand.client.get(stand.url + "/proxy/health") as resp:
        assert (resp.status, await resp.json()) == (200, {"status": "ok"})
    async with stand.client.get(stand.url + "/metrics") as resp:
        assert resp.content_type == "text/plain"
        m = Exposition(await resp.text())
    assert m("cardshare_proxy_requests_total", outcome="forwarded") == 1
    assert m("cardshare_proxy_requests_total", outcome="rejected_count") == 0
    assert m("cardshare_proxy_held") == 0
    assert m("cardshare_proxy_in_flight") == 0
    assert m("cardshare_proxy_mode", mode="llm") == 1
    assert m("cardshare_proxy_mode", mode="image") == 0
    assert m("cardshare_proxy_hold_seconds_count") == 0
    # a scraper that asks for OpenMetrics gets it, from the same registry
    headers = {"Accept": "application/openmetrics-text; version=1.0.0"}
    async with stand.client.get(stand.url + "/metrics", headers=headers) as resp:
        assert resp.content_type == "application/openmetrics-text"
        families = {f.name: f for f in text_string_to_openmetrics(await resp.text())}
    assert families["cardshare_proxy_requests"].type == "counter"


async def test_stopping_answers_held_requests_at_once(make_stand: StandFactory) -> None:
    stand = await make_stand(retry_after_seconds=4)
    await stand.set_mode("image")
    task = asyncio.ensure_future(post_json(stand, "/v1/chat/completions", CHAT))
    await wait_for(lambda: len(stand.proxy.queue) == 1, "request held")
    await stand.runner.cleanup()
    status, headers, doc = await task
    assert (status, headers["Retry-After"], doc["error"]["code"]) == (503, "4", "proxy_stopping")
    assert doc["error"]["message"] == stopping_message(4)
    assert stand.proxy.counters.outcomes["rejected_stopping"] == 1


async def test_upstream_cookies_are_not_kept_between_agents(make_stand: StandFactory) -> None:
    # the upstream sets a cookie on its answer; the proxy passes it to that client and keeps
    # none: a second agent's request reaches the upstream without it (by a host name: a
    # cookie jar keeps no cookie of a bare IP address)
    stand = await make_stand()
    stand.proxy.boxes[0].box = replace(
        stand.proxy.boxes[0].box, upstream_url=f"http://localhost:{stand.upstream.port}"
    )
    async with aiohttp.ClientSession() as first, aiohttp.ClientSession() as second:
        async with first.get(stand.url + "/v1/echo") as resp:
            assert resp.headers["Set-Cookie"] == "a=1"
        async with second.get(stand.url + "/v1/echo") as resp:
            doc = await resp.json()
    sent = {k.lower() for k, _ in doc["headers"]}
    assert "cookie" not in sent, doc["headers"]
