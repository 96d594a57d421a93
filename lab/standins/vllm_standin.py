"""SIMULATION: a stand-in for vLLM (Intel llm-scaler image) in the cardshare lab.

This is not vLLM and runs no model.  It exists because the llm-scaler image cannot be
pulled in the lab.  It accepts ``vllm serve <model> [flags]`` for the flags the
collection uses, refuses what vLLM refuses (with vLLM's messages), and then serves an
OpenAI-shaped API with canned text:

* refusals (exit 1): ``--max-model-len`` above the model's window (``max_position_embeddings``
  from ``<model>/config.json``, else ``STANDIN_NATIVE_CONTEXT``, with ``--hf-overrides`` merged
  in; a YaRN ``rope_scaling`` counts as the generation's rules say, below); free memory of the
  simulated card below ``--gpu-memory-utilization`` x total; ``--enable-auto-tool-choice``
  without ``--tool-call-parser``; an unknown parser.  The window refusal and the unknown parser
  print the real server's recorded log (``vllm-logs/``) with this command line's values.
  Unknown flags and bad values exit 2 like argparse.
* start rules of two generations (``--vllm-rules``, else ``STANDIN_VLLM_RULES``, default
  ``0.21``, the pinned llm-scaler image's): ``pre-56446`` (``0.21`` and before) derives the
  window of a YaRN model as original x factor; ``post-56446`` (``0.32`` and after,
  vllm-project/vllm PR #56446) as ``max_position_embeddings`` of the merged config.
* the KV-cache start failure: when one request of ``--max-model-len`` needs more KV cache
  (2 x layers x KV heads x head size x dtype bytes per token, from the config) than
  ``--kv-cache-memory-bytes`` (else ``STANDIN_KV_CACHE_BYTES``), the start fails after the load
  time with the real server's recorded log (``vllm-logs/``, 167 lines, the root cause in the
  middle, the API server's traceback at the end), this start's figures put in, and exits 1.
* engine death (``POST /cardshare-sim/kill-engine`` or ``SIGUSR1``): requests in flight and new
  ones get the real 500 body, ``/health`` 503, for ``STANDIN_ENGINE_DEATH_SECONDS`` (0.2); then
  the port refuses connections and the process exits ``STANDIN_ENGINE_EXIT_SECONDS`` (1.8)
  after the death, printing the real server's log of that, as the recorded real API server.
* vLLM's own keys (``--api-key KEY [KEY ...]``, else ``VLLM_API_KEY``; none: open), as its
  ``AuthenticationMiddleware`` (0.32: ``vllm/entrypoints/serve/middleware/authenticate.py``):
  every path under ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` (unknown ones too) needs
  ``Authorization: Bearer <one of the keys>`` (the scheme in any case) and answers 401
  ``{"error":"Unauthorized"}`` without it; ``/health``, ``/ping``, ``/metrics``, ``/version``,
  ``/tokenize`` and ``/detokenize`` stay open (as real vLLM 0.32 answered them:
  tests/fixtures/vllm/api-key-answers.json).
* a client-aborted request is not counted in ``vllm:request_success_total``; a body whose
  ``Content-Type`` is not ``application/json`` gets vLLM's 400.
* the port is bound only after ``STANDIN_LOAD_SECONDS`` (default 2): before that,
  connections are refused, as with the real server while it loads the model.
* ``GET /health`` and ``GET|POST /ping`` (200 empty; 503 once the engine is "dead"),
  ``GET /v1/models`` (with ``max_model_len``), ``GET /version``, ``POST
  /v1/chat/completions`` and ``/v1/completions`` (``stream`` true/false, SSE chunks and
  ``data: [DONE]``, ``max_tokens``, tool-call shaped replies), ``POST /tokenize`` and
  ``/detokenize`` (vLLM's shapes), ``GET /metrics`` (Prometheus text with vLLM's metric names
  and true counts).  Request bodies may come with ``Content-Length`` or ``Transfer-Encoding:
  chunked``.
* the stand-in's tokenizer: a token is a word with the whitespace before it (special tokens
  such as ``<|im_start|>`` alone, at Qwen2's ids); other ids are numbered as pieces are first
  seen, so ``/detokenize`` inverts ``/tokenize`` for the server's lifetime.  Chat prompts
  are rendered with a ChatML template first.  Usage counts and the context check use the
  same tokens ``/tokenize`` returns.
* while it runs it is a client of the simulated card (``simcard.py``): resident VRAM =
  utilisation x total, ``ccs``/``rcs`` cycles advancing while requests run.

Environment: ``STANDIN_LOAD_SECONDS`` (2), ``STANDIN_TOKEN_SECONDS`` (0.01),
``STANDIN_NATIVE_CONTEXT`` (32768), ``STANDIN_MAX_RUNNING`` (``--max-num-seqs``),
``STANDIN_RELEASE_SECONDS`` (1), ``STANDIN_READ_WEIGHTS`` (unset; ``1``: read every
``*.safetensors`` of the model to its end after the load time, as the loader does),
``STANDIN_VLLM_RULES`` (``0.21``), ``STANDIN_KV_CACHE_BYTES`` (unset: no KV-cache check),
``STANDIN_ENGINE_DEATH_SECONDS`` (0.2), ``STANDIN_ENGINE_EXIT_SECONDS`` (1.8),
``CARDSHARE_SIM_ROOT``, ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``.

Lab knob (fault injection, outside vLLM's interface): a file
``<CARDSHARE_SIM_ROOT>/lab/vllm-fail-next-starts`` holding a count N makes the next N starts
fail as vLLM does when the card's memory is taken between a measure and the load (vLLM's
own insufficient-memory message, with the card's free memory read as 0); ``N kv-cache`` makes
them fail with the KV-cache start failure instead (the cache available read as half of what one
request needs).  Each failing start takes one from the count and the file goes at 0.
``<CARDSHARE_SIM_ROOT>/lab/vllm-hold-card`` holding ``<PCI address> <seconds>`` makes the next
stop leave that card's memory held for those seconds past the exit (the driver freeing a dead
rank's memory late; the lab host's reaper removes the entry then) while the other cards release
after ``STANDIN_RELEASE_SECONDS``; the stop takes the file.

Tensor parallelism: with ``--tensor-parallel-size N`` the stand-in is a client of N cards, one
per rank as real vLLM's workers each open their own card, each holding the utilisation of its
card: the cards ``CARDSHARE_SIM_CARD`` names (addresses or render nodes separated by spaces
or commas), else the simulated host's first N cards with memory.  Each rank checks its own
card's free memory at start, and fewer cards than N is an error.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import math
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simcard import SimClient, card_choices
from standin_http import BadChunkedBody, Handler, StandinServer, read_chunked, serve_in_thread

__all__ = [
    "ENGINE_COMM",
    "Engine",
    "Settings",
    "StartupError",
    "Vocabulary",
    "build_parser",
    "context_error",
    "derived_max_model_len",
    "load_model_config",
    "main",
    "make_server",
    "memory_error",
    "parse_args",
    "prepare",
    "read_chunked",
    "render_chat",
    "reply_tokens",
    "split_tokens",
]

VERSION = "0.21.0+standin (SIMULATION)"
ENGINE_COMM = "VLLM::EngineCor"  # comm is cut to 15 characters, as the kernel does
DEVICE = "xpu:0"
GIB = 1024**3

TOOL_PARSERS = (
    "deepseek_v3",
    "deepseek_v31",
    "glm45",
    "granite",
    "hermes",
    "hunyuan_a13b",
    "internlm",
    "jamba",
    "kimi_k2",
    "llama3_json",
    "llama4_json",
    "llama4_pythonic",
    "minimax",
    "mistral",
    "openai",
    "phi4_mini_json",
    "pythonic",
    "qwen3_coder",
    "qwen3_xml",
    "seed_oss",
    "step3",
    "xlam",
)
# upstream vLLM 0.32's parsers, as its refusal lists them (vllm-logs/unknown-tool-call-parser.log)
TOOL_PARSERS_POST = (
    "apertus",
    "cohere_command3",
    "cohere_command4",
    "deepseek_v3",
    "deepseek_v31",
    "deepseek_v32",
    "deepseek_v4",
    "deepseek_v41",
    "dots",
    "ernie45",
    "functiongemma",
    "gemma4",
    "gigachat3",
    "glm45",
    "glm47",
    "granite",
    "granite-20b-fc",
    "granite4",
    "hermes",
    "hf",
    "hunyuan_a13b",
    "hy_v3",
    "hy_v4",
    "inkling",
    "internlm",
    "jamba",
    "k2_horizon",
    "kimi_k2",
    "kimi_k3",
    "lfm2",
    "ling3",
    "llama3_json",
    "llama4_json",
    "llama4_pythonic",
    "longcat",
    "mimo",
    "minicpm5",
    "minimax_m2",
    "minimax_m3",
    "mistral",
    "muse_glimmer",
    "olmo3",
    "openai",
    "phi4_mini_json",
    "plamo3",
    "poolside_v1",
    "pythonic",
    "qwen3_coder",
    "qwen3_json",
    "qwen3_xml",
    "seed_oss",
    "step3",
    "step3p5",
    "xlam",
)
QUANTIZATIONS = (
    "awq",
    "awq_marlin",
    "bitsandbytes",
    "compressed-tensors",
    "fp8",
    "gguf",
    "gptq",
    "gptq_marlin",
    "inc",
    "ipex",
    "mxfp4",
    "sym_int4",
)
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
REPLY = "This is a simulated reply from the cardshare lab stand-in for vLLM ."
SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
}
_PIECE = re.compile(r"<\|[a-z_]+\|>|\s*(?:(?!<\|[a-z_]+\|>)\S)+|\s+")


class StartupError(Exception):
    """vLLM would refuse to start; ``str()`` is the message it prints."""


# --------------------------------------------------------------------------- arguments


def _bool_flag(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(name, action=argparse.BooleanOptionalAction, default=None)


def build_parser() -> argparse.ArgumentParser:
    """The ``vllm serve`` command line, for the flags the collection uses."""
    parser = argparse.ArgumentParser(
        prog="vllm serve", usage="vllm serve [model_tag] [options]", description="SIMULATION"
    )
    parser.add_argument("model_tag", nargs="?", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--hf-overrides", type=json.loads, default=None)
    parser.add_argument("--enable-auto-tool-choice", action="store_true")
    parser.add_argument("--tool-call-parser", default=None)
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    parser.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=None)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--disable-sliding-window", action="store_true")
    parser.add_argument("--disable-log-requests", action="store_true")
    parser.add_argument("--distributed-executor-backend", default=None)
    # several keys may be given; any of them is let in (vLLM's AuthenticationMiddleware)
    parser.add_argument("--api-key", nargs="+", default=None)
    # the stand-in's own knob (not vLLM's): which generation's start rules apply
    parser.add_argument("--vllm-rules", default=None)
    _bool_flag(parser, "--enable-prefix-caching")
    return parser


def _normalise(argv: Sequence[str]) -> list[str]:
    """Drop a leading ``serve``; accept ``--flag_name`` like vLLM's flexible parser."""
    args = list(argv)
    if args and args[0] == "serve":
        args = args[1:]
    out = []
    for arg in args:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse like ``vllm serve`` (argparse exits 2 on an unknown flag)."""
    return build_parser().parse_args(_normalise(argv))


# --------------------------------------------------------------------------- decisions


def _deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_model_config(
    model: str, hf_overrides: Mapping[str, Any] | None, env: Mapping[str, str]
) -> dict[str, Any]:
    """``<model>/config.json`` when present (else the native window from the environment),
    with ``--hf-overrides`` merged in as vLLM does."""
    config: dict[str, Any]
    path = Path(model) / "config.json"
    try:
        loaded = json.loads(path.read_text())
        config = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        config = {}
    if "max_position_embeddings" not in config:
        config["max_position_embeddings"] = int(env.get("STANDIN_NATIVE_CONTEXT", "32768"))
    return _deep_merge(config, hf_overrides or {})


# The two generations of vLLM's start rules (``--vllm-rules`` / ``STANDIN_VLLM_RULES``).
# vllm-project/vllm PR #56446 ("stop re-scaling max_model_len", September 2026) changed how
# a YaRN ``rope_scaling`` counts in the derived window: before it, original x factor; since
# it, ``max_position_embeddings`` of the merged config.  The llm-scaler 0.21 image is before
# the change; upstream 0.32 (the conformance lane's real server) after it.
RULES_PRE = "pre-56446"
RULES_POST = "post-56446"
DEFAULT_RULES = "0.21"  # the pinned llm-scaler image's generation
_RULES_NAMES = {
    RULES_PRE: RULES_PRE,
    "0.21": RULES_PRE,
    "old": RULES_PRE,
    RULES_POST: RULES_POST,
    "0.32": RULES_POST,
    "new": RULES_POST,
}
# versions known to be on one side of the change; between them nobody has checked
_LAST_PRE = (0, 21)
_FIRST_POST = (0, 32)


def parse_rules(value: str) -> str:
    """``pre-56446`` or ``post-56446`` from a knob value: a name or a vLLM version."""
    text = value.strip().lower()
    if text in _RULES_NAMES:
        return _RULES_NAMES[text]
    match = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.\d+)?(?:[+.-].*)?", text)
    if match is not None:
        version = (int(match[1]), int(match[2]))
        if version <= _LAST_PRE:
            return RULES_PRE
        if version >= _FIRST_POST:
            return RULES_POST
    raise StartupError(
        f"--vllm-rules (or STANDIN_VLLM_RULES) is {value!r}: not a generation the stand-in "
        f"knows. Use {RULES_PRE} (or 0.21 and before) or {RULES_POST} (or 0.32 and after); "
        "versions between are not known to be on either side of vLLM PR #56446"
    )


def derived_max_model_len(config: Mapping[str, Any], rules: str = RULES_PRE) -> float:
    """The window vLLM derives from a model config (``_get_and_verify_max_len``).

    ``pre-56446``: a YaRN ``rope_scaling`` (``rope_parameters`` under transformers 5) makes it
    ``original_max_position_embeddings`` x ``factor``; other scalings (not ``su``,
    ``longrope``, ``llama3``) multiply ``max_position_embeddings`` by ``factor``.
    ``post-56446``: YaRN no longer re-scales, the window is ``max_position_embeddings`` of the
    config merged with ``--hf-overrides``; the other scalings are kept as before (not checked
    against a real server).
    """
    derived = float(config["max_position_embeddings"])
    rope = config.get("rope_scaling")
    params = config.get("rope_parameters")
    # transformers 5 (the llm-scaler images, vLLM 0.32) names the RoPE settings
    # ``rope_parameters``; its ``default`` type carries only the base and scales nothing
    if isinstance(params, Mapping) and params.get("rope_type", "default") != "default":
        rope = params
    if isinstance(rope, Mapping):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "yarn" and rules == RULES_POST:
            return derived
        if rope_type not in ("su", "longrope", "llama3"):
            factor = float(rope.get("factor", 1.0))
            if rope_type == "yarn":
                derived = float(rope.get("original_max_position_embeddings", derived))
            derived *= factor
    return derived


def context_error(
    max_model_len: int | None, config: Mapping[str, Any], rules: str = RULES_PRE
) -> str | None:
    """vLLM's refusal of a ``--max-model-len`` above the derived window, or ``None``."""
    derived = derived_max_model_len(config, rules)
    if max_model_len is None or max_model_len <= derived:
        return None
    return (
        f"User-specified max_model_len ({max_model_len}) is greater than the derived "
        f"max_model_len (max_position_embeddings={derived} or model_max_length=None in "
        "model's config.json). To allow overriding this maximum, set the env var "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with "
        "extreme caution. If the model uses relative position encoding (RoPE), positions "
        "exceeding derived_max_model_len lead to nan. If the model uses absolute position "
        "encoding, positions exceeding derived_max_model_len will cause a CUDA array "
        "out-of-bounds error."
    )


