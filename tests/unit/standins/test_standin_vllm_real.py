"""vllm_standin.py as a real process, held to what the real vLLM does (issue 28).

Each test starts the stand-in (``python3 lab/standins/vllm_standin.py serve ...``) on a free
port and checks one behaviour recorded from a real vLLM: the start rules of both generations
(before and after vllm-project/vllm PR #56446), the KV-cache start failure's log in its real
length with the root cause in the middle, abort accounting, engine death ending the server,
and the 400 for a JSON body sent as ``text/plain``.  The recorded answers and logs are in
``tests/fixtures/vllm/`` (see its README for where they came from).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm_standin as vs
from standin_testlib import request, wait_for

from cardshare.errors import ErrorKind, classify_tail

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "lab" / "standins" / "vllm_standin.py"
FIXTURES = ROOT / "tests" / "fixtures" / "vllm"
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768}
YARN_15 = {"rope_type": "yarn", "factor": 1.5, "original_max_position_embeddings": 32768}
ROOT_CAUSE = "larger than the available KV cache memory"
LAST_LINE = "RuntimeError: Engine core initialization failed. See root cause above."


def lines_of(text: str) -> list[str]:
    """Lines ended by a newline, as Docker's log tail counts them."""
    return text.removesuffix("\n").split("\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def model_dir(tmp_path: Path, **config: Any) -> Path:
    """A model directory whose config.json is a Qwen2.5-7B-shaped one (32k native)."""
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    base = {
        "architectures": ["Qwen2ForCausalLM"],
        "max_position_embeddings": 32768,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_size": 3584,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps({**base, **config}))
    return path


class Vllm:
    """One stand-in process; stdout and stderr go to one file the test reads."""

    def __init__(self, tmp_path: Path, *argv: str, **env: str) -> None:
        self.port = free_port()
        self.log = tmp_path / f"vllm-{self.port}.log"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("STANDIN_")}
        environ.update(
            {
                "CARDSHARE_SIM_ROOT": str(tmp_path / "no-card"),
                "STANDIN_LOAD_SECONDS": "0",
                "STANDIN_RELEASE_SECONDS": "0",
                "STANDIN_TOKEN_SECONDS": "0",
                "PYTHONDONTWRITEBYTECODE": "1",
                **env,
            }
        )
        command = [sys.executable, str(SCRIPT), "serve", *argv]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environ)

    def up(self) -> Vllm:
        def answers() -> bool:
            assert self.proc.poll() is None, self.output()
            try:
                return request(self.port, "GET", "/health")[0] == 200
            except OSError:
                return False

        wait_for(answers, "the stand-in's port")
        return self

    def exit_code(self, limit: float = 20.0) -> int:
        return self.proc.wait(timeout=limit)

    def output(self) -> str:
        return self.log.read_bytes().decode(errors="replace")  # "\r" kept

    def vllm_lines(self) -> list[str]:
        """The output's lines as ``docker logs`` counts them (ended by a newline; the real
        banner has carriage returns inside lines), without the stand-in's ``SIMULATION:``
        lines."""
        return [line for line in lines_of(self.output()) if not line.startswith("SIMULATION:")]

    def models(self) -> list[tuple[str, int]]:
        data = json.loads(request(self.port, "GET", "/v1/models")[2])["data"]
        return [(m["id"], m["max_model_len"]) for m in data]

    def metrics(self) -> str:
        return request(self.port, "GET", "/metrics")[2].decode()


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Vllm]]:
    started: list[Vllm] = []

    def run(*argv: str, **env: str) -> Vllm:
        server = Vllm(tmp_path, *argv, **env)
        started.append(server)
        return server

    yield run
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=10)


def too_long(requested: int, derived: str) -> str:
    return (
        f"User-specified max_model_len ({requested}) is greater than the derived max_model_len "
        f"(max_position_embeddings={derived} or model_max_length=None in model's config.json)."
    )


# -- start rules of both generations ----------------------------------------------------------


