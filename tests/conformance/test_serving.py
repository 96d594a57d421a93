"""A serving vLLM through the arbiter's metrics parser and the patient proxy.

One vLLM (the role's native-window rung for the tiny model) serves the whole module. The
arbiter reads its ``/metrics`` with its own parser (``cardshare.arbiter.rules``:
``parse_vllm_metrics`` and ``update_activity``); the patient proxy (``python -m
cardshare.proxy``, this checkout's) stands in front of it and the ``openai`` SDK pinned in
requirements-dev.txt talks to the proxy. The proxy runs without an arbiter, told to take the
mode as ``llm`` (``--no-trust-mode-when-arbiter-down``): its holding is not under test here,
its forwarding is.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import CACHE, REPO, SERVED_NAME, VllmServer, free_port, tiny_args, wait_listening

from cardshare.arbiter.rules import LlmActivity, parse_vllm_metrics, update_activity

pytestmark = pytest.mark.conformance

# Longer than any check waits: a generation that ends by itself within a check would prove
# nothing about a disconnect.
LONG = 30000


@pytest.fixture(scope="module")
def vllm(vllm_bin: Path, model_root: Path) -> Iterator[VllmServer]:
    server = VllmServer(
        vllm_bin, tiny_args(model_root, free_port()), CACHE / "logs" / "serving.log"
    ).start()
    try:
        assert server.wait_ready(), f"vLLM did not start: {server.log_path}"
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def proxy(vllm: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    argv = [sys.executable, "-m", "cardshare.proxy", "--listen-host", "127.0.0.1"]
    argv += ["--listen-port", str(port), "--upstream-url", vllm.url]
    argv += ["--arbiter-url", f"http://127.0.0.1:{free_port()}"]
    argv += ["--no-trust-mode-when-arbiter-down", "--mode-poll-seconds", "0.5"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_listening(proc, port, log)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def metrics_text(vllm: VllmServer) -> str:
    with urllib.request.urlopen(vllm.url + "/metrics", timeout=30) as resp:
        return str(resp.read().decode())


def sample(text: str, name: str) -> float:
    """The sum of one metric's samples (Prometheus text; every label set)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def raw(base: str, method: str, path: str, body: bytes, ctype: str) -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body=body, headers={"Content-Type": ctype})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def wait_for(predicate: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


# -- /metrics through the arbiter's parser ----------------------------------------------------


def test_idle_metrics_parse_as_idle(vllm: VllmServer) -> None:
    metrics = parse_vllm_metrics(metrics_text(vllm))
    assert (metrics.running, metrics.waiting) == (0.0, 0.0)
    then = LlmActivity(last_active_at=0.0, last_success_total=metrics.success_total)
    assert update_activity(then, parse_vllm_metrics(metrics_text(vllm)), 10.0).last_active_at == 0


def test_busy_metrics_parse_as_busy_and_the_finish_counts(vllm: VllmServer) -> None:
    before = parse_vllm_metrics(metrics_text(vllm))
    # long enough for several 50 ms polls to see it run: 400 tokens of the tiny model ended
    # before the first poll on a quiet machine
    body = {"model": SERVED_NAME, "prompt": "count to ten", "max_tokens": 4000}
    body |= {"ignore_eos": True, "temperature": 0}
    done: list[int] = []

    def generate() -> None:
        done.append(
            raw(vllm.url, "POST", "/v1/completions", json.dumps(body).encode(), "application/json")[
                0
            ]
        )

    worker = threading.Thread(target=generate)
    worker.start()
    seen = []
    while worker.is_alive():
        seen.append(parse_vllm_metrics(metrics_text(vllm)))
        time.sleep(0.05)
    worker.join()
    assert done == [200]
    assert any(m.running == 1 for m in seen), seen
    after = parse_vllm_metrics(metrics_text(vllm))
    assert after.running == 0 and after.success_total == before.success_total + 1
    # the arbiter's activity rule sees the finished request even when no poll saw it run
    then = LlmActivity(last_active_at=0.0, last_success_total=before.success_total)
    assert update_activity(then, after, 10.0).last_active_at == 10.0


# -- the patient proxy in front, driven by the openai SDK -------------------------------------