def _gib(value: float) -> float:
    return round(value / GIB, 2)


def memory_error(free: int, total: int, utilization: float, device: str = DEVICE) -> str | None:
    """vLLM's start-up memory guard (``request_memory``): ``None`` when it would pass."""
    requested = math.ceil(total * utilization)
    if free >= requested:
        return None
    return (
        f"Free memory on device {device} ({_gib(free)}/{_gib(total)} GiB) on startup is less "
        f"than desired GPU memory utilization ({utilization}, {_gib(requested)} GiB). "
        "Decrease GPU memory utilization or reduce GPU memory used by other processes."
    )


@dataclass(frozen=True, slots=True)
class Settings:
    """What the stand-in serves, decided from argv and environment."""

    model: str
    served_names: tuple[str, ...]
    max_model_len: int
    utilization: float
    auto_tool_choice: bool
    tool_call_parser: str | None
    max_num_seqs: int
    max_running: int
    host: str
    port: int
    token_seconds: float
    load_seconds: float
    release_seconds: float
    # vLLM's own keys (--api-key, else VLLM_API_KEY); empty: no key asked
    api_keys: tuple[str, ...] = ()
    argv: tuple[str, ...] = field(default=())
    read_weights: bool = False
    rules: str = RULES_PRE
    kv_bytes_per_token: int = 0
    kv_cache_bytes: int | None = None
    kv_block: int = 16
    death_seconds: float = 0.2
    exit_seconds: float = 1.8
    tensor_parallel_size: int = 1