def overrides(rope: dict[str, Any], max_len: int | None = None) -> str:
    doc: dict[str, Any] = {"rope_scaling": rope}
    if max_len is not None:
        doc["max_position_embeddings"] = max_len
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("rules", "length", "hf", "refused"),
    [
        # pre-56446 (the pinned llm-scaler 0.21): original x factor
        ("0.21", 65536, overrides(YARN), None),
        ("pre-56446", 49152, overrides(YARN_15), None),
        ("0.21", 65536, overrides(YARN, 65536), None),
        ("0.21", 131072, overrides(YARN), "65536.0"),
        # post-56446 (upstream 0.32): max_position_embeddings of the merged config
        ("0.32", 65536, overrides(YARN), "32768.0"),
        ("post-56446", 49152, overrides(YARN_15), "32768.0"),
        ("0.32", 65536, overrides(YARN, 65536), None),
        ("0.32.0", 49152, overrides(YARN_15, 49152), None),
        ("0.32", 32768, None, None),
    ],
)
def test_start_rules_of_both_generations(
    tmp_path: Path, start: Callable[..., Vllm], rules: str, length: int, hf: str | None,
    refused: str | None,
) -> None:  # fmt: skip
    argv = [str(model_dir(tmp_path)), "--served-model-name", "qwen", "--max-model-len", str(length)]
    if hf is not None:
        argv += ["--hf-overrides", hf]
    server = start(*argv, "--vllm-rules", rules)
    if refused is None:
        assert server.up().models() == [("qwen", length)]
        return
    assert server.exit_code() == 1
    assert too_long(length, refused) in server.output()


_YARN_TF5 = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize(
    ("rules", "config", "derived"),
    [
        # transformers 5's key, as the vllm role writes it for the llm-scaler images
        ("pre-56446", {"max_position_embeddings": 32768, "rope_parameters": _YARN_TF5}, 65536.0),
        ("pre-56446", {"max_position_embeddings": 65536, "rope_parameters": _YARN_TF5}, 65536.0),
        ("post-56446", {"max_position_embeddings": 32768, "rope_parameters": _YARN_TF5}, 32768.0),
        ("post-56446", {"max_position_embeddings": 65536, "rope_parameters": _YARN_TF5}, 65536.0),
        # a transformers 5 config's own default RoPE (only the base) scales nothing
        (
            "pre-56446",
            {
                "max_position_embeddings": 32768,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            },
            32768.0,
        ),
    ],
)
def test_the_window_from_rope_parameters(
    rules: str, config: dict[str, Any], derived: float
) -> None:
    assert vs.derived_max_model_len(config, rules) == derived


def test_the_rules_knob_from_the_environment(tmp_path: Path, start: Callable[..., Vllm]) -> None:
    argv = [str(model_dir(tmp_path)), "--max-model-len", "65536", "--hf-overrides", overrides(YARN)]
    assert start(*argv, STANDIN_VLLM_RULES="0.32").exit_code() == 1
    # the flag wins over the environment
    assert start(*argv, "--vllm-rules", "0.21", STANDIN_VLLM_RULES="0.32").up().models()


def test_the_default_rules_are_the_pinned_images(tmp_path: Path) -> None:
    argv = ["serve", str(model_dir(tmp_path)), "--max-model-len", "65536"]
    settings = vs.prepare([*argv, "--hf-overrides", overrides(YARN)], {})
    assert (settings.rules, settings.max_model_len) == (vs.RULES_PRE, 65536)


@pytest.mark.parametrize(
    ("value", "rules"),
    [
        ("0.21", "pre-56446"),
        ("0.21.0-b2", "pre-56446"),
        ("0.14", "pre-56446"),
        ("pre-56446", "pre-56446"),
        ("0.32", "post-56446"),
        ("v0.33.1", "post-56446"),
        ("1.0", "post-56446"),
        ("POST-56446", "post-56446"),
    ],
)
def test_rules_names_and_versions(value: str, rules: str) -> None:
    assert vs.parse_rules(value) == rules


@pytest.mark.parametrize("value", ["0.25", "latest", ""])
def test_an_unknown_generation_is_refused_naming_the_knob(value: str) -> None:
    with pytest.raises(vs.StartupError) as caught:
        vs.parse_rules(value)
    assert str(caught.value).startswith(f"--vllm-rules (or STANDIN_VLLM_RULES) is {value!r}:")
    assert "pre-56446" in str(caught.value) and "post-56446" in str(caught.value)


# -- the KV-cache start failure: the real log in its real length -------------------------------


# the conformance lane's model and command line (tests/fixtures/vllm/README.md)
TINY_QWEN2 = {
    "max_position_embeddings": 32768,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "hidden_size": 64,
    "torch_dtype": "bfloat16",
}
RECORDED_ARGV = [
    "--served-model-name", "Qwen2.5-7B-Instruct", "--gpu-memory-utilization", "0.61",
    "--max-model-len", "32768", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
]  # fmt: skip


