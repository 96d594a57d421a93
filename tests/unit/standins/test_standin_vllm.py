"""vllm_standin.py: vLLM's refusals with its messages, and the OpenAI-shaped API."""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import simcard
import vllm_standin as vs
from standin_http import serve_in_thread
from standin_testlib import VRAM_TOTAL, request

YARN_2 = json.dumps(
    {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 32768,
        }
    }
)
LONG = (
    " To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. "
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses "
    "relative position encoding (RoPE), positions exceeding derived_max_model_len lead to nan. "
    "If the model uses absolute position encoding, positions exceeding derived_max_model_len "
    "will cause a CUDA array out-of-bounds error."
)


def too_long(requested: int, derived: str) -> str:
    return (
        f"User-specified max_model_len ({requested}) is greater than the derived max_model_len "
        f"(max_position_embeddings={derived} or model_max_length=None in model's config.json)."
        + LONG
    )


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["serve", "m", "--max-model-len", "65536"], {}, too_long(65536, "32768.0")),
        (
            ["serve", "m", "--max-model-len", "131072", "--hf-overrides", YARN_2],
            {},
            too_long(131072, "65536.0"),
        ),
        (
            ["m", "--max_model_len=40000"],
            {"STANDIN_NATIVE_CONTEXT": "16384"},
            too_long(40000, "16384.0"),
        ),
        (
            ["serve", "m", "--enable-auto-tool-choice"],
            {},
            "Error: --enable-auto-tool-choice requires --tool-call-parser",
        ),
        (["serve"], {}, "error: the following arguments are required: model_tag"),
        (
            ["serve", "m", "--gpu-memory-utilization", "1.5"],
            {},
            "GPU memory utilization must be less than 1.0. Got 1.5.",
        ),
    ],
)
def test_prepare_refuses_like_vllm(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(vs.StartupError) as caught:
        vs.prepare(argv, env)
    assert str(caught.value) == message


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(vs.StartupError, match=r"^invalid tool call parser: nope \(chose from \{"):
        vs.prepare(["serve", "m", "--tool-call-parser", "nope"], {})


@pytest.mark.parametrize(
    ("argv", "env", "max_len"),
    [
        (["serve", "m", "--max-model-len", "65536", "--hf-overrides", YARN_2], {}, 65536),
        (["serve", "m"], {"STANDIN_NATIVE_CONTEXT": "40960"}, 40960),
        (["m", "--max-model-len", "65536"], {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}, 65536),
        (["serve", "m", "--max-model-len", "8192"], {}, 8192),
    ],
)
def test_prepare_accepts(argv: list[str], env: dict[str, str], max_len: int) -> None:
    assert vs.prepare(argv, env).max_model_len == max_len


def test_model_config_file_gives_the_native_window(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 40960}))
    with pytest.raises(vs.StartupError) as caught:
        vs.prepare(["serve", str(tmp_path), "--max-model-len", "65536"], {})
    assert str(caught.value) == too_long(65536, "40960.0")


def test_model_config_rope_scaling_counts(tmp_path: Path) -> None:
    config = {"max_position_embeddings": 32768, **json.loads(YARN_2)}
    (tmp_path / "config.json").write_text(json.dumps(config))
    settings = vs.prepare(["serve", str(tmp_path), "--max-model-len", "65536"], {})
    assert settings.max_model_len == 65536


def test_all_flags_we_use_parse() -> None:
    argv = [
        "serve", "/models/qwen", "--host", "127.0.0.1", "--port", "8001",
        "--served-model-name", "qwen", "--gpu-memory-utilization", "0.85",
        "--max-model-len", "65536", "--hf-overrides", YARN_2, "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--dtype", "float16", "--quantization", "fp8",
        "--trust-remote-code", "--tensor-parallel-size", "1", "--max-num-seqs", "64",
        "--enforce-eager",
    ]  # fmt: skip
    settings = vs.prepare(argv, {"STANDIN_MAX_RUNNING": "2"})
    assert settings.served_names == ("qwen",)
    assert (settings.host, settings.port, settings.utilization) == ("127.0.0.1", 8001, 0.85)
    assert (settings.max_num_seqs, settings.max_running) == (64, 2)
    assert settings.tool_call_parser == "hermes"


