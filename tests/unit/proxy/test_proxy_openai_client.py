"""The OpenAI Python client (``openai`` on PyPI) talks to vLLM through the proxy."""

from __future__ import annotations

import asyncio

import openai
import pytest

from cardshare.proxy.rules import count_message

from .conftest import StandFactory, wait_for

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="not-checked", max_retries=0)


async def test_completion_and_stream(make_stand: StandFactory) -> None:
    stand = await make_stand()
    client = client_for(stand.url)
    try:
        reply = await client.chat.completions.create(model="fake-model", messages=MESSAGES)
        assert reply.choices[0].message.content == "hello there"
        stream = await client.chat.completions.create(
            model="fake-model", messages=MESSAGES, stream=True
        )
        parts = [c.choices[0].delta.content async for c in stream if c.choices[0].delta.content]
        assert parts == ["hello", " there"]
    finally:
        await client.close()


async def test_held_request_answered_after_image_mode(make_stand: StandFactory) -> None:
    stand = await make_stand()
    await stand.set_mode("image")
    client = client_for(stand.url)
    try:
        task = asyncio.ensure_future(
            client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
        )
        await wait_for(lambda: len(stand.proxy.queue) == 1, "request held")
        await stand.set_mode("llm")
        parts = [c.choices[0].delta.content async for c in await task]
        assert parts == ["hello", " there", None]
    finally:
        await client.close()


async def test_count_bound_is_a_503_the_client_understands(make_stand: StandFactory) -> None:
    stand = await make_stand(hold_max_requests=0, retry_after_seconds=7)
    await stand.set_mode("image")
    client = client_for(stand.url)
    try:
        with pytest.raises(openai.InternalServerError) as err:
            await client.chat.completions.create(model="fake-model", messages=MESSAGES)
    finally:
        await client.close()
    assert (err.value.status_code, err.value.response.headers["retry-after"]) == (503, "7")
    assert err.value.body == {
        "message": count_message("image", 0, 7),
        "type": "service_unavailable",
        "param": None,
        "code": "hold_queue_full",
    }
