"""vLLM's own key, as the ``vllm`` role gives it, on real vLLM.

The role's configure tasks (render_key.yml) write the key file and the env file beside it; vLLM
starts with that env file's variables in its environment, as compose's ``env_file`` gives them
to the container, and with no ``--api-key`` on its command line (the role's native-window rung
for the tiny model, as everywhere in this lane). One vLLM serves the whole module.

Checked against it: which paths ask for the key and what the refusal is (status, headers and
body, written to .cache/conformance/api-key-answers.json; the recording in
tests/fixtures/vllm/api-key-answers.json came from there), the arbiter's one-token probe
(``HttpLlm.one_token``) with and without ``vllm_api_key_file``, and the patient proxy sending
the box's key upstream instead of the agent's, through the ``openai`` SDK (a box of ``boxes``
with its ``api_key_file``, and the single box's ``upstream_api_key_file``).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from conftest import (
    CACHE,
    REPO,
    SERVED_NAME,
    VllmServer,
    free_port,
    run_playbook,
    tiny_args,
    wait_listening,
)

from cardshare.arbiter.config import Config
from cardshare.arbiter.edges import HttpLlm, Rejected
from cardshare.proxy.keys import key_line

pytestmark = pytest.mark.conformance

ANSWERS = CACHE / "api-key-answers.json"
UNAUTHORIZED = b'{"error":"Unauthorized"}'
CHAT = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def role_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The key file the role writes and the environment its env file gives the container."""
    tmp = tmp_path_factory.mktemp("role")
    key_file = tmp / "secret" / "key"
    extra = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "vllm_model_dir": str(tmp / "models"),
        "vllm_hf_cache_dir": str(tmp / "hf-cache"),
        "vllm_api_key_file": str(key_file),
    }
    run = run_playbook("localhost,", "tests/conformance/render_key.yml", extra)
    assert run.returncode == 0, f"the role's configure tasks failed:\n{run.stdout[-3000:]}"
    env_file = Path(f"{key_file}.env")
    for path in (key_file, env_file):
        assert path.stat().st_mode & 0o777 == 0o600, path
    # compose's env_file: one VAR=VALUE a line, the value as written (no quotes here)
    env = {}
    for line in env_file.read_text(encoding="utf-8").splitlines():
        name, sep, value = line.partition("=")
        assert sep and name, f"{env_file}: not VAR=VALUE: {line!r}"
        env[name] = value
    key = key_file.read_text(encoding="utf-8").splitlines()[0]
    assert env == {"VLLM_API_KEY": key} and len(key) == 48
    return key_file, env


@pytest.fixture(scope="module")
def key(role_key: tuple[Path, dict[str, str]]) -> str:
    return role_key[1]["VLLM_API_KEY"]


@pytest.fixture(scope="module")
def vllm(
    vllm_bin: Path, model_root: Path, role_key: tuple[Path, dict[str, str]]
) -> Iterator[VllmServer]:
    args = tiny_args(model_root, free_port())
    assert "--api-key" not in args  # the key reaches vLLM by its environment only
    server = VllmServer(
        vllm_bin, args, CACHE / "logs" / "api-key.log", env_extra=dict(role_key[1])
    ).start()
    try:
        assert server.wait_ready(), f"vLLM did not start: {server.log_path}"
        yield server
    finally:
        server.stop()