def prepare(argv: Sequence[str], env: Mapping[str, str]) -> Settings:
    """Parse and validate as vLLM does before its engine starts; raise :class:`StartupError`."""
    args = parse_args(argv)
    model = args.model or args.model_tag
    if model is None:
        raise StartupError("error: the following arguments are required: model_tag")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise StartupError("Error: --enable-auto-tool-choice requires --tool-call-parser")
    rules = parse_rules(args.vllm_rules or env.get("STANDIN_VLLM_RULES") or DEFAULT_RULES)
    parsers = TOOL_PARSERS_POST if rules == RULES_POST else TOOL_PARSERS
    if args.tool_call_parser is not None and args.tool_call_parser not in parsers:
        raise StartupError(
            f"invalid tool call parser: {args.tool_call_parser} "
            f"(chose from {{ {','.join(parsers)} }})"
        )
    if not 0 < args.gpu_memory_utilization <= 1:
        raise StartupError(
            f"GPU memory utilization must be less than 1.0. Got {args.gpu_memory_utilization}."
        )
    config = load_model_config(model, args.hf_overrides, env)
    error = context_error(args.max_model_len, config, rules)
    if error is not None and env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "") not in ("1", "true"):
        raise StartupError(error)
    max_len = args.max_model_len or int(derived_max_model_len(config, rules))
    max_running = int(env.get("STANDIN_MAX_RUNNING", "0") or 0) or args.max_num_seqs
    return Settings(
        model=model,
        served_names=tuple(args.served_model_name or [model]),
        max_model_len=max_len,
        utilization=args.gpu_memory_utilization,
        auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        max_num_seqs=args.max_num_seqs,
        max_running=max_running,
        host=args.host or "0.0.0.0",
        port=args.port,
        token_seconds=float(env.get("STANDIN_TOKEN_SECONDS", "0.01")),
        load_seconds=float(env.get("STANDIN_LOAD_SECONDS", "2")),
        release_seconds=float(env.get("STANDIN_RELEASE_SECONDS", "1")),
        # as vLLM's build_app: --api-key wins over VLLM_API_KEY; empty keys are dropped
        api_keys=tuple(k for k in (args.api_key or [env.get("VLLM_API_KEY", "")]) if k),
        argv=tuple(argv),
        read_weights=env.get("STANDIN_READ_WEIGHTS", "") in ("1", "true"),
        rules=rules,
        kv_bytes_per_token=kv_bytes_per_token(config),
        kv_cache_bytes=args.kv_cache_memory_bytes or _optional_int(env, "STANDIN_KV_CACHE_BYTES"),
        kv_block=args.block_size or KV_BLOCK,
        death_seconds=float(env.get("STANDIN_ENGINE_DEATH_SECONDS", "0.2")),
        exit_seconds=float(env.get("STANDIN_ENGINE_EXIT_SECONDS", "1.8")),
        tensor_parallel_size=args.tensor_parallel_size,
    )


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise StartupError(f"{name} is {value!r}: give a whole number of bytes") from None


# Qwen2.5-7B's shape, when the model's config.json does not say (28 layers, 4 KV heads of 128)
_DEFAULT_KV_BYTES_PER_TOKEN = 2 * 28 * 4 * 128 * 2
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "bfloat16": 2, "half": 2}