def test_unknown_flag_exits_like_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        vs.parse_args(["serve", "m", "--rope-scaling", "{}"])
    assert caught.value.code == 2
    assert "vllm serve: error: unrecognized arguments: --rope-scaling {}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("free", "total", "util", "message"),
    [
        (
            int(3.2 * 1024**3),
            VRAM_TOTAL,
            0.85,
            "Free memory on device xpu:0 (3.2/32.0 GiB) on startup is less than desired GPU "
            "memory utilization (0.85, 27.2 GiB). Decrease GPU memory utilization or reduce "
            "GPU memory used by other processes.",
        ),
        (VRAM_TOTAL - 4 * 1024**3, VRAM_TOTAL, 0.85, None),
        (VRAM_TOTAL, VRAM_TOTAL, 0.85, None),
    ],
)
def test_memory_error(free: int, total: int, util: float, message: str | None) -> None:
    assert vs.memory_error(free, total, util) == message


def test_main_refuses_when_the_card_is_taken(
    sim_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = simcard.SimClient("python3", ["comfy"], root=sim_env, container_id=None)
    other.register(vram=20 * 1024**3)
    try:
        code = vs.main(["serve", "m", "--gpu-memory-utilization", "0.85"], {})
    finally:
        other.close()
    err = capsys.readouterr().err
    assert code == 1
    expected = vs.memory_error(12 * 1024**3, VRAM_TOTAL, 0.85)
    assert expected is not None and f"ValueError: {expected}\n" in err
    assert [p.name for p in (sim_env / "proc").iterdir()] == []


def test_main_refuses_context_without_yarn(
    sim_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert vs.main(["serve", "m", "--max-model-len", "65536"], {}) == 1
    err = capsys.readouterr().err
    assert f"  Value error, {too_long(65536, '32768.0')} [type=value_error" in err


# ----------------------------------------------------------------------------- server


@pytest.fixture
def server(sim_env: Path) -> Iterator[vs.VllmServer]:
    settings = vs.prepare(
        ["serve", "m", "--served-model-name", "qwen", "--enable-auto-tool-choice",
         "--tool-call-parser", "hermes", "--max-model-len", "4096"],
        {"STANDIN_TOKEN_SECONDS": "0"},
    )  # fmt: skip
    card = simcard.SimClient(vs.ENGINE_COMM, ["vllm"], root=sim_env, container_id=None)
    card.register(vram=math.ceil(VRAM_TOTAL * settings.utilization))
    srv = vs.make_server(settings, card, port=0)
    srv.server_address = ("127.0.0.1", srv.server_address[1])
    serve_in_thread(srv)
    yield srv
    srv.shutdown()
    srv.server_close()
    card.close()


def port_of(srv: vs.VllmServer) -> int:
    return int(srv.server_address[1])


def sse_events(body: bytes) -> list[str]:
    text = body.decode()
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e.removeprefix("data: ") for e in events]


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} {labels} missing")


def test_health_models_version(server: vs.VllmServer) -> None:
    port = port_of(server)
    assert request(port, "GET", "/health")[0::2] == (200, b"")
    status, _, body = request(port, "GET", "/v1/models")
    models = json.loads(body)
    assert status == 200
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("qwen", 4096)]
    assert "SIMULATION" in json.loads(request(port, "GET", "/version")[2])["version"]


def test_chat_completion_honours_max_tokens(server: vs.VllmServer) -> None:
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 1}
    status, _, raw = request(port_of(server), "POST", "/v1/chat/completions", body)
    reply = json.loads(raw)
    assert status == 200
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["message"]["content"] == "This"
    assert reply["usage"]["completion_tokens"] == 1


def test_chat_stream_is_sse_with_done(server: vs.VllmServer) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, headers, raw = request(port_of(server), "POST", "/v1/chat/completions", body)
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == vs.REPLY
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == len(vs.REPLY.split(" "))