def kv_failure(tmp_path: Path, start: Callable[..., Vllm]) -> Vllm:
    """The recorded case (a): 1 MiB of KV cache (the CPU backend's blocks of 128 tokens)."""
    model = model_dir(tmp_path, **TINY_QWEN2)
    server = start(str(model), *RECORDED_ARGV, "--kv-cache-memory-bytes", "1048576",
                   "--block-size", "128")  # fmt: skip
    assert server.exit_code() == 1
    return server


def root_cause_at(lines: list[str]) -> list[int]:
    return [n for n, line in enumerate(lines, 1) if ROOT_CAUSE in line]


def recorded(name: str) -> str:
    return (FIXTURES / name).read_bytes().decode("utf-8")


def test_a_kv_cache_start_failure_prints_the_real_log_in_its_real_length(
    tmp_path: Path, start: Callable[..., Vllm]
) -> None:
    lines = kv_failure(tmp_path, start).vllm_lines()
    real = lines_of(recorded(vs.KV_CACHE_LOG))
    assert len(lines) == len(real) == 167  # as the recording's README counts them
    assert root_cause_at(lines) == root_cause_at(real) == [74, 106]
    positions = root_cause_at(lines)
    last = [line for line in lines if line.startswith("RuntimeError")]
    assert last == [LAST_LINE + " Failed core proc(s): {}"]
    assert lines.index(last[0]) >= len(lines) - 3
    # the stand-in's own figures are the real server's: 32768 x 256 bytes against 1 MiB
    cause = vs.kv_cache_error(32768, 256, 1024**2, 128)
    assert cause is not None
    assert cause == vs.recorded_values("\n".join(real))["root_cause"]
    assert lines[positions[-1] - 1] == f"ValueError: {cause}"


def test_the_root_cause_is_not_in_the_last_50_lines_but_the_whole_log_is_memory(
    tmp_path: Path, start: Callable[..., Vllm]
) -> None:
    """What the arbiter reads decides: the last 50 lines (``logs_tail(lines=50)``, what the
    current arbiter reads) are the API server's traceback alone; the whole failed start's log
    is classified as a lack of memory."""
    lines = kv_failure(tmp_path, start).vllm_lines()
    assert ROOT_CAUSE not in "\n".join(lines[-50:])
    assert classify_tail("\n".join(lines[-50:])).kind is ErrorKind.OTHER
    verdict = classify_tail("\n".join(lines))
    assert (verdict.kind, verdict.pattern) == (
        ErrorKind.INSUFFICIENT_VRAM,
        "vllm_kv_cache_too_small",
    )


def normalised(text: str) -> list[str]:
    """Times and pids out: the bytes that differ between any two runs of the real server."""
    text = vs.render_recorded_log(text, {"time": "<time>"})
    return vs.PROCESS_TAG.sub(lambda m: f"({m[1]} pid=<pid>)", text).splitlines()


def as_recorded(tmp_path: Path, server: Vllm, name: str) -> list[str]:
    """The stand-in's log of a failed start with the recording's model path and port put
    back, times and pids out."""
    real = vs.recorded_values(recorded(name))
    mine = vs.recorded_values("\n".join(server.vllm_lines()))
    assert mine["model"] == str(tmp_path / "model")
    assert mine.get("port") == (str(server.port) if "port" in real else None)
    back = {k: real[k] for k in ("model", "port") if k in real}
    return normalised(vs.render_recorded_log("\n".join(server.vllm_lines()), back))


def test_the_kv_cache_failure_is_the_recording_byte_for_byte(
    tmp_path: Path, start: Callable[..., Vllm]
) -> None:
    """Run as the recorded case, the stand-in prints the real log: every byte but times, pids,
    the model's path and the port (its own), the figures computed, not copied."""
    server = kv_failure(tmp_path, start)
    assert as_recorded(tmp_path, server, vs.KV_CACHE_LOG) == normalised(recorded(vs.KV_CACHE_LOG))


def test_the_yarn_refusal_is_the_recording_byte_for_byte(
    tmp_path: Path, start: Callable[..., Vllm]
) -> None:
    """Recorded case (b): the role's rung 0 under vLLM 0.32's rules."""
    model = model_dir(tmp_path, **TINY_QWEN2)
    argv = [a if a != "0.61" else "0.70" for a in RECORDED_ARGV]
    argv = [a if a != "32768" else "65536" for a in argv]
    server = start(str(model), *argv, "--hf-overrides", json.dumps({"rope_scaling": YARN}),
                   "--vllm-rules", "0.32")  # fmt: skip
    assert server.exit_code() == 1
    assert as_recorded(tmp_path, server, vs.YARN_REFUSAL_LOG) == normalised(
        recorded(vs.YARN_REFUSAL_LOG)
    )