def kv_bytes_per_token(config: Mapping[str, Any]) -> int:
    """Bytes of K and V cache one token takes (vLLM's full-attention page size per token):
    2 x layers x KV heads x head size x the dtype's bytes, from the model's config."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads", heads))
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return _DEFAULT_KV_BYTES_PER_TOKEN
    dtype = str(config.get("torch_dtype", config.get("dtype", "bfloat16")))
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


KV_BLOCK = 16  # vLLM's default block size (--block-size); the CPU backend's is 128


def kv_cache_error(
    max_model_len: int, per_token: int, available: int, block: int = KV_BLOCK
) -> str | None:
    """vLLM V1's refusal when one request of ``max_model_len`` does not fit the KV cache
    (``check_enough_kv_cache_memory``), worded as the real 0.32 server printed it, or ``None``.
    The estimate is the longest request the blocks hold, one block kept back (1 MiB at 256
    bytes a token in blocks of 128: 3968, as recorded)."""
    needed = max_model_len * per_token
    if needed <= available:
        return None
    estimate = max(max(available, 0) // (per_token * block) - 1, 0) * block
    return (
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({round(needed / GIB, 2)} GiB KV cache is needed, which is larger than the available "
        f"KV cache memory ({round(max(available, 0) / GIB, 2)} GiB). Based on the available "
        f"memory, the estimated maximum model length is {estimate}. Try increasing "
        "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
        "decreasing `max_model_len` when initializing the engine. See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )


def read_weights(model: str) -> int:
    """Read every ``*.safetensors`` under the model directory to its end, as vLLM's loader
    does (from the page cache when they are there, else from the disk); the bytes read."""
    total = 0
    for path in sorted(Path(model).glob("*.safetensors")):
        with path.open("rb", buffering=0) as handle:
            while chunk := handle.read(8 * 1024 * 1024):
                total += len(chunk)
    return total


def reply_tokens(max_tokens: int | None) -> tuple[list[str], str]:
    """The canned reply's tokens, cut at ``max_tokens``, and the finish reason."""
    words = REPLY.split(" ")
    tokens = [w if i == 0 else " " + w for i, w in enumerate(words)]
    if max_tokens is not None and max_tokens < len(tokens):
        return tokens[:max_tokens], "length"
    return tokens, "stop"


def split_tokens(text: str) -> list[str]:
    """The stand-in tokenizer: special tokens alone, else a word with the whitespace before
    it (whitespace at the end is a token of its own).  ``"".join`` gives the text back."""
    return _PIECE.findall(text)


def count_tokens(text: str) -> int:
    """Prompt tokens of a completion request (at least one)."""
    return max(len(split_tokens(text)), 1)


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The stand-in's chat template (ChatML, as Qwen's)."""
    parts = [
        f"<|im_start|>{m.get('role', 'user')}\n{_message_text(m.get('content'))}<|im_end|>\n"
        for m in messages
    ]
    if continue_final_message and parts:
        parts[-1] = parts[-1].removesuffix("<|im_end|>\n")
    elif add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def chat_prompt_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    """Prompt tokens of a chat request: its rendered template, tokenized."""
    return len(split_tokens(render_chat(messages)))


class Vocabulary:
    """Token ids of the stand-in tokenizer: special tokens at Qwen2's ids, every other piece
    numbered from 0 as first seen (so ids stay stable while the server runs)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ids: dict[str, int] = dict(SPECIAL_TOKENS)
        self.pieces: dict[int, str] = {i: p for p, i in SPECIAL_TOKENS.items()}
        self.next_id = 0
        self.encode(REPLY)

    def encode(self, text: str) -> list[int]:
        out = []
        with self.lock:
            for piece in split_tokens(text):
                if piece not in self.ids:
                    while self.next_id in self.pieces:
                        self.next_id += 1
                    self.ids[piece] = self.next_id
                    self.pieces[self.next_id] = piece
                out.append(self.ids[piece])
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; an id the vocabulary lacks decodes to nothing."""
        with self.lock:
            return "".join(self.pieces.get(i, "") for i in ids)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Pieces as a byte-level BPE vocabulary prints them (``Ġ`` space, ``Ċ`` newline)."""
        with self.lock:
            return [self.pieces.get(i, "").replace(" ", "Ġ").replace("\n", "Ċ") for i in ids]


# --------------------------------------------------------------------------- engine


# the series of vllm:request_success_total the real server exports from its start (0.32)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