def test_completions_stream_and_plain(server: vs.VllmServer) -> None:
    port = port_of(server)
    status, _, raw = request(port, "POST", "/v1/completions", {"prompt": "a b", "max_tokens": 3})
    assert status == 200
    assert json.loads(raw)["choices"][0]["text"] == "This is a"
    status, _, raw = request(
        port, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2, "stream": True}
    )
    events = sse_events(raw)
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "This is"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}},
    {"type": "function", "function": {"name": "other", "parameters": {}}},
]


def test_tool_call_reply(server: vs.VllmServer) -> None:
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    reply = json.loads(request(port_of(server), "POST", "/v1/chat/completions", body)[2])
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert (call["type"], call["function"]) == (
        "function",
        {"name": "get_weather", "arguments": "{}"},
    )


def test_tool_call_stream(server: vs.VllmServer) -> None:
    body = {"messages": [{"role": "user", "content": "w"}], "tools": TOOLS, "stream": True}
    events = sse_events(request(port_of(server), "POST", "/v1/chat/completions", body)[2])
    chunks = [json.loads(e) for e in events[:-1]]
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks
             if "tool_calls" in c["choices"][0]["delta"]]  # fmt: skip
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == "{}"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        (
            "/v1/chat/completions",
            {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
            404,
            "The model `gpt-4` does not exist.",
        ),
        (
            "/v1/completions",
            {"prompt": "a b c", "max_tokens": 4094},
            400,
            "This model's maximum context length is 4096 tokens. However, you requested 4097 "
            "tokens (3 in the prompt, 4094 in the completion). Please reduce the length of the "
            "prompt or completion.",
        ),
        (
            "/v1/chat/completions",
            {"messages": []},
            400,
            "messages must be a non-empty list",
        ),
    ],
)
def test_bad_requests(
    server: vs.VllmServer, path: str, body: dict[str, object], status: int, message: str
) -> None:
    got, _, raw = request(port_of(server), "POST", path, body)
    assert (got, json.loads(raw)["error"]["message"]) == (status, message)


def test_auto_tool_choice_needs_the_flag(sim_env: Path) -> None:
    settings = vs.prepare(["serve", "m"], {"STANDIN_TOKEN_SECONDS": "0"})
    srv = vs.make_server(settings, None, port=0)
    serve_in_thread(srv)
    try:
        body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
        status, _, raw = request(int(srv.server_address[1]), "POST", "/v1/chat/completions", body)
    finally:
        srv.shutdown()
        srv.server_close()
    assert status == 400
    assert json.loads(raw)["error"]["message"] == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )


def test_metrics_count_true(server: vs.VllmServer) -> None:
    port = port_of(server)
    for max_tokens in (1, 2, None, None, 50):
        body: dict[str, object] = {"messages": [{"role": "user", "content": "one two"}]}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        assert request(port, "POST", "/v1/chat/completions", body)[0] == 200
    status, headers, raw = request(port, "GET", "/metrics")
    text = raw.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    full = len(vs.REPLY.split(" "))
    assert metric(text, "vllm:request_success_total", finished_reason="length") == 2.0
    assert metric(text, "vllm:request_success_total", finished_reason="stop") == 3.0
    assert metric(text, "vllm:generation_tokens_total") == float(1 + 2 + 3 * full)
    assert metric(text, "vllm:prompt_tokens_total") == float(5 * vs.chat_prompt_tokens(
        [{"content": "one two"}]))  # fmt: skip
    assert metric(text, "vllm:num_requests_running", model_name="qwen") == 0.0
    assert metric(text, "vllm:num_requests_waiting", model_name="qwen") == 0.0
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0
    assert "# TYPE vllm:request_success_total counter" in text


def test_requests_run_on_the_compute_engine(server: vs.VllmServer, sim_env: Path) -> None:
    card = server.engine.card
    assert card is not None
    before = card.snapshot()
    request(port_of(server), "POST", "/v1/completions", {"prompt": "x"})
    card.refresh()
    after = card.snapshot()
    assert before is not None and after is not None
    assert after.cycles["ccs"] > before.cycles["ccs"]
    assert after.cycles["vcs"] == before.cycles["vcs"] == 0
    assert after.resident["vram0"] == math.ceil(VRAM_TOTAL * 0.9)