def test_an_unknown_tool_call_parser_is_the_recording_byte_for_byte(
    tmp_path: Path, start: Callable[..., Vllm]
) -> None:
    """Recorded case (d): ``--tool-call-parser nosuchparser`` under vLLM 0.32's rules (its
    list of parsers)."""
    model = model_dir(tmp_path, **TINY_QWEN2)
    argv = [a if a != "hermes" else "nosuchparser" for a in RECORDED_ARGV]
    server = start(str(model), *argv, "--vllm-rules", "0.32")
    assert server.exit_code() == 1
    assert as_recorded(tmp_path, server, vs.UNKNOWN_PARSER_LOG) == normalised(
        recorded(vs.UNKNOWN_PARSER_LOG)
    )


def test_a_bad_flag_value_exits_2_as_the_real_one(
    tmp_path: Path, start: Callable[..., Vllm]
) -> None:
    """Recorded case (c): argparse's usage line and error, exit 2."""
    server = start(str(model_dir(tmp_path)), *RECORDED_ARGV, "--max-num-seqs", "lots")
    assert server.exit_code() == 2
    real = [line for line in lines_of(recorded("bad-flag-value.log")) if "Triton" not in line]
    assert server.vllm_lines() == real


def test_the_stand_ins_logs_are_the_recordings() -> None:
    for name in (
        vs.KV_CACHE_LOG,
        vs.YARN_REFUSAL_LOG,
        vs.UNKNOWN_PARSER_LOG,
        vs.ENGINE_KILLED_LOG,
    ):
        assert (vs.LOGS / name).read_bytes() == (FIXTURES / name).read_bytes(), name


def test_the_lab_knob_forces_a_kv_cache_failure(
    tmp_path: Path, card_root: Path, start: Callable[..., Vllm]
) -> None:
    root = card_root
    knob = root / vs.FAIL_KNOB
    knob.parent.mkdir(parents=True)
    knob.write_text("1 kv-cache\n")
    server = start(str(model_dir(tmp_path, max_position_embeddings=65536)), "--max-model-len",
                   "65536", CARDSHARE_SIM_ROOT=str(root))  # fmt: skip
    assert server.exit_code() == 1
    lines = server.vllm_lines()
    assert len(lines) == len(lines_of(recorded(vs.KV_CACHE_LOG)))
    # half of what one request needs: 65536 x 57344 bytes = 3.5 GiB
    assert "(1.75 GiB)" in lines[root_cause_at(lines)[0] - 1]
    assert not knob.exists()
    assert list((root / "proc").iterdir()) == []  # its memory went with it


# -- abort accounting --------------------------------------------------------------------------


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} {labels} missing")


def success_series(text: str) -> dict[str, float]:
    return {
        reason: metric(text, "vllm:request_success_total", finished_reason=reason)
        for reason in vs.FINISHED_REASONS
    }


def test_the_recording_counts_no_aborted_request() -> None:
    """The real server streaming one request, then after its client hung up: the request is
    gone from the running gauge and no finished_reason series moved."""
    busy = (FIXTURES / "metrics-busy-streaming.txt").read_text()
    after = (FIXTURES / "metrics-after-abort.txt").read_text()
    assert metric(busy, "vllm:num_requests_running") == 1.0
    assert metric(after, "vllm:num_requests_running") == 0.0
    assert success_series(after) == success_series(busy)