class Engine:
    """Request accounting behind ``/metrics`` (true counts) and the card's busy engines."""

    def __init__(self, settings: Settings, card: SimClient | PoolClient | None) -> None:
        self.settings = settings
        self.card = card
        self.lock = threading.Lock()
        self.slots = threading.Semaphore(settings.max_running)
        self.running = 0
        self.waiting = 0
        self.success: dict[str, int] = dict.fromkeys(FINISHED_REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.tokens_in_flight = 0
        self.dead = False
        self.on_death: Callable[[], None] | None = None
        self.vocabulary = Vocabulary()

    def kill(self) -> None:
        """The engine core process dies: the server answers 503 and 500, then exits."""
        with self.lock:
            first = not self.dead
            self.dead = True
        if first and self.on_death is not None:
            self.on_death()

    def _set_busy(self) -> None:
        if self.card is not None:
            self.card.set_busy({"ccs": 1.0, "rcs": 0.25} if self.running else {})

    def admit(self, prompt_tokens: int) -> None:
        with self.lock:
            self.waiting += 1
        self.slots.acquire()
        with self.lock:
            self.waiting -= 1
            self.running += 1
            self.tokens_in_flight += prompt_tokens
            self._set_busy()

    def finish(self, reason: str, prompt_tokens: int, generated: int) -> None:
        with self.lock:
            self.running -= 1
            self.tokens_in_flight -= prompt_tokens
            if reason != "abort":  # real vLLM counts no client-aborted request here
                self.success[reason] = self.success.get(reason, 0) + 1
                self.prompt_tokens += prompt_tokens
                self.generation_tokens += generated
            self._set_busy()
        self.slots.release()

    def kv_usage(self) -> float:
        capacity = self.settings.max_model_len * max(self.settings.max_num_seqs // 16, 1)
        return min(self.tokens_in_flight / capacity, 1.0)

    def metrics(self) -> str:
        """Prometheus text exposition with vLLM's (v1 engine) metric names."""
        with self.lock:
            running, waiting = self.running, self.waiting
            success = dict(self.success)
            prompt, generation = self.prompt_tokens, self.generation_tokens
            kv = self.kv_usage()
        name = self.settings.served_names[0]
        labels = f'engine="0",model_name="{name}"'
        out = [
            "# SIMULATION: cardshare lab stand-in for vLLM",
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {kv}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(prompt)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(generation)}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
        ]
        for reason in FINISHED_REASONS:
            out.append(
                f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
                f'model_name="{name}"}} {float(success.get(reason, 0))}'
            )
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- HTTP


# vLLM's answer to a body whose Content-Type is not application/json (its
# validate_json_request raises a request validation error: 400, not 415), byte for byte as
# the real 0.32 server sent it (tests/fixtures/vllm/completions-text-plain-400.json)
UNSUPPORTED_MEDIA_TYPE_BODY = (
    b'{"error":{"message":"1 validation error:\\n  Unsupported Media Type: Only '
    b'\'application/json\' is allowed","type":"Bad Request","param":null,"code":400}}'
)
# a request while (or after) the engine core died (tests/fixtures/vllm/engine-killed-answers.json)
ENGINE_DEAD_BODY = (
    b'{"error":{"message":"EngineCore encountered an issue. See stack trace (above) for the '
    b'root cause.","type":"InternalServerError","param":null,"code":500}}'
)

# vLLM's AuthenticationMiddleware's refusal (starlette's JSONResponse: compact JSON), and the
# paths it guards (vLLM 0.32's GUARDED_PREFIX: a plain prefix test, "/v1x" too)
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


class EngineDead(Exception):
    """The engine core died while a request ran."""


def _error(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(slots=True)
class Plan:
    """What one request will produce."""

    prompt_tokens: int
    tokens: list[str]
    finish: str
    tool_call: dict[str, Any] | None = None


class VllmHandler(Handler):
    server: VllmServer

    @property
    def engine(self) -> Engine:
        return self.server.engine

    def read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return read_chunked(self.rfile)
        return super().read_body()

    def _health(self) -> None:
        self.send_bytes(503 if self.engine.dead else 200, b"", content_type="")

    def do_GET(self) -> None:
        path = self.path_only
        if not self._authorised(path):
            self.send_bytes(401, UNAUTHORIZED_BODY, "application/json")
            return
        if path in ("/health", "/ping"):
            self._health()
        elif path == "/v1/models":
            self._models()
        elif path == "/metrics":
            body = self.engine.metrics().encode()
            # the content type real vLLM 0.32 sends (tests/fixtures/vllm/api-key-answers.json)
            self.send_bytes(200, body, "text/plain; version=1.0.0; charset=utf-8")
        elif path == "/version":
            self.send_json(200, {"version": VERSION})
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        path = self.path_only
        try:
            raw = self.read_body()
        except BadChunkedBody:
            self.close_connection = True  # as uvicorn: a plain 400, then the connection closes
            body = b"Invalid HTTP request received."
            self.send_bytes(400, body, "text/plain; charset=utf-8", {"Connection": "close"})
            return
        if not self._authorised(path):
            self.send_bytes(401, UNAUTHORIZED_BODY, "application/json")
            return
        if path == "/cardshare-sim/kill-engine":
            self.engine.kill()
            self.send_json(200, {"simulation": True, "engine": "dead"})
            return
        if path == "/ping":
            self._health()
            return
        routes = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
        if path not in routes:
            self.send_json(404, {"detail": "Not Found"})
            return
        media_type = self.headers.get("Content-Type", "").lower().split(";", 1)[0].strip()
        if media_type != "application/json":
            self.send_bytes(400, UNSUPPORTED_MEDIA_TYPE_BODY, "application/json")
            return
        try:
            request = json.loads(raw) if raw else {}
        except ValueError as exc:
            self.send_json(400, _error(f"Invalid JSON: {exc}", "BadRequestError", 400))
            return
        if not isinstance(request, dict):
            self.send_json(400, _error("Request body must be an object", "BadRequestError", 400))
            return
        if path in ("/tokenize", "/detokenize"):
            self._tokenization(request, path == "/tokenize")
            return
        if self.engine.dead:
            self.send_bytes(500, ENGINE_DEAD_BODY, "application/json")
            return
        if not self._model_ok(request):
            return
        chat = path == "/v1/chat/completions"
        plan = self._plan(request, chat)
        if plan is None:
            return
        self._generate(request, plan, chat)

    def _model_ok(self, request: Mapping[str, Any]) -> bool:
        model = request.get("model")
        if model is not None and model not in self.engine.settings.served_names:
            message = f"The model `{model}` does not exist."
            self.send_json(404, _error(message, "NotFoundError", 404, "model"))
            return False
        return True

    def _tokenization(self, request: Mapping[str, Any], tokenize: bool) -> None:
        """``/tokenize`` (``prompt``, or chat ``messages``) and ``/detokenize`` (``tokens``)."""
        if not self._model_ok(request):
            return
        vocabulary = self.engine.vocabulary
        if not tokenize:
            tokens = request.get("tokens")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
            ):
                message = "tokens: a list of non-negative integers is required"
                self.send_json(400, _error(message, "BadRequestError", 400, "tokens"))
                return
            self.send_json(200, {"prompt": vocabulary.decode(tokens)})
            return
        if "messages" in request:
            messages = request["messages"]
            generation = request.get("add_generation_prompt", True)
            continue_final = request.get("continue_final_message", False)
            if generation and continue_final:
                message = (
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                )
                self.send_json(400, _error(message, "BadRequestError", 400))
                return
            if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
                message = "messages: a list of messages is required"
                self.send_json(400, _error(message, "BadRequestError", 400, "messages"))
                return
            text = render_chat(messages, bool(generation), bool(continue_final))
        elif isinstance(request.get("prompt"), str):
            text = request["prompt"]
        else:
            message = "prompt: a string is required (or messages for a chat prompt)"
            self.send_json(400, _error(message, "BadRequestError", 400, "prompt"))
            return
        ids = vocabulary.encode(text)
        strs = vocabulary.token_strs(ids) if request.get("return_token_strs") else None
        self.send_json(
            200,
            {
                "count": len(ids),
                "max_model_len": self.engine.settings.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            },
        )

    def _authorised(self, path: str) -> bool:
        """vLLM's AuthenticationMiddleware: with keys, a path under /v1, /v2, /inference or
        /cohere (before any routing, so an unknown one is 401 too) needs ``Authorization:
        <bearer, any case> <key>``; /health, /ping, /metrics, /version, /tokenize and the rest
        stay open (tests/fixtures/vllm/api-key-answers.json)."""
        keys = self.engine.settings.api_keys
        if not keys or not path.startswith(GUARDED_PREFIXES):
            return True
        # uvicorn strips the blanks around a header's value before vLLM reads it
        scheme, _, token = self.headers.get("Authorization", "").strip(" \t").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = hashlib.sha256(token.encode("utf-8")).digest()
        found = False
        for key in keys:
            found |= hmac.compare_digest(given, hashlib.sha256(key.encode("utf-8")).digest())
        return found

    def _models(self) -> None:
        settings = self.engine.settings
        created = int(self.server.started)
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": settings.model,
                "parent": None,
                "max_model_len": settings.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in settings.served_names
        ]
        self.send_json(200, {"object": "list", "data": data})

    def _plan(self, request: Mapping[str, Any], chat: bool) -> Plan | None:
        settings = self.engine.settings
        max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            self.send_json(400, _error("max_tokens must be at least 1", "BadRequestError", 400))
            return None
        if chat:
            messages = request.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, Mapping) for m in messages)
            ):
                self.send_json(
                    400, _error("messages must be a non-empty list", "BadRequestError", 400)
                )
                return None
            prompt_tokens = chat_prompt_tokens(messages)
        else:
            prompt = request.get("prompt", "")
            text = " ".join(map(str, prompt)) if isinstance(prompt, list) else str(prompt)
            prompt_tokens = count_tokens(text)
        requested = prompt_tokens + (max_tokens or 0)
        if requested > settings.max_model_len:
            where = "messages" if chat else "prompt"
            message = (
                f"This model's maximum context length is {settings.max_model_len} tokens. "
                f"However, you requested {requested} tokens ({prompt_tokens} in the {where}, "
                f"{max_tokens or 0} in the completion). Please reduce the length of the "
                f"{where} or completion."
            )
            self.send_json(400, _error(message, "BadRequestError", 400))
            return None
        tool_call = self._tool_call(request) if chat else None
        if tool_call is False:
            return None
        if isinstance(tool_call, dict):
            tokens = ["<tool_call>", "{}", "</tool_call>"][: max_tokens or 3]
            return Plan(prompt_tokens, tokens, "tool_calls", tool_call)
        tokens, finish = reply_tokens(max_tokens)
        return Plan(prompt_tokens, tokens, finish)

    def _tool_call(self, request: Mapping[str, Any]) -> dict[str, Any] | bool | None:
        tools = request.get("tools") or []
        choice = request.get("tool_choice")
        if not tools or choice == "none":
            return None
        names = [t.get("function", {}).get("name") for t in tools if isinstance(t, Mapping)]
        if isinstance(choice, Mapping):
            name = choice.get("function", {}).get("name")
        elif choice in (None, "auto"):
            if not self.engine.settings.auto_tool_choice:
                message = (
                    '"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set"
                )
                self.send_json(400, _error(message, "BadRequestError", 400))
                return False
            name = names[0] if names else None
        else:  # "required"
            name = names[0] if names else None
        if not name:
            return None
        return {
            "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
            "type": "function",
            "function": {"name": name, "arguments": "{}"},
        }

    def _generate(self, request: Mapping[str, Any], plan: Plan, chat: bool) -> None:
        engine = self.engine
        engine.admit(plan.prompt_tokens)
        settled = False

        def settle(reason: str, generated: int) -> None:
            # Like the real engine, a request is counted when its last token is made, before
            # the response's last bytes go out: a client that has its answer and then reads
            # /metrics finds it counted.
            nonlocal settled
            if not settled:
                settled = True
                engine.finish(reason, plan.prompt_tokens, generated)

        done = "stop" if plan.finish in ("stop", "tool_calls") else plan.finish
        generated = 0
        try:
            if request.get("stream"):
                self._stream(request, plan, chat, lambda n: settle(done, n))
            else:
                for _ in self._tokens(plan):
                    generated += 1
                settle(done, generated)
                self.send_json(200, self._full_response(request, plan, chat))
        except (BrokenPipeError, ConnectionResetError):
            pass
        except EngineDead:
            # never counted: the server ends with its engine
            if not request.get("stream"):
                self.send_bytes(500, ENGINE_DEAD_BODY, "application/json")
            else:
                self.close_connection = True
        finally:
            settle("abort", generated)

    def _tokens(self, plan: Plan) -> Iterator[str]:
        delay = self.engine.settings.token_seconds
        for token in plan.tokens:
            if delay > 0:
                time.sleep(delay)
            if self.engine.dead:
                raise EngineDead
            yield token

    def _usage(self, plan: Plan) -> dict[str, int]:
        completion = len(plan.tokens)
        return {
            "prompt_tokens": plan.prompt_tokens,
            "total_tokens": plan.prompt_tokens + completion,
            "completion_tokens": completion,
        }

    def _full_response(self, request: Mapping[str, Any], plan: Plan, chat: bool) -> dict[str, Any]:
        model = request.get("model") or self.engine.settings.served_names[0]
        base = {"created": int(time.time()), "model": model, "usage": self._usage(plan)}
        if not chat:
            choice = {
                "index": 0,
                "text": "".join(plan.tokens),
                "logprobs": None,
                "finish_reason": plan.finish,
                "stop_reason": None,
            }
            return {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "choices": [choice],
                **base,
            }
        message: dict[str, Any] = {"role": "assistant", "reasoning_content": None}
        if plan.tool_call is not None:
            message.update(content=None, tool_calls=[plan.tool_call])
        else:
            message.update(content="".join(plan.tokens), tool_calls=[])
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": plan.finish,
            "stop_reason": None,
        }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "choices": [choice],
            **base,
        }

    def _stream(
        self, request: Mapping[str, Any], plan: Plan, chat: bool, done: Callable[[int], None]
    ) -> None:
        model = request.get("model") or self.engine.settings.served_names[0]
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict[str, Any]) -> dict[str, Any]:
            return {
                "id": ident,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [{"index": 0, "logprobs": None, **choice}],
            }

        self.start_stream()
        generated = 0
        if chat:
            opening: dict[str, Any] = {"role": "assistant", "content": ""}
            self.send_event(chunk({"delta": opening, "finish_reason": None}))
        for token in self._tokens(plan):
            generated += 1
            if plan.tool_call is None:
                delta: dict[str, Any] = {"content": token} if chat else {"text": token}
                self.send_event(
                    chunk(
                        {"delta": delta, "finish_reason": None}
                        if chat
                        else {**delta, "finish_reason": None}
                    )
                )
        if plan.tool_call is not None:
            call = plan.tool_call
            first = {
                "index": 0,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            self.send_event(chunk({"delta": {"tool_calls": [first]}, "finish_reason": None}))
            rest = {"index": 0, "function": {"arguments": call["function"]["arguments"]}}
            self.send_event(chunk({"delta": {"tool_calls": [rest]}, "finish_reason": None}))
        done(generated)
        final: dict[str, Any] = {"finish_reason": plan.finish, "stop_reason": None}
        if chat:
            final["delta"] = {}
        else:
            final["text"] = ""
        self.send_event(chunk(final))
        options = request.get("stream_options") or {}
        if isinstance(options, Mapping) and options.get("include_usage"):
            self.send_event(
                {
                    "id": ident,
                    "object": kind,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._usage(plan),
                }
            )
        self.send_event("[DONE]")
        self.end_stream()


class VllmServer(StandinServer):
    def __init__(self, address: tuple[str, int], engine: Engine) -> None:
        self.engine = engine
        self.started = time.time()
        super().__init__(address, VllmHandler)


def make_server(
    settings: Settings, card: SimClient | PoolClient | None, port: int | None = None
) -> VllmServer:
    """Bind the API server (``port`` overrides the settings, 0 picks a free port)."""
    engine = Engine(settings, card)
    return VllmServer((settings.host, settings.port if port is None else port), engine)


# --------------------------------------------------------------------------- recorded logs


LOGS = Path(__file__).resolve().parent / "vllm-logs"
KV_CACHE_LOG = "kv-cache-start-failure.log"
ENGINE_KILLED_LOG = "engine-killed.log"
YARN_REFUSAL_LOG = "yarn-refusal.log"
UNKNOWN_PARSER_LOG = "unknown-tool-call-parser.log"
# each recorded failure's root cause, to the end of its line (or of the pydantic message)
ROOT_CAUSE_KV = re.compile(r"To serve at least one request with the models?'s max seq len [^\n]*")
ROOT_CAUSE_CONTEXT = re.compile(
    r"User-specified max_model_len \(\d+\) is greater than [^\n]*?(?= \[type=)"
)
ROOT_CAUSE_PARSER = re.compile(r"invalid tool call parser: \S+ \(chose from \{[^}]*\}\)")
_ROOT_CAUSES = (ROOT_CAUSE_KV, ROOT_CAUSE_CONTEXT, ROOT_CAUSE_PARSER)
# a process tag as vLLM prints it: "(APIServer pid=31217) ", "(EngineCore_DP0 pid=2544) "
PROCESS_TAG = re.compile(r"\(([A-Za-z_][\w-]*) pid=(\d+)\)")
# (pattern, field): group 1 of each match is the recording's value of that field
_LOG_FIELDS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d-\d\d \d\d:\d\d:\d\d)"), "time"),
    (re.compile(r"Using max model len (\d+)"), "max_model_len"),
    (re.compile(r"'max_model_len': (\d+)"), "max_model_len"),
    (re.compile(r"max_seq_len=(\d+)"), "max_model_len"),
    (re.compile(r"served_model_name=([^,\s]+)"), "served_name"),
    (re.compile(r"'served_model_name': \['([^']+)'\]"), "served_name"),
    (re.compile(r"'port': (\d+)"), "port"),
)
_RECORDED_MODEL = re.compile(r"(?:\bmodel=|'model': )'([^']+)'")
# where the real server's Python files were (the recording machine's virtualenv)
_SITE_PACKAGES = re.compile(r'File "([^"]*?)/(?:site-packages|dist-packages)/')
# uvicorn's lines naming the API server's pid: "Started server process [31217]"
_SERVER_PROCESS = re.compile(r"((?:Started|Finished) server process )\[\d+\]")
# uvicorn's access log: the stand-in logs no requests
_ACCESS_LINE = re.compile(r'^INFO: +\S+:\d+ - "')