def test_waiting_requests_show_in_metrics(sim_env: Path) -> None:
    settings = vs.prepare(["serve", "m"], {"STANDIN_MAX_RUNNING": "1"})
    engine = vs.Engine(settings, None)
    engine.admit(10)
    admitted = threading.Event()

    def second() -> None:
        engine.admit(5)
        admitted.set()

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    while engine.waiting == 0:
        thread.join(0.01)
    text = engine.metrics()
    assert metric(text, "vllm:num_requests_running") == 1.0
    assert metric(text, "vllm:num_requests_waiting") == 1.0
    engine.finish("stop", 10, 3)
    admitted.wait(5)
    engine.finish("stop", 5, 3)
    assert metric(engine.metrics(), "vllm:num_requests_waiting") == 0.0


def test_dead_engine_fails_health(server: vs.VllmServer) -> None:
    port = port_of(server)
    assert request(port, "POST", "/cardshare-sim/kill-engine")[0] == 200
    assert request(port, "GET", "/health")[0] == 503
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert request(port, "POST", "/v1/chat/completions", body)[0] == 500


# ------------------------------------------------ request bodies and tokenization (issue 8)


def post(port: int, path: str, body: dict[str, object]) -> Any:
    """POST a JSON body; the decoded JSON answer."""
    return json.loads(request(port, "POST", path, body)[2])


def chunked(port: int, path: str, payload: object, pieces: int = 3) -> tuple[int, object]:
    """POST ``payload`` with ``Transfer-Encoding: chunked`` (no Content-Length)."""
    data = json.dumps(payload).encode()
    step = max(len(data) // pieces, 1)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, body=iter([data[i : i + step] for i in range(0, len(data), step)]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)  # fmt: skip
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    return response.status, body


def test_a_chunked_request_body_is_read(server: vs.VllmServer) -> None:
    port = port_of(server)
    status, reply = chunked(port, "/v1/completions", {"prompt": "a b c", "max_tokens": 2})
    assert status == 200, reply
    assert isinstance(reply, dict) and reply["usage"]["prompt_tokens"] == 3
    messages = [{"role": "user", "content": "one two three"}]
    status, reply = chunked(port, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 200, reply
    assert isinstance(reply, dict)
    assert reply["usage"]["prompt_tokens"] == vs.chat_prompt_tokens(messages)
    # the connection stays usable after a chunked body (keep-alive)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for _ in range(2):
        conn.request("POST", "/tokenize", body=iter([b'{"prompt": ', b'"x y"}']),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)  # fmt: skip
        response = conn.getresponse()
        assert (response.status, json.loads(response.read())["count"]) == (200, 2)
    conn.close()


def test_a_broken_chunked_body_is_refused(server: vs.VllmServer) -> None:
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")  # fmt: skip
        assert sock.recv(4096).startswith(b"HTTP/1.1 400 ")


def test_ping_is_health(server: vs.VllmServer) -> None:
    port = port_of(server)
    assert request(port, "GET", "/ping")[0::2] == (200, b"")
    assert request(port, "POST", "/ping")[0::2] == (200, b"")
    request(port, "POST", "/cardshare-sim/kill-engine")
    assert request(port, "GET", "/ping")[0] == 503
    assert request(port, "POST", "/ping")[0] == 503


def test_tokenize_and_detokenize(server: vs.VllmServer) -> None:
    port = port_of(server)
    status, _, raw = request(
        port, "POST", "/tokenize", {"model": "qwen", "prompt": "hello big world"}
    )
    reply = json.loads(raw)
    assert status == 200
    assert set(reply) == {"count", "max_model_len", "tokens", "token_strs"}
    assert (reply["count"], reply["max_model_len"], reply["token_strs"]) == (3, 4096, None)
    tokens = reply["tokens"]
    assert len(tokens) == 3 and all(isinstance(t, int) for t in tokens)
    status, _, raw = request(port, "POST", "/detokenize", {"model": "qwen", "tokens": tokens})
    assert (status, json.loads(raw)) == (200, {"prompt": "hello big world"})
    # the same text gives the same ids; token strings as a byte-level BPE prints them
    again = post(port, "/tokenize", {"prompt": "hello big world", "return_token_strs": True})
    assert again["tokens"] == tokens
    assert again["token_strs"] == ["hello", "Ġbig", "Ġworld"]
    # the count is the one the server charges: completions usage and the context check
    usage = post(port, "/v1/completions", {"prompt": "hello big world", "max_tokens": 1})["usage"]
    assert usage["prompt_tokens"] == 3


def test_tokenize_chat_messages_matches_chat_usage(server: vs.VllmServer) -> None:
    port = port_of(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    reply = post(port, "/tokenize", {"messages": messages})
    usage = post(port, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})["usage"]
    assert reply["count"] == usage["prompt_tokens"] == vs.chat_prompt_tokens(messages)
    text = json.loads(request(port, "POST", "/detokenize", {"tokens": reply["tokens"]})[2])
    assert text["prompt"] == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert 151644 in reply["tokens"]  # <|im_start|> at Qwen2's id


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404),
        ("/tokenize", {}, 400),
        ("/tokenize", {"prompt": ["a", "b"]}, 400),
        ("/detokenize", {"tokens": [-1]}, 400),
        ("/detokenize", {"tokens": "1 2"}, 400),
        (
            "/tokenize",
            {"messages": [], "add_generation_prompt": True, "continue_final_message": True},
            400,
        ),
    ],
)
def test_tokenization_refusals(
    server: vs.VllmServer, path: str, body: dict[str, object], status: int
) -> None:
    got, _, raw = request(port_of(server), "POST", path, body)
    assert got == status
    assert json.loads(raw)["error"]["code"] == status


