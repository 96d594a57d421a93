"""API keys: the proxy as a real process (``python -m cardshare.proxy``) in front of the fake
upstream and arbiter of conftest, with a key file the tests make and replace with the CLI's
own functions (:mod:`cardshare.proxy.keytool`)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from cardshare import cli
from cardshare.proxy import keytool
from cardshare.proxy.config import ConfigError, build_config
from cardshare.proxy.keys import (
    KeyRing,
    KeysFileError,
    bearer_token,
    digest_of,
    is_loopback,
    key_line,
    lookup,
    parse_keys,
)
from cardshare.proxy.rules import UNAUTHORIZED_MESSAGE, key_limit_message

from .conftest import FakeArbiter, FakeUpstream, StandFactory, free_port, wait_for

SRC = Path(__file__).resolve().parents[3] / "src"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
UPSTREAM_KEY = "upstream-secret-of-the-proxy"
UNAUTHORIZED = {
    "message": UNAUTHORIZED_MESSAGE,
    "type": "invalid_request_error",
    "param": None,
    "code": "invalid_api_key",
}


# ------------------------------------------------------------------ the file and the check


def test_parse_keys_reads_names_digests_and_bounds() -> None:
    text = f"# agents\n\n{key_line('alice', 'k1')}\n{key_line('fleet-b', 'k2')} max_requests=3\n"
    keys = parse_keys(text, "keys")
    assert sorted((k.name, k.max_requests) for k in keys.values()) == [
        ("alice", None),
        ("fleet-b", 3),
    ]
    assert lookup(keys, "k1") is not None and lookup(keys, "k1").name == "alice"  # type: ignore[union-attr]
    assert lookup(keys, "k3") is None
    assert lookup(keys, None) is None
    assert "k1" not in text and digest_of("k1").hex() in text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("alice", "keys line 1: expected 'NAME sha256:HEX [max_requests=N]', got 1 fields"),
        ("alice sha256:abc", "keys line 1: expected sha256: and 64 lowercase hex digits"),
        (f"al/ice sha256:{'0' * 64}", "keys line 1: bad name 'al/ice' (letters, digits, '._@-')"),
        (f"alice sha256:{'0' * 64} max=3", "keys line 1: expected max_requests=N with N >= 1"),
        (
            f"alice sha256:{'0' * 64} max_requests=0",
            "keys line 1: expected max_requests=N with N >= 1",
        ),
        (
            f"alice sha256:{'0' * 64}\nalice sha256:{'1' * 64}",
            "keys line 2: name 'alice' listed twice",
        ),
        (
            f"alice sha256:{'0' * 64}\nbob sha256:{'0' * 64}",
            "keys line 2: the key of 'bob' is already 'alice''s",
        ),
    ],
)
def test_parse_keys_refuses_a_bad_line(text: str, message: str) -> None:
    with pytest.raises(KeysFileError) as err:
        parse_keys(text, "keys")
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer  abc ", "abc"),
        (None, None),
        ("Basic abc", None),
        ("Bearer", None),
        ("Bearer ", None),
    ],
)
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.5", False),
        ("box.lan", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_beyond_loopback_needs_a_key_file() -> None:
    with pytest.raises(ConfigError) as err:
        build_config({"listen_host": "0.0.0.0"})
    assert str(err.value).startswith(
        "listen_host '0.0.0.0' is reachable beyond this machine and keys_file is not set"
    )
    assert build_config({"listen_host": "0.0.0.0", "keys_file": "/k"}).keys_file == "/k"
    assert build_config({}).keys_file == ""


def test_keyring_keeps_the_last_good_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(key_line("alice", "k1") + "\n")
    ring = KeyRing(path)
    ring.load()
    assert not ring.maybe_reload()  # unchanged
    path.write_text("garbage\n")
    assert not ring.maybe_reload()
    assert (ring.file_ok, ring.errors, [k.name for k in ring.keys.values()]) == (
        False,
        1,
        ["alice"],
    )
    path.unlink()
    assert not ring.maybe_reload()
    assert [k.name for k in ring.keys.values()] == ["alice"]
    path.write_text(key_line("bob", "k2") + "\n")
    assert ring.maybe_reload()
    assert (ring.file_ok, [k.name for k in ring.keys.values()]) == (True, ["bob"])


# ------------------------------------------------------------------ the CLI


def test_keytool_add_list_remove(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "keys"
    out = io.StringIO()
    assert keytool.add(path, "alice", None, out) == 0
    key = out.getvalue().strip()
    assert key.startswith("csk-") and len(key) == len("csk-") + 43  # 32 bytes, base64url
    assert key not in path.read_text()
    assert path.read_text() == key_line("alice", key) + "\n"
    assert oct(path.stat().st_mode & 0o777) == "0o640"
    assert keytool.add(path, "bob", 4, io.StringIO()) == 0
    listed = io.StringIO()
    keytool.list_names(path, listed)
    assert listed.getvalue() == "alice\nbob max_requests=4\n"
    with pytest.raises(KeysFileError, match="'alice' already has a key"):
        keytool.add(path, "alice", None, io.StringIO())
    keytool.remove(path, "alice", io.StringIO())
    assert [k.name for k in parse_keys(path.read_text(), "keys").values()] == ["bob"]
    with pytest.raises(KeysFileError, match="no key named 'alice'"):
        keytool.remove(path, "alice", io.StringIO())


def test_the_cli_runs_proxy_key_add(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys"
    assert cli.main(["proxy", "key", "add", "agent-1", "--file", str(path)]) == 0
    key = capsys.readouterr().out.strip()
    assert lookup(parse_keys(path.read_text(), "keys"), key) is not None
    path.write_text("garbage\n")
    assert cli.main(["proxy", "key", "add", "agent-2", "--file", str(path)]) == 1
    assert "expected 'NAME sha256:HEX" in capsys.readouterr().err
    assert path.read_text() == "garbage\n"


# ------------------------------------------------------------------ the proxy as a process


@dataclass
class Box:
    """The proxy process, its key file and its fakes."""

    url: str
    keys_file: Path
    upstream: FakeUpstream
    arbiter: FakeArbiter
    client: aiohttp.ClientSession
    process: asyncio.subprocess.Process

    def add_key(self, name: str, max_requests: int | None = None) -> str:
        out = io.StringIO()
        keytool.add(self.keys_file, name, max_requests, out)
        return out.getvalue().strip()

    async def post(self, key: str | None, path: str = "/v1/echo") -> tuple[int, Any, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        async with self.client.post(self.url + path, json=CHAT, headers=headers) as resp:
            return resp.status, resp.headers, await resp.json(content_type=None)

    async def metric(self, name: str) -> float:
        async with self.client.get(self.url + "/metrics") as resp:
            text = await resp.text()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics")


def proxy_argv(config: Path) -> list[str]:
    return [sys.executable, "-m", "cardshare.proxy", "--config", str(config)]


def proxy_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC)}


async def run_to_exit(config: dict[str, Any], tmp_path: Path) -> tuple[int, str]:
    """Start the proxy with ``config``, expecting it to refuse: its exit status and stderr."""
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps(config))
    process = await asyncio.create_subprocess_exec(
        *proxy_argv(path),
        env=proxy_env(),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(process.communicate(), 30)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError("the proxy started instead of refusing") from None
    return process.returncode or 0, err.decode()


BoxFactory = Callable[..., Awaitable[Box]]


@pytest.fixture
async def make_box(tmp_path: Path) -> AsyncIterator[BoxFactory]:
    boxes: list[Box] = []

    async def factory(**settings: Any) -> Box:
        upstream, arbiter = FakeUpstream(), FakeArbiter()
        await upstream.start()
        await arbiter.start()
        keys_file = tmp_path / "keys"
        keys_file.write_text("")
        secret = tmp_path / "upstream-key"
        secret.write_text(UPSTREAM_KEY + "\n")
        port = free_port()
        config = {
            "listen_host": "127.0.0.1",
            "listen_port": port,
            "upstream_url": upstream.url,
            "arbiter_url": arbiter.url,
            "mode_poll_seconds": 0.05,
            # a held request that should not be (a failing test) is answered, not hung on
            "hold_max_seconds": 15.0,
            "keys_file": str(keys_file),
            "keys_reload_seconds": 0.05,
            "upstream_api_key_file": str(secret),
            **settings,
        }
        path = tmp_path / "proxy.json"
        path.write_text(json.dumps(config))
        process = await asyncio.create_subprocess_exec(
            *proxy_argv(path), env=proxy_env(), stderr=asyncio.subprocess.DEVNULL
        )
        box = Box(
            f"http://127.0.0.1:{port}",
            keys_file,
            upstream,
            arbiter,
            aiohttp.ClientSession(),
            process,
        )
        boxes.append(box)

        async def healthy() -> bool:
            try:
                async with box.client.get(box.url + "/proxy/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        for _ in range(300):
            if await healthy():
                return box
            assert process.returncode is None, "the proxy exited at start"
            await asyncio.sleep(0.05)
        raise AssertionError("the proxy did not answer /proxy/health")

    yield factory
    for box in boxes:
        if box.process.returncode is None:
            box.process.terminate()
            await box.process.wait()
        await box.client.close()
        await box.upstream.stop()
        await box.arbiter.stop()


async def test_no_key_wrong_key_good_key(make_box: BoxFactory) -> None:
    box = await make_box()
    key = box.add_key("alice")
    await wait_for_key(box, key)
    for presented in (None, "csk-wrong", key + "x", ""):
        status, headers, doc = await box.post(presented)
        assert (status, doc) == (401, {"error": UNAUTHORIZED}), presented
        assert "Retry-After" not in headers
    async with box.client.post(
        box.url + "/v1/echo", json=CHAT, headers={"Authorization": f"Basic {key}"}
    ) as resp:
        assert resp.status == 401
    status, _, doc = await box.post(key)
    assert status == 200
    # the upstream sees the proxy's own key, never the agent's
    sent = [v for k, v in doc["headers"] if k.lower() == "authorization"]
    assert sent == [f"Bearer {UPSTREAM_KEY}"]
    assert key not in json.dumps(doc)
    assert await box.metric("cardshare_proxy_keys") == 1


async def wait_for_key(box: Box, key: str, status: int = 200) -> None:
    """Wait until the running proxy answers ``key`` with ``status`` (it polls the file)."""
    for _ in range(200):
        if (await box.post(key))[0] == status:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the key never got a {status}")


async def test_key_file_replaced_while_running(make_box: BoxFactory) -> None:
    box = await make_box()
    alice = box.add_key("alice")
    await wait_for_key(box, alice)
    bob = box.add_key("bob")
    await wait_for_key(box, bob)  # a new key works without a restart
    out = io.StringIO()
    keytool.remove(box.keys_file, "alice", out)
    await wait_for_key(box, alice, 401)  # a removed key is refused
    assert (await box.post(bob))[0] == 200
    assert await box.metric("cardshare_proxy_keys_file_ok") == 1
    # a malformed file keeps the last good keys and never opens the door
    box.keys_file.write_text("bob sha256:not-hex\n")
    for _ in range(200):
        if await box.metric("cardshare_proxy_keys_file_ok") == 0:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the malformed file was not noticed")
    assert (await box.post(bob))[0] == 200
    assert (await box.post(alice))[0] == 401
    assert (await box.post(None))[0] == 401
    # an empty file is a good file: nobody is let in
    box.keys_file.write_text("# nobody\n")
    await wait_for_key(box, bob, 401)
    assert await box.metric("cardshare_proxy_keys_file_ok") == 1
    assert await box.metric("cardshare_proxy_keys") == 0


async def test_each_key_has_its_bound(make_box: BoxFactory) -> None:
    box = await make_box(key_max_requests=2, retry_after_seconds=7)
    greedy = box.add_key("greedy")
    modest = box.add_key("modest")
    own = box.add_key("own-bound", max_requests=1)
    await wait_for_key(box, modest)
    box.arbiter.mode = "image"
    await wait_for(lambda: box.arbiter.polls > 0, "arbiter polled")
    polls = box.arbiter.polls
    await wait_for(lambda: box.arbiter.polls > polls + 1, "proxy saw image mode")

    held = [asyncio.ensure_future(box.post(greedy, "/v1/chat/completions")) for _ in range(2)]

    async def state() -> dict[str, Any]:
        async with box.client.get(box.url + "/proxy/state") as resp:
            doc: dict[str, Any] = await resp.json()
            return doc

    for _ in range(200):
        if (await state())["held"] == 2:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the two requests were not held")
    status, headers, doc = await box.post(greedy, "/v1/chat/completions")
    assert (status, headers["Retry-After"]) == (429, "7")
    assert doc == {
        "error": {
            "message": key_limit_message("greedy", 2, 7),
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    # another agent is still held, not refused
    other = asyncio.ensure_future(box.post(modest, "/v1/chat/completions"))
    for _ in range(200):
        if (await state())["held"] == 3:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the other key's request was not held")
    mine = asyncio.ensure_future(box.post(own, "/v1/chat/completions"))
    for _ in range(200):
        if (await state())["held"] == 4:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the own-bound key's request was not held")
    assert (await box.post(own, "/v1/chat/completions"))[0] == 429
    box.arbiter.mode = "llm"
    answers = await asyncio.wait_for(asyncio.gather(*held, other, mine), 10)
    assert [a[0] for a in answers] == [200, 200, 200, 200]
    # the bound is on requests held or in flight: once answered, the key may send again
    assert (await box.post(greedy, "/v1/chat/completions"))[0] == 200


async def test_openai_sdk_with_its_api_key(make_box: BoxFactory) -> None:
    box = await make_box()
    key = box.add_key("sdk-agent")
    await wait_for_key(box, key)
    client = openai.AsyncOpenAI(base_url=box.url + "/v1", api_key=key, max_retries=0)
    wrong = openai.AsyncOpenAI(base_url=box.url + "/v1", api_key="csk-nope", max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content == "hello there"
        with pytest.raises(openai.AuthenticationError) as err:
            await wrong.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}]
            )
    finally:
        await client.close()
        await wrong.close()
    assert (err.value.status_code, err.value.body) == (401, UNAUTHORIZED)


async def test_refuses_to_start_beyond_loopback_without_keys(tmp_path: Path) -> None:
    status, err = await run_to_exit(
        {"listen_host": "0.0.0.0", "listen_port": free_port()}, tmp_path
    )
    assert status == 2
    assert "listen_host '0.0.0.0' is reachable beyond this machine and keys_file is not set" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("alice sha256:xyz\n", "line 1: expected sha256: and 64 lowercase hex digits"),
    ],
)
async def test_refuses_to_start_with_a_bad_key_file(
    tmp_path: Path, content: str | None, message: str
) -> None:
    keys = tmp_path / "keys"
    if content is not None:
        keys.write_text(content)
    config = {"listen_host": "0.0.0.0", "listen_port": free_port(), "keys_file": str(keys)}
    status, err = await run_to_exit(config, tmp_path)
    assert status == 2
    assert message in err and str(keys) in err


async def test_without_its_own_key_the_proxy_sends_none_upstream(
    make_stand: StandFactory, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys"
    out = io.StringIO()
    keytool.add(keys_file, "alice", None, out)
    key = out.getvalue().strip()
    stand = await make_stand(keys_file=str(keys_file))
    async with stand.client.get(
        stand.url + "/v1/echo", headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert [k for k, _ in doc["headers"] if k.lower() == "authorization"] == []
    assert stand.proxy.counters.outcomes["forwarded"] == 1


async def test_without_keys_the_agents_header_passes_as_before(make_stand: StandFactory) -> None:
    stand = await make_stand()
    async with stand.client.get(
        stand.url + "/v1/echo", headers={"Authorization": "Bearer for-vllm"}
    ) as resp:
        doc = await resp.json()
    assert [v for k, v in doc["headers"] if k.lower() == "authorization"] == ["Bearer for-vllm"]