def recorded_values(text: str) -> dict[str, str]:
    """The values a recorded log carries in the fields the stand-in substitutes (the first
    occurrence of each), its model path, its Python prefix and its root cause."""
    values: dict[str, str] = {}
    for pattern, name in _LOG_FIELDS:
        found = pattern.search(text)
        if found is not None:
            values.setdefault(name, found[1])
    for pattern, name in ((_RECORDED_MODEL, "model"), (_SITE_PACKAGES, "python_prefix")):
        found = pattern.search(text)
        if found is not None:
            values[name] = found[1]
    for pattern in _ROOT_CAUSES:
        cause = pattern.search(text)
        if cause is not None:
            values["root_cause"] = cause[0]
            break
    return values


def render_recorded_log(text: str, values: Mapping[str, str], pids: Sequence[int] = ()) -> str:
    """A recorded real log with the stand-in's own values in the fields that carry them
    (times, the model, its length and name, the root cause, the Python prefix; the processes'
    pids, in order of their first appearance, from ``pids``); every other byte as recorded."""
    recorded = recorded_values(text)
    out = text
    for name in ("model", "python_prefix"):
        if name in recorded and name in values:
            out = out.replace(recorded[name], values[name])
    if "root_cause" in values:
        for pattern in _ROOT_CAUSES:
            out = pattern.sub(lambda _m: values["root_cause"], out)
    if pids:
        order: dict[str, str] = {}
        for tag in PROCESS_TAG.finditer(text):
            order.setdefault(tag[2], str(pids[min(len(order), len(pids) - 1)]))
        out = PROCESS_TAG.sub(lambda m: f"({m[1]} pid={order.get(m[2], m[2])})", out)
        out = _SERVER_PROCESS.sub(lambda m: f"{m[1]}[{pids[0]}]", out)

    for pattern, name in _LOG_FIELDS:
        if name not in values:
            continue
        value = values[name]

        def put(match: re.Match[str], value: str = value) -> str:
            whole = match[0]
            start, end = match.start(1) - match.start(0), match.end(1) - match.start(0)
            return whole[:start] + value + whole[end:]

        out = pattern.sub(put, out)
    return out