def client(proxy: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_plain_chat_completion_through_the_proxy(proxy: str) -> None:
    answer = client(proxy).chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    assert answer.model == SERVED_NAME
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 5


def test_streaming_with_usage_through_the_proxy(proxy: str) -> None:
    stream = client(proxy).chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is not None, "the usage chunk comes last"
    assert usage[0].completion_tokens == 12
    assert sum(1 for c in chunks if c.choices) >= 2, "more than one chunk was streamed"


@pytest.mark.parametrize(
    ("body", "ctype"),
    [
        # a JSON body sent as text/plain: vLLM answers 400 (not 415)
        (json.dumps({"model": SERVED_NAME, "prompt": "ping", "max_tokens": 1}), "text/plain"),
        # more tokens than the window: vLLM's own 400 validation error
        (
            json.dumps({"model": SERVED_NAME, "prompt": "ping", "max_tokens": 10**6}),
            "application/json",
        ),
        # an unknown model: 404
        (json.dumps({"model": "nope", "prompt": "ping", "max_tokens": 1}), "application/json"),
    ],
)
def test_errors_pass_through_byte_for_byte(
    vllm: VllmServer, proxy: str, body: str, ctype: str
) -> None:
    direct = raw(vllm.url, "POST", "/v1/completions", body.encode(), ctype)
    proxied = raw(proxy, "POST", "/v1/completions", body.encode(), ctype)
    assert 400 <= direct[0] < 500
    assert proxied == direct
    if ctype == "application/json":
        with pytest.raises(openai.APIStatusError) as raised:
            client(proxy).completions.create(**json.loads(body))
        assert raised.value.status_code == direct[0]
        assert raised.value.response.content == direct[1]


def test_a_client_disconnect_stops_the_generation(vllm: VllmServer, proxy: str) -> None:
    wait_for(lambda: sample(metrics_text(vllm), "vllm:num_requests_running") == 0, 60, "idle")
    before = metrics_text(vllm)
    stream = client(proxy).completions.create(
        model=SERVED_NAME, prompt="tell me a story", max_tokens=LONG, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for received, _chunk in enumerate(stream, start=1):
        if received == 5:
            break
    assert sample(metrics_text(vllm), "vllm:num_requests_running") == 1
    stream.close()  # the client goes away mid-stream
    wait_for(
        lambda: sample(metrics_text(vllm), "vllm:num_requests_running") == 0,
        10,
        "vLLM still generates for a client that left",
    )
    after = metrics_text(vllm)
    generated = sample(after, "vllm:generation_tokens_total") - sample(
        before, "vllm:generation_tokens_total"
    )
    # stopped before its end (ignore_eos: a finished request is exactly LONG tokens); how far
    # it got depends on how soon the disconnect reaches vLLM: 24,231 of 30,000 were seen on a
    # loaded 2-core machine, far fewer on a quiet one
    assert generated < LONG, generated
    time.sleep(2)
    assert sample(metrics_text(vllm), "vllm:generation_tokens_total") == sample(
        after, "vllm:generation_tokens_total"
    ), "tokens are still being generated"
    # real vLLM does not count an aborted request as a success, under any finished_reason
    assert sample(after, "vllm:request_success_total") == sample(
        before, "vllm:request_success_total"
    )


def test_a_connection_vllm_closed_while_idle_is_not_a_retry(proxy: str) -> None:
    """vLLM's uvicorn closes a kept-alive connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE):
    the proxy's next request goes on a new connection, answered, with no connect retry."""

    def retries() -> float:
        with urllib.request.urlopen(proxy + "/metrics", timeout=30) as resp:
            return sample(resp.read().decode(), "cardshare_proxy_connect_retries_total")

    body = json.dumps({"model": SERVED_NAME, "prompt": "ping", "max_tokens": 1}).encode()
    assert raw(proxy, "POST", "/v1/completions", body, "application/json")[0] == 200
    before = retries()
    time.sleep(6.5)  # past uvicorn's keep-alive: vLLM has closed the proxy's idle connection
    for _ in range(3):
        assert raw(proxy, "POST", "/v1/completions", body, "application/json")[0] == 200
    assert retries() == before