def test_a_client_aborted_request_is_not_counted_as_a_success(
    tmp_path: Path, start: Callable[..., Vllm]
) -> None:
    server = start(str(model_dir(tmp_path)), STANDIN_TOKEN_SECONDS="0.2").up()
    body = json.dumps({"prompt": "x", "max_tokens": 10, "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.read1(64)  # the stream began
    conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    conn.close()
    wait_for(lambda: metric(server.metrics(), "vllm:num_requests_running") == 0.0, "the abort")
    assert success_series(server.metrics()) == dict.fromkeys(vs.FINISHED_REASONS, 0.0)
    ok = request(server.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert ok[0] == 200
    assert metric(server.metrics(), "vllm:request_success_total", finished_reason="length") == 1.0


# -- engine death ends the server --------------------------------------------------------------


def killed_answers() -> dict[str, Any]:
    return dict(json.loads((FIXTURES / "engine-killed-answers.json").read_text()))


def test_engine_death_answers_500_and_503_with_the_real_bodies(
    tmp_path: Path, start: Callable[..., Vllm]
) -> None:
    recorded = killed_answers()
    server = start(
        str(model_dir(tmp_path)),
        STANDIN_TOKEN_SECONDS="0.05",
        STANDIN_ENGINE_DEATH_SECONDS="5",
        STANDIN_ENGINE_EXIT_SECONDS="6",
    ).up()
    in_flight: dict[str, Any] = {}

    def long_completion() -> None:
        body = {"prompt": "x", "max_tokens": 14}
        in_flight["answer"] = request(server.port, "POST", "/v1/completions", body)

    thread = threading.Thread(target=long_completion)
    thread.start()
    wait_for(lambda: metric(server.metrics(), "vllm:num_requests_running") == 1.0, "a request")
    assert request(server.port, "POST", "/cardshare-sim/kill-engine")[0] == 200
    thread.join(10)
    status, headers, body = in_flight["answer"]
    assert (status, body.decode()) == (500, recorded["in_flight_request"]["body"])
    assert headers["content-type"] == "application/json"
    status, _, body = request(server.port, "POST", "/v1/completions", {"prompt": "x"})
    assert (status, body.decode()) == tuple(recorded["polls"][0]["completion"])
    assert request(server.port, "GET", "/health")[0::2] == (503, b"")
    assert server.exit_code() == vs.ENGINE_DEATH_EXIT


def test_engine_death_ends_the_server_as_the_real_one(
    tmp_path: Path, start: Callable[..., Vllm]
) -> None:
    """The recorded timeline: the port refuses connections about 0.2 s after the death while
    the process lives on (about 1.8 s in all), then it exits; its log says what the real
    server's did."""
    polls = killed_answers()["polls"]
    refused = min(p["t"] for p in polls if p["health"][0] is None)
    gone = min(p["t"] for p in polls if not p["api_server_alive"])
    assert refused < gone  # what the recording shows, and the stand-in's defaults follow
    settings = vs.prepare(["serve", "m"], {})
    assert settings.death_seconds <= refused + 0.1 and settings.exit_seconds <= gone + 0.1

    server = start(str(model_dir(tmp_path)), "--served-model-name", "qwen").up()
    server.proc.send_signal(signal.SIGUSR1)

    def refused_now() -> bool:
        try:
            request(server.port, "GET", "/health")
        except OSError:
            return True
        return False

    # a bound for a loaded machine (the recording's 0.2 s is checked on the settings above)
    try:
        wait_for(refused_now, "the port to refuse connections", limit=30.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the stand-in's output:\n{server.output()}") from None
    exit_note = (FIXTURES / "engine-killed-exit.md").read_text()
    found = re.search(r"exited with code (\d+)", exit_note)
    assert found is not None
    assert server.exit_code() == vs.ENGINE_DEATH_EXIT == int(found[1])
    log = server.output()
    assert "EngineDeadError: EngineCore encountered an issue." in log
    assert "MPClient: engine core exited unexpectedly" in log
    assert f"INFO:     Finished server process [{server.proc.pid}]" in log
    assert "/.cache/conformance" not in log and ' - "POST ' not in log


# -- a JSON body sent as text/plain ------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("text/plain", 400),
        (None, 400),
        ("application/x-www-form-urlencoded", 400),
        ("application/json", 200),
        ("Application/JSON; charset=utf-8", 200),
    ],
)
def test_a_body_that_is_not_application_json_gets_400(
    tmp_path: Path, start: Callable[..., Vllm], content_type: str | None, status: int
) -> None:
    server = start(str(model_dir(tmp_path))).up()
    headers = {} if content_type is None else {"Content-Type": content_type}
    raw = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    got, answer_headers, body = request(server.port, "POST", "/v1/completions", raw=raw,
                                        headers=headers)  # fmt: skip
    assert got == status, body
    if status == 400:
        recorded = json.loads((FIXTURES / "completions-text-plain-400.json").read_text())
        assert recorded["status"] == 400
        assert answer_headers["content-type"] == dict(recorded["headers"])["content-type"]
        assert body.decode() == recorded["body"]
        assert "Unsupported Media Type: Only 'application/json' is allowed" in body.decode()


def test_health_and_models_answer_as_the_real_server(
    tmp_path: Path, start: Callable[..., Vllm]
) -> None:
    server = start(str(model_dir(tmp_path)), "--served-model-name", "Qwen2.5-7B-Instruct").up()
    health = json.loads((FIXTURES / "health-200.json").read_text())
    status, headers, body = request(server.port, "GET", "/health")
    assert (status, body.decode()) == (health["status"], health["body"])
    recorded_headers = {k for k, _v in health["headers"]}
    assert ("content-type" in headers) == ("content-type" in recorded_headers)
    assert (FIXTURES / "models.status").read_text().strip() == "200"
    real = json.loads((FIXTURES / "models.json").read_text())
    status, _, body = request(server.port, "GET", "/v1/models")
    mine = json.loads(body)
    assert status == 200 and set(mine) == set(real)
    assert [set(m) for m in mine["data"]] == [set(m) for m in real["data"]]
    assert set(mine["data"][0]["permission"][0]) == set(real["data"][0]["permission"][0])
    keep = ("object", "owned_by", "parent")
    assert {k: mine["data"][0][k] for k in keep} == {k: real["data"][0][k] for k in keep}


# -- /metrics against the real server's ---------------------------------------------------------

SERIES = re.compile(r"^(vllm:[a-z_]+)\{([^}]*)\} (\S+)$")


def series(text: str) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """``vllm:`` samples by name: each one's labels, ``model_name`` left out."""
    out: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for line in text.splitlines():
        found = SERIES.match(line)
        if found is None:
            continue
        labels = tuple(
            sorted(
                (k, v) for k, v in re.findall(r'([a-z_]+)="([^"]*)"', found[2]) if k != "model_name"
            )
        )
        out.setdefault(found[1], set()).add(labels)
    return out


def test_idle_metrics_are_the_real_servers(tmp_path: Path, start: Callable[..., Vllm]) -> None:
    """Every ``vllm:`` family the stand-in exports has the real server's HELP and TYPE lines
    and series; those the arbiter reads have exactly the real server's series."""
    recorded = (FIXTURES / "metrics-idle.txt").read_text(encoding="utf-8")
    text = start(str(model_dir(tmp_path))).up().metrics()
    comments = [line for line in text.splitlines() if line.startswith(("# HELP vllm:", "# TYPE"))]
    assert comments and set(comments) <= set(recorded.splitlines())
    mine, real = series(text), series(recorded)
    for name, labels in mine.items():
        assert labels <= real.get(name, set()), name
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert mine[name] == real[name]
    assert mine["vllm:request_success_total"] == real["vllm:request_success_total"]
    assert {v for line in text.splitlines() if (m := SERIES.match(line)) for v in [m[3]]} == {"0.0"}


# -- vLLM's own key (VLLM_API_KEY), against the real server's answers ---------------------------

KEY_ANSWERS = FIXTURES / "api-key-answers.json"


def key_cases() -> list[tuple[str, dict[str, Any]]]:
    return sorted(json.loads(KEY_ANSWERS.read_text(encoding="utf-8")).items())


def test_the_key_recording_is_the_roles_claim() -> None:
    """What the role's README says of the key, in the real server's answers: /v1 asks for it
    (401 ``{"error":"Unauthorized"}``), /health and /metrics answer without it."""
    answers = dict(key_cases())
    for case in ("GET /v1/models, no key", "POST /v1/chat/completions, no key"):
        assert (answers[case]["status"], answers[case]["body"]) == (401, '{"error":"Unauthorized"}')
    for case in ("GET /v1/models, the key", "POST /v1/chat/completions, the key"):
        assert answers[case]["status"] == 200
    for case in ("GET /health, no key", "GET /metrics, no key"):
        assert answers[case]["status"] == 200


@pytest.mark.parametrize(("case", "real"), key_cases(), ids=[c for c, _ in key_cases()])
def test_the_key_answers_are_the_real_servers(
    tmp_path: Path, start: Callable[..., Vllm], case: str, real: dict[str, Any]
) -> None:
    """Each recorded request, sent to the stand-in given the key as the role gives it (the
    environment, not the command line): the real status and content type, and for a refusal
    the real body byte for byte."""
    key = "k" * 48
    server = start(
        str(model_dir(tmp_path)), "--served-model-name", "Qwen2.5-7B-Instruct", VLLM_API_KEY=key
    ).up()
    asked = real["request"]
    auth = asked["authorization"]
    headers = {} if auth is None else {"Authorization": auth.format(key=key)}
    status, mine, body = request(server.port, asked["method"], asked["path"], asked["json"],
                                 headers)  # fmt: skip
    recorded = dict(real["headers"])
    assert status == real["status"], body
    assert mine.get("content-type") == recorded.get("content-type")
    if status == 401:
        assert body.decode() == real["body"]