def read_recorded_log(name: str) -> str:
    """A recorded real log shipped with the stand-in (``vllm-logs/``)."""
    return (LOGS / name).read_bytes().decode("utf-8")  # as written: its lines hold "\r"s


def engine_death_log(recorded: str) -> tuple[list[str], list[str]]:
    """What the real API server printed after its engine core was killed: the lines up to its
    uvicorn shutdown, then the rest (its access-log lines left out)."""
    lines = recorded.splitlines(keepends=True)
    marks = ("[shutdown]", "exited unexpectedly")
    first = next((i for i, line in enumerate(lines) if any(m in line for m in marks)), len(lines))
    # the worker's own line about its parent comes just before, from the same death
    while first > 0 and "terminating worker" in lines[first - 1]:
        first -= 1
    after = [line for line in lines[first:] if not _ACCESS_LINE.match(line)]
    cut = next((i for i, line in enumerate(after) if line.startswith("INFO:     Shutting down")), 0)
    return after[:cut], after[cut:]


# the Python prefix the recordings print (the lane's virtualenv, as its README says)
PYTHON_PREFIX = "/opt/vllm/lib/python3.11"


# --------------------------------------------------------------------------- main


FAIL_KNOB = Path("lab") / "vllm-fail-next-starts"
HOLD_KNOB = Path("lab") / "vllm-hold-card"