def test_detokenize_skips_unknown_ids(server: vs.VllmServer) -> None:
    port = port_of(server)
    tokens = json.loads(request(port, "POST", "/tokenize", {"prompt": "a b"})[2])["tokens"]
    reply = json.loads(request(port, "POST", "/detokenize", {"tokens": [*tokens, 150000]})[2])
    assert reply == {"prompt": "a b"}


def test_split_tokens_round_trips() -> None:
    for text in ("", "a", "  lead and trail  ", "x<|im_end|>\ny", "tab\tand\nnewline\n"):
        assert "".join(vs.split_tokens(text)) == text
    assert vs.split_tokens("x<|im_end|>\ny") == ["x", "<|im_end|>", "\ny"]


def test_read_weights_reads_every_safetensors_file_to_its_end(tmp_path: Path) -> None:
    (tmp_path / "model-00001.safetensors").write_bytes(b"a" * (9 * 1024 * 1024 + 5))
    (tmp_path / "model-00002.safetensors").write_bytes(b"b" * 7)
    (tmp_path / "config.json").write_text("{}")
    assert vs.read_weights(str(tmp_path)) == 9 * 1024 * 1024 + 12
    settings = vs.prepare(["serve", str(tmp_path)], {"STANDIN_READ_WEIGHTS": "1"})
    assert settings.read_weights
    assert not vs.prepare(["serve", str(tmp_path)], {}).read_weights