def ask(
    url: str, method: str, path: str, auth: str | None, body: Any = None
) -> tuple[int, list[tuple[str, str]], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    headers = {} if auth is None else {"Authorization": auth}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, [(k.lower(), v) for k, v in resp.getheaders()], payload


_recorded: dict[str, Any] = {}


def asked(
    url: str, key: str, case: str, method: str, path: str, auth: str | None, body: Any
) -> tuple[int, list[tuple[str, str]], bytes]:
    """``ask`` with ``{key}`` in ``auth`` standing for vLLM's key; the request and its answer
    are kept in .cache/conformance/api-key-answers.json (the key as ``{key}``, bodies over
    2 kB cut)."""
    answer = ask(url, method, path, None if auth is None else auth.format(key=key), body)
    status, headers, payload = answer
    text = payload.decode("utf-8", "replace")
    _recorded[case] = {
        "request": {"method": method, "path": path, "authorization": auth, "json": body},
        "status": status,
        "headers": headers,
        "body": text if len(text) <= 2000 else text[:2000] + "...",
    }
    ANSWERS.write_text(json.dumps(_recorded, indent=1) + "\n", encoding="utf-8")
    return answer


# -- which paths ask for the key --------------------------------------------------------------

REFUSED = [
    ("GET /v1/models, no key", "GET", "/v1/models", None, None),
    ("POST /v1/chat/completions, no key", "POST", "/v1/chat/completions", None, CHAT),
    ("GET /v1/models, a wrong key", "GET", "/v1/models", "Bearer not-the-key", None),
    ("GET /v1/models, the key as Basic", "GET", "/v1/models", "Basic {key}", None),
    ("GET /v1/models, the key without a scheme", "GET", "/v1/models", "{key}", None),
    ("GET /v1/no-such-path, no key", "GET", "/v1/no-such-path", None, None),
    # vLLM 0.32's middleware guards three more prefixes (GUARDED_PREFIX)
    ("GET /v2/no-such-path, no key", "GET", "/v2/no-such-path", None, None),
    ("GET /inference/no-such-path, no key", "GET", "/inference/no-such-path", None, None),
    ("GET /cohere/no-such-path, no key", "GET", "/cohere/no-such-path", None, None),
]


@pytest.mark.parametrize(("case", "method", "path", "auth", "body"), REFUSED)
def test_v1_is_refused_without_the_key(
    vllm: VllmServer, key: str, case: str, method: str, path: str, auth: str | None, body: Any
) -> None:
    answer = asked(vllm.url, key, case, method, path, auth, body)
    status, headers, payload = answer
    assert (status, payload) == (401, UNAUTHORIZED)
    assert dict(headers)["content-type"] == "application/json"


ALLOWED = [
    ("GET /v1/models, the key", "GET", "/v1/models", "Bearer {key}", None),
    ("GET /v1/models, the key, scheme in lower case", "GET", "/v1/models", "bearer {key}", None),
    ("POST /v1/chat/completions, the key", "POST", "/v1/chat/completions", "Bearer {key}", CHAT),
    ("GET /health, no key", "GET", "/health", None, None),
    ("GET /ping, no key", "GET", "/ping", None, None),
    ("GET /metrics, no key", "GET", "/metrics", None, None),
    ("GET /version, no key", "GET", "/version", None, None),
    ("POST /tokenize, no key", "POST", "/tokenize", None, {"prompt": "hi"}),
]


@pytest.mark.parametrize(("case", "method", "path", "auth", "body"), ALLOWED)
def test_the_key_opens_v1_and_the_rest_stays_open(
    vllm: VllmServer, key: str, case: str, method: str, path: str, auth: str | None, body: Any
) -> None:
    answer = asked(vllm.url, key, case, method, path, auth, body)
    status, _, payload = answer
    assert status == 200, payload[:500]
    if path == "/v1/models":
        assert [m["id"] for m in json.loads(payload)["data"]] == [SERVED_NAME]
    if path == "/v1/chat/completions":
        assert json.loads(payload)["choices"][0]["message"]["role"] == "assistant"
    if path == "/metrics":
        assert b"vllm:num_requests_running" in payload


def test_a_trailing_space_after_the_key_is_not_part_of_it(vllm: VllmServer, key: str) -> None:
    # uvicorn strips a header value's surrounding blanks before vLLM compares the key
    case = "GET /v1/models, the key and a trailing space"
    answer = asked(vllm.url, key, case, "GET", "/v1/models", "Bearer {key} ", None)
    assert answer[0] == 200, answer


# -- the arbiter's one-token probe ------------------------------------------------------------


def arbiter_config(url: str, tmp: Path, key_file: Path | None) -> Config:
    """The arbiter's settings as far as its vLLM edge reads them."""
    return Config(
        data_dir=tmp / "arbiter",
        vllm_url=url,
        served_model_name=SERVED_NAME,
        comfyui_url="http://127.0.0.1:9",
        card_current_json=tmp / "current.json",
        token_file=tmp / "token",
        vllm_api_key_file=key_file,
    )


async def probe(url: str, tmp: Path, key_file: Path | None) -> None:
    async with aiohttp.ClientSession() as session:
        await HttpLlm(session, arbiter_config(url, tmp, key_file)).one_token()


def test_the_arbiters_probe_passes_with_the_roles_key_file(
    vllm: VllmServer, role_key: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    asyncio.run(probe(vllm.url, tmp_path, role_key[0]))


def test_the_arbiters_probe_without_the_key_file_is_refused_401(
    vllm: VllmServer, tmp_path: Path
) -> None:
    with pytest.raises(Rejected) as caught:
        asyncio.run(probe(vllm.url, tmp_path, None))
    assert (caught.value.status, caught.value.detail) == (401, {"error": "Unauthorized"})
    assert "POST " + vllm.url + "/v1/completions answered 401" in str(caught.value)
    assert "vllm_api_key_file is not set" in str(caught.value)


def test_the_arbiters_probe_with_another_key_names_the_file(
    vllm: VllmServer, tmp_path: Path
) -> None:
    other = tmp_path / "other-key"
    other.write_text("not-vllms-key\n")
    with pytest.raises(Rejected) as caught:
        asyncio.run(probe(vllm.url, tmp_path, other))
    assert caught.value.status == 401
    assert f"vLLM refused the key of vllm_api_key_file {other}" in str(caught.value)


# -- the patient proxy sends the box's key, never the agent's ---------------------------------


class _ModeLlm(BaseHTTPRequestHandler):
    """The arbiter's ``/v1/mode`` answer, ``llm`` (the proxy's holding is not under test here;
    a box of a fleet is in rotation only while its arbiter answers)."""

    def do_GET(self) -> None:
        body = json.dumps({"mode": "llm", "since": 0}).encode()
        self.send_response(200 if self.path == "/v1/mode" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def arbiter_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ModeLlm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def agent_key() -> str:
    return "csk-" + secrets.token_urlsafe(32)


@pytest.fixture(scope="module")
def start_proxy(
    tmp_path_factory: pytest.TempPathFactory, agent_key: str
) -> Iterator[Callable[[dict[str, Any]], str]]:
    """``python -m cardshare.proxy --config FILE`` (this checkout's) with the settings given,
    the agent's key in its keys file; its URL once it listens."""
    procs: list[subprocess.Popen[bytes]] = []
    tmp = tmp_path_factory.mktemp("proxy")
    keys = tmp / "agent-keys"
    keys.write_text(key_line("agent-a", agent_key) + "\n", encoding="utf-8")

    def start(settings: dict[str, Any]) -> str:
        port = free_port()
        n = len(procs)
        config = tmp / f"proxy{n}.json"
        config.write_text(
            json.dumps(
                {
                    "listen_host": "127.0.0.1",
                    "listen_port": port,
                    "keys_file": str(keys),
                    "mode_poll_seconds": 0.2,
                    **settings,
                }
            )
        )
        log = tmp / f"proxy{n}.log"
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cardshare.proxy", "--config", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        procs.append(proc)
        wait_listening(proc, port, log)
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


def box(vllm: VllmServer, arbiter_url: str, key_file: Path | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": "box-a", "upstream_url": vllm.url}
    entry |= {"arbiter_url": arbiter_url, "models": [SERVED_NAME]}
    if key_file is not None:
        entry["api_key_file"] = str(key_file)
    return entry


def wait_in_rotation(url: str, agent_key: str) -> None:
    """The fleet's box is in rotation once its arbiter was polled (a 503 until then)."""
    deadline = time.monotonic() + 30
    while ask(url, "GET", "/v1/models", f"Bearer {agent_key}")[0] == 503:
        assert time.monotonic() < deadline, "the box never came into rotation"
        time.sleep(0.2)


@pytest.fixture(scope="module", params=["boxes", "single"])
def keyed_proxy(
    request: pytest.FixtureRequest,
    start_proxy: Callable[[dict[str, Any]], str],
    vllm: VllmServer,
    arbiter_url: str,
    role_key: tuple[Path, dict[str, str]],
    agent_key: str,
) -> str:
    """A proxy that sends the role's key: a box of ``boxes`` with its ``api_key_file``, or the
    single box of ``upstream_url`` with ``upstream_api_key_file``."""
    key_file = role_key[0]
    if request.param == "boxes":
        url = start_proxy({"boxes": [box(vllm, arbiter_url, key_file)]})
        wait_in_rotation(url, agent_key)
        return url
    return start_proxy(
        {
            "upstream_url": vllm.url,
            "arbiter_url": arbiter_url,
            "upstream_api_key_file": str(key_file),
        }
    )


def client(proxy: str, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy + "/v1", api_key=api_key, max_retries=0, timeout=120)


def test_vllm_refuses_the_agents_key(vllm: VllmServer, agent_key: str) -> None:
    # so a request the proxy answers 200 did not reach vLLM with the agent's key
    assert ask(vllm.url, "GET", "/v1/models", f"Bearer {agent_key}")[::2] == (401, UNAUTHORIZED)


def test_a_plain_chat_completion_through_the_proxy_with_the_boxs_key(
    keyed_proxy: str, agent_key: str, key: str
) -> None:
    assert agent_key != key
    answer = client(keyed_proxy, agent_key).chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    assert answer.model == SERVED_NAME
    assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 5


def test_a_streamed_chat_completion_through_the_proxy_with_the_boxs_key(
    keyed_proxy: str, agent_key: str
) -> None:
    stream = client(keyed_proxy, agent_key).chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert sum(1 for c in chunks if c.choices) >= 2


def test_the_models_through_the_proxy_with_the_boxs_key(keyed_proxy: str, agent_key: str) -> None:
    models = client(keyed_proxy, agent_key).models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]


def test_the_agents_key_is_not_passed_on_by_a_box_without_its_key_file(
    start_proxy: Callable[[dict[str, Any]], str],
    vllm: VllmServer,
    arbiter_url: str,
    agent_key: str,
) -> None:
    # the same box without api_key_file: the proxy lets the agent in and sends vLLM no key,
    # so vLLM's own 401 comes back whole (the agent's key stayed at the proxy)
    url = start_proxy({"boxes": [box(vllm, arbiter_url, None)]})
    deadline = time.monotonic() + 30
    while (answer := ask(url, "GET", "/v1/models", f"Bearer {agent_key}"))[0] == 503:
        assert time.monotonic() < deadline, "the box never came into rotation"
        time.sleep(0.2)
    assert answer[::2] == (401, UNAUTHORIZED)
    with pytest.raises(openai.AuthenticationError) as caught:
        client(url, agent_key).chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert caught.value.status_code == 401
    assert caught.value.response.content == UNAUTHORIZED