class PoolClient:
    """SIMULATION: vLLM's ranks as DRM clients, one per card of its tensor-parallel pool (a
    pool of one: the one card), driven together as :class:`SimClient` drives one."""

    def __init__(
        self, size: int, env: Mapping[str, str], cmdline: Sequence[str], root: Path | None = None
    ) -> None:
        if size < 1:
            raise StartupError(f"tensor_parallel_size must be at least 1, got {size}")
        first = SimClient(comm=ENGINE_COMM, cmdline=cmdline, root=root)
        self.root = first.root
        choices = card_choices(env)
        if size == 1:
            self.ranks = [first]
        else:
            if not choices:  # the host's first cards with memory, in address order
                choices = _cards_with_memory(self.root)
            if len(choices) < size:
                raise StartupError(
                    f"SIMULATION: --tensor-parallel-size {size} needs {size} cards, but the "
                    f"stand-in has {len(choices)} ({', '.join(choices) or 'none'}): name them "
                    "in CARDSHARE_SIM_CARD"
                )
            self.ranks = [
                SimClient(comm=ENGINE_COMM, cmdline=cmdline, root=root, choice=choice)
                for choice in choices[:size]
            ]

    @property
    def card(self) -> object | None:
        """The first rank's card; None when the root has no card."""
        return self.ranks[0].card

    @property
    def registered(self) -> bool:
        return all(rank.registered for rank in self.ranks)

    def memory_error(self, utilization: float, forced: bool) -> str | None:
        """The first rank whose card has less free than the share: vLLM's refusal, naming it."""
        for index, rank in enumerate(self.ranks):
            free, total = rank.free_vram()
            error = memory_error(0 if forced else free, total, utilization, f"xpu:{index}")
            if error is not None:
                return error
        return None

    def register(self, utilization: float) -> None:
        mib = 1024**2  # the driver reports whole pages; keep the figure readable
        for rank in self.ranks:
            _free, total = rank.free_vram()
            rank.register(vram=-(-math.ceil(total * utilization) // mib) * mib)

    def set_busy(self, busy: Mapping[str, float]) -> None:
        for rank in self.ranks:
            rank.set_busy(busy)

    def close(self, release_seconds: float) -> None:
        """Every rank releases its card at once; the card the hold knob names keeps its memory
        for the knob's seconds past the process's exit (the lab's reaper frees it then)."""
        held = take_hold(self.root)
        threads: list[threading.Thread] = []
        for rank in self.ranks:
            if held is not None and rank.card is not None and rank.card.pdev == held[0]:
                rank.leave(held[1])
                continue
            threads.append(threading.Thread(target=rank.close, args=(release_seconds,)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _cards_with_memory(root: Path) -> list[str]:
    """The simulated host's cards with memory, by PCI address in order."""
    devices = root / "sys" / "bus" / "pci" / "devices"
    try:
        names = sorted(entry.name for entry in devices.iterdir())
    except OSError:
        return []
    return [n for n in names if (devices / n / "tile0" / "physical_vram_size_bytes").exists()]


def take_hold(root: Path) -> tuple[str, float] | None:
    """Consume the hold knob: ``(PCI address, seconds)``, else ``None``."""
    knob = root / HOLD_KNOB
    try:
        words = knob.read_text().split()
        knob.unlink(missing_ok=True)
        return (words[0], float(words[1])) if len(words) >= 2 else None
    except (OSError, ValueError):
        return None


FORCED_KINDS = ("free-memory", "kv-cache")


def take_forced_failure(root: Path) -> str | None:
    """Consume one forced start failure from the lab knob (see the module's text): its kind,
    ``free-memory`` (a count alone) or ``kv-cache`` (``N kv-cache``), else ``None``."""
    knob = root / FAIL_KNOB
    try:
        words = knob.read_text().split()
        count = int(words[0]) if words else 0
    except (OSError, ValueError):
        return None
    kind = words[1] if len(words) > 1 else FORCED_KINDS[0]
    if kind not in FORCED_KINDS:
        return None
    if count <= 1:
        knob.unlink(missing_ok=True)
    else:
        knob.write_text(" ".join([str(count - 1), *words[1:2]]) + "\n")
    return kind if count >= 1 else None


def _fail_as_recorded(name: str, argv: Sequence[str], root_cause: str) -> int:
    """Refuse as the real server did: its recorded log (``vllm-logs/<name>``) with this
    command line's values and root cause, then exit 1."""
    args = parse_args(argv)
    model = args.model or args.model_tag or ""
    values = {
        "time": time.strftime("%m-%d %H:%M:%S"),
        "model": model,
        "served_name": (args.served_model_name or [model])[0],
        "port": str(args.port),
        "python_prefix": PYTHON_PREFIX,
        "root_cause": root_cause,
    }
    if args.max_model_len is not None:
        values["max_model_len"] = str(args.max_model_len)
    text = render_recorded_log(read_recorded_log(name), values, _pids())
    sys.stderr.write(text if text.endswith("\n") else text + "\n")
    sys.stderr.flush()
    return 1


def _fail(lines: Sequence[str]) -> int:
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    return 1


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    environ = dict(os.environ if env is None else env)
    args = list(sys.argv[1:] if argv is None else argv)
    print("SIMULATION: cardshare lab stand-in for vLLM (no model runs here)", flush=True)
    try:
        settings = prepare(args, environ)
    except StartupError as exc:
        message = str(exc)
        if message.startswith("User-specified max_model_len"):
            return _fail_as_recorded(YARN_REFUSAL_LOG, args, message)
        if message.startswith("invalid tool call parser"):
            return _fail_as_recorded(UNKNOWN_PARSER_LOG, args, message)
        if message.startswith("Error: --enable-auto-tool-choice"):
            return _fail([f"TypeError: {message}"])
        return _fail([f"ValueError: {message}"])
    try:
        card = PoolClient(settings.tensor_parallel_size, environ, ["vllm", "serve", *args])
    except StartupError as exc:
        return _fail([f"ValueError: {exc}"])
    forced: str | None = None
    if card.card is None:
        print(f"SIMULATION: no simulated card under {card.root}; not registering", flush=True)
    else:
        forced = take_forced_failure(card.root)
        # the knob: memory taken between the arbiter's measure and this start
        error = card.memory_error(settings.utilization, forced == "free-memory")
        if error is not None:
            return _fail(
                [
                    f"(EngineCore_DP0 pid={os.getpid()}) ValueError: {error}",
                    "RuntimeError: Engine core initialization failed. See root cause above. "
                    "Failed core proc(s): {}",
                ]
            )
        card.register(settings.utilization)
    try:
        return _serve(settings, card, forced == "kv-cache")
    finally:
        card.close(settings.release_seconds)


def kv_start_error(settings: Settings, forced: bool) -> str | None:
    """The KV-cache start failure's root cause, or ``None``: the cache one request of
    ``max_model_len`` needs against the KV cache given (when given), or against half of
    it when the lab knob forces the failure."""
    per_token = settings.kv_bytes_per_token or _DEFAULT_KV_BYTES_PER_TOKEN
    needed = settings.max_model_len * per_token
    block = settings.kv_block
    if forced:
        return kv_cache_error(settings.max_model_len, per_token, needed // 2, block)
    if settings.kv_cache_bytes is None:
        return None
    return kv_cache_error(settings.max_model_len, per_token, settings.kv_cache_bytes, block)


def _log_values(settings: Settings) -> dict[str, str]:
    return {
        "time": time.strftime("%m-%d %H:%M:%S"),
        "model": settings.model,
        "max_model_len": str(settings.max_model_len),
        "served_name": settings.served_names[0],
        "port": str(settings.port),
        "python_prefix": PYTHON_PREFIX,
    }


def _pids() -> list[int]:
    """The API server's pid, then made-up ones for the engine core and its worker
    (SIMULATION: no such processes exist)."""
    pid = os.getpid()
    return [pid, pid + 1, pid + 2]


def kv_failure_log(settings: Settings, root_cause: str) -> str:
    """The recorded real KV-cache start failure with this start's values in it."""
    values = {**_log_values(settings), "root_cause": root_cause}
    return render_recorded_log(read_recorded_log(KV_CACHE_LOG), values, _pids())


# as the real API server: it exits by itself once its engine core died ("Finished server
# process", exit status 0 in the recording)
ENGINE_DEATH_EXIT = 0


def _serve(settings: Settings, card: PoolClient, kv_forced: bool = False) -> int:
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"SIMULATION: loading {settings.model} for {settings.load_seconds}s", flush=True)
    if stop.wait(settings.load_seconds):
        return 0
    if settings.read_weights:
        started = time.monotonic()
        size = read_weights(settings.model)
        print(
            f"SIMULATION: read {size} bytes of weights in {time.monotonic() - started:.2f}s",
            flush=True,
        )
    root_cause = kv_start_error(settings, kv_forced)
    if root_cause is not None:
        sys.stderr.write(kv_failure_log(settings, root_cause))
        sys.stderr.flush()
        return 1
    server = make_server(settings, card if card.registered else None)
    died = threading.Event()
    recorded = read_recorded_log(ENGINE_KILLED_LOG)

    def print_recorded(lines: list[str]) -> None:
        text = render_recorded_log("".join(lines), _log_values(settings), _pids())
        sys.stderr.write(text if text.endswith("\n") or not text else text + "\n")
        sys.stderr.flush()

    def close_port(rest: list[str]) -> None:
        print_recorded(rest)
        server.shutdown()
        server.server_close()  # from now on the port refuses connections

    def on_death() -> None:
        # as the real server: requests in flight and new ones get 500 (/health 503) until
        # uvicorn shuts down (about 0.2 s), the port then refuses connections, and the
        # process exits about 1.8 s after the death
        died.set()
        before, rest = engine_death_log(recorded)
        print_recorded(before)
        threading.Timer(settings.death_seconds, close_port, args=(rest,)).start()
        threading.Timer(settings.exit_seconds, stop.set).start()

    server.engine.on_death = on_death
    signal.signal(signal.SIGUSR1, lambda _s, _f: server.engine.kill())
    serve_in_thread(server)
    print(f"INFO: Started server process; listening on {settings.host}:{settings.port}", flush=True)
    stop.wait()
    server.shutdown()
    server.server_close()
    if died.is_set():
        print("SIMULATION: the engine core died; the API server exits", flush=True)
        return ENGINE_DEATH_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