def test_the_lab_knob_fails_the_next_starts_as_vllm_does(
    sim_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    knob = sim_env / vs.FAIL_KNOB
    knob.parent.mkdir(parents=True, exist_ok=True)
    knob.write_text("2\n")
    argv = ["serve", "m", "--gpu-memory-utilization", "0.85"]
    expected = vs.memory_error(0, VRAM_TOTAL, 0.85)
    for left in ("1\n", None):
        assert vs.main(argv, {}) == 1
        assert f"ValueError: {expected}\n" in capsys.readouterr().err
        assert (knob.read_text() if knob.exists() else None) == left
    assert not vs.take_forced_failure(sim_env)  # gone: the next start is an ordinary one
    knob.write_text("garbage")
    assert not vs.take_forced_failure(sim_env)


# ----------------------------------------------------------------------------- vLLM's own key


@pytest.fixture
def keyed(sim_env: Path) -> Iterator[vs.VllmServer]:
    """A server started with two keys on the command line over another in VLLM_API_KEY."""
    settings = vs.prepare(
        ["serve", "m", "--served-model-name", "qwen", "--max-model-len", "4096",
         "--api-key", "key-one", "key-two"],
        {"STANDIN_TOKEN_SECONDS": "0", "VLLM_API_KEY": "env-key"},
    )  # fmt: skip
    srv = vs.make_server(settings, None, port=0)
    srv.server_address = ("127.0.0.1", srv.server_address[1])
    serve_in_thread(srv)
    yield srv
    srv.shutdown()
    srv.server_close()


ONE_TOKEN = {"model": "qwen", "prompt": "hi", "max_tokens": 1}


@pytest.mark.parametrize(
    ("method", "path", "body", "authorization", "status"),
    [
        # every path under /v1 needs a key, before routing (an unknown one too) and before
        # the media type is looked at
        ("POST", "/v1/completions", ONE_TOKEN, None, 401),
        ("POST", "/v1/chat/completions", {"messages": []}, None, 401),
        ("GET", "/v1/models", None, None, 401),
        ("GET", "/v1/nothing-here", None, None, 401),
        # and under vLLM 0.32's three other guarded prefixes
        ("GET", "/v2/nothing-here", None, None, 401),
        ("POST", "/inference/v1/generate", ONE_TOKEN, None, 401),
        ("GET", "/cohere/nothing-here", None, None, 401),
        ("GET", "/v2/nothing-here", None, "Bearer key-one", 404),
        ("POST", "/v1/completions", ONE_TOKEN, "Bearer wrong", 401),
        ("POST", "/v1/completions", ONE_TOKEN, "Basic key-one", 401),
        # uvicorn strips the blanks around a header's value: real vLLM 0.32 takes the key
        # with a trailing space (tests/fixtures/vllm/api-key-answers.json)
        ("POST", "/v1/completions", ONE_TOKEN, "Bearer key-one ", 200),
        ("POST", "/v1/completions", ONE_TOKEN, "Bearer  key-one", 401),
        # --api-key wins over VLLM_API_KEY
        ("POST", "/v1/completions", ONE_TOKEN, "Bearer env-key", 401),
        ("POST", "/v1/completions", ONE_TOKEN, "Bearer key-one", 200),
        ("POST", "/v1/completions", ONE_TOKEN, "bearer key-two", 200),
        ("GET", "/v1/models", None, "Bearer key-two", 200),
        ("GET", "/v1/nothing-here", None, "Bearer key-one", 404),
        # the rest stays open, as vLLM's middleware leaves it
        ("GET", "/health", None, None, 200),
        ("GET", "/ping", None, None, 200),
        ("GET", "/metrics", None, None, 200),
        ("GET", "/version", None, None, 200),
        ("POST", "/tokenize", {"prompt": "hi"}, None, 200),
    ],
)
def test_the_key_guards_vllms_prefixes_only(
    keyed: vs.VllmServer,
    method: str,
    path: str,
    body: Any,
    authorization: str | None,
    status: int,
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    answer, head, raw = request(port_of(keyed), method, path, body, headers)
    assert answer == status, raw
    if status == 401:
        # byte for byte as vLLM's JSONResponse(content={"error": "Unauthorized"})
        assert (raw, head["content-type"]) == (b'{"error":"Unauthorized"}', "application/json")


@pytest.mark.parametrize(
    ("argv", "env", "keys"),
    [
        ([], {}, ()),
        ([], {"VLLM_API_KEY": ""}, ()),
        ([], {"VLLM_API_KEY": "from-env"}, ("from-env",)),
        (["--api-key", "a"], {"VLLM_API_KEY": "from-env"}, ("a",)),
        (["--api-key", "a", "b"], {}, ("a", "b")),
    ],
)
def test_the_keys_come_from_the_flag_else_the_environment(
    argv: list[str], env: dict[str, str], keys: tuple[str, ...]
) -> None:
    assert vs.prepare(["serve", "m", *argv], env).api_keys == keys


def test_without_a_key_v1_is_open(server: vs.VllmServer) -> None:
    assert request(port_of(server), "POST", "/v1/completions", ONE_TOKEN)[0] == 200
