"""The insufficient-VRAM classifier, pinned by real error strings and red-team negatives.

Positive strings are the messages as printed by their sources: vLLM's worker check at
start, PyTorch's allocator (CUDA and XPU), Level Zero / Unified Runtime status names,
IPEX, node-llama-cpp's context check, GGML's allocator.
"""

from __future__ import annotations

import itertools
import random
import re
from pathlib import Path
from re import _constants as re_constants
from re import _parser as re_parser
from typing import Any

import pytest

from cardshare import errors
from cardshare.errors import (
    ErrorKind,
    TailVerdict,
    classify_error,
    classify_tail,
    is_insufficient_vram_error,
    matched_pattern,
    oom_killed_message,
)

POSITIVES = [
    (
        "ValueError: Free memory on device (7.12/31.84 GiB) on startup is less than desired "
        "GPU memory utilization (0.85, 27.06 GiB). Decrease GPU memory utilization or reduce "
        "GPU memory used by other processes.",
        "vllm_free_memory",
    ),
    (
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine.",
        "vllm_no_cache_memory",
    ),
    (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 23.65 GiB of which 1.02 GiB is free.",
        "out_of_memory",
    ),
    ("XPU out of memory. Tried to allocate 1.50 GiB (GPU 0; 31.84 GiB total)", "out_of_memory"),
    ("RuntimeError: UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY", "level_zero_oom"),
    (
        "level_zero backend failed with error: 70000004 (ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)",
        "level_zero_oom",
    ),
    (
        "RuntimeError: Allocation is out of device memory on current platform.",
        "allocation_out_of_device_memory",
    ),
    ("A context size of 8192 is too large for the available VRAM", "too_large_for_vram"),
    (
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 512.00 MiB on device 0: "
        "cudaMalloc failed: out of memory",
        "out_of_memory",
    ),
    ("Insufficient VRAM to load the model", "insufficient_vram"),
    ("not enough free device memory for the KV cache", "insufficient_vram"),
    ("vk::Device::allocateMemory: ErrorOutOfDeviceMemory", "vulkan_oom"),
    ("torch.OutOfMemoryError", "out_of_memory_error"),
    # vLLM V1 (vllm/v1/core/kv_cache_utils.py), as printed by vLLM 0.10-0.11
    (
        "ValueError: To serve at least one request with the models's max seq len (40960), "
        "(5.62 GiB KV cache is needed, which is larger than the available KV cache memory "
        "(4.50 GiB). Based on the available memory, the estimated maximum model length is "
        "32768. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
        "initializing the engine.",
        "vllm_kv_cache_too_small",
    ),
    # early V1 (0.8.x): "GB", "KV Cache memory"
    (
        "ValueError: To serve at least one request with the models's max seq len (32768), "
        "(2.00 GB KV cache is needed, which is larger than the available KV Cache memory "
        "(0.78 GB). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
        "when initializing the engine.",
        "vllm_kv_cache_too_small",
    ),
    # vLLM V0 (vllm/worker/worker.py)
    (
        "ValueError: The model's max seq len (32768) is larger than the maximum number of "
        "tokens that can be stored in KV cache (22032). Try increasing `gpu_memory_utilization` "
        "or decreasing `max_model_len` when initializing the engine.",
        "vllm_max_seq_len_over_kv_cache",
    ),
    # ComfyUI (issues 4852, 6073): history exception_message and the log line
    ("Allocation on device ", "comfyui_allocation_on_device"),
    (
        "2024-12-16 17:10:56,767 - root - ERROR - !!! Exception during processing !!! "
        "Allocation on device ",
        "comfyui_allocation_on_device",
    ),
    ("!!! Exception during processing !!! Allocation on device 0", "comfyui_allocation_on_device"),
    ("- **Exception Message:** Allocation on device ", "comfyui_allocation_on_device"),
]

NEGATIVES = [
    "CUDA_VISIBLE_DEVICES is not set",
    "memory leak in docs",
    "Out of memory: Killed process 4242 (python3) total-vm:33554432kB",
    "model not found: Qwen/Qwen3-32B",
    "Model architectures ['Foo'] are not supported for now",
    "ConnectionRefusedError: [Errno 111] Connection refused",
    "OSError: [Errno 12] Cannot allocate memory",
    "the layout has run out of memorylessness",
    "ZE_AFFINITY_MASK=0 device selection failed",
    "gpu_memory_utilization must be between 0 and 1",
    "",
    # "Allocation on device" that is not ComfyUI's OOM message
    "Allocation on device not large enough for array: 1024 < 4096",
    "// Mem allocation on device",
    "Memory Allocation on device failed for CuPoly class",
    "3-dimensional array allocation on device with cudaMalloc3d, demonstration",
    # KV cache talk that is not the start failure
    "GPU KV cache size: 68,605 tokens",
    "Maximum concurrency for 32,768 tokens per request: 2.09x",
    "vllm:kv_cache_usage_perc 0.97",
]


@pytest.mark.parametrize(("text", "pattern"), POSITIVES)
def test_positives(text: str, pattern: str) -> None:
    assert matched_pattern(text) == pattern
    assert classify_error(text) is ErrorKind.INSUFFICIENT_VRAM


@pytest.mark.parametrize("text", NEGATIVES)
def test_negatives(text: str) -> None:
    assert classify_error(text) is ErrorKind.OTHER
    assert not is_insufficient_vram_error(text)


def test_classify_rejects_non_text() -> None:
    with pytest.raises(TypeError, match=r"^classify_error expects a str, got bytes$"):
        classify_error(b"out of memory")  # type: ignore[arg-type]


def test_oom_killed_message() -> None:
    assert oom_killed_message("vllm-vllm-1") == (
        "container vllm-vllm-1 was killed by its memory cap (OOMKilled), not a VRAM problem; "
        "raise the memory limit"
    )


# -- whole log tails (issue 9) ------------------------------------------------------------

# vLLM's engine core, its message wrapped over lines, each with the process tag and logger
# prefix (the shape of vLLM 0.10+ logs); "KV / cache memory" is split across two lines.
_CORE = "(EngineCore_DP0 pid=18799) "
_ERR = _CORE + "ERROR 10-08 20:33:48 [core.py:708] "
VLLM_WRAPPED = "\n".join(
    [
        _CORE + "INFO 10-08 20:33:40 [gpu_worker.py:276] Available KV cache memory: 4.50 GiB",
        _ERR + "EngineCore failed to start.",
        _ERR + "ValueError: To serve at least one request with the models's max seq len "
        "(40960), (5.62 GiB KV cache is needed, which is larger than the available KV",
        _ERR + "cache memory (4.50 GiB). Based on the available memory, the estimated maximum "
        "model length is 32768.",
        "(APIServer pid=18600) RuntimeError: Engine core initialization failed. See root cause "
        "above.",
    ]
)

# textwrap-style wrap (the space at the break dropped), with Docker --timestamps
TEXTWRAPPED = """\
2026-09-26T12:00:01.000000000Z ValueError: The model's max seq len (131072) is larger than
2026-09-26T12:00:01.000000000Z the maximum number of tokens that can be stored in KV cache
2026-09-26T12:00:01.000000000Z (47328).
"""

# a long record cut inside a word
SPLIT_IN_WORD = "RuntimeError: Allocation is out of dev\nice memory on current platform.\n"

COMFY_TAIL = """\
[2024-11-06 23:40:42.576] Set vram state to: NORMAL_VRAM
[2024-11-06 23:41:10.101] !!! Exception during processing !!! Allocation on device
[2024-11-06 23:41:10.102] Traceback (most recent call last):
[2024-11-06 23:41:10.110] torch.OutOfMemoryError: Allocation on device
[2024-11-06 23:41:10.111] Got an OOM, unloading all loaded models.
"""


@pytest.mark.parametrize(
    ("tail", "pattern", "excerpt"),
    [
        (
            VLLM_WRAPPED,
            "vllm_kv_cache_too_small",
            "ValueError: To serve at least one request with the models's max seq len (40960), "
            "(5.62 GiB KV cache is needed, which is larger than the available KV cache memory "
            "(4.50 GiB). Based on the available memory, the estimated maximum model length is "
            "32768.",
        ),
        (
            TEXTWRAPPED,
            "vllm_max_seq_len_over_kv_cache",
            "ValueError: The model's max seq len (131072) is larger than the maximum number of "
            "tokens that can be stored in KV cache",
        ),
        (
            SPLIT_IN_WORD,
            "allocation_out_of_device_memory",
            "RuntimeError: Allocation is out of device memory on current platform.",
        ),
        (
            COMFY_TAIL,
            "comfyui_allocation_on_device",
            "torch.OutOfMemoryError: Allocation on device",
        ),
        (
            "\x1b[31mERROR\x1b[0m XPU out of memory. Tried to allocate 1.50 GiB\nexiting\n",
            "out_of_memory",
            "ERROR XPU out of memory. Tried to allocate 1.50 GiB",
        ),
    ],
)
def test_classify_tail_joins_wrapped_lines(tail: str, pattern: str, excerpt: str) -> None:
    verdict = classify_tail(tail)
    assert verdict == TailVerdict(ErrorKind.INSUFFICIENT_VRAM, pattern, excerpt)


@pytest.mark.parametrize("tail", [VLLM_WRAPPED, TEXTWRAPPED, SPLIT_IN_WORD])
def test_wrapped_messages_escape_the_line_by_line_check(tail: str) -> None:
    """What the arbiter does today (each line alone) misses them."""
    assert not any(is_insufficient_vram_error(line) for line in tail.splitlines())


def test_classify_tail_red_team_negatives_as_one_tail() -> None:
    tail = "\n".join(NEGATIVES)
    # not memory; the last error line of the tail is reported as the error
    assert classify_tail(tail) == TailVerdict(
        ErrorKind.OTHER, None, "OSError: [Errno 12] Cannot allocate memory"
    )
    # and in every order of two, so a join of neighbours cannot make a match
    for first in NEGATIVES:
        for second in NEGATIVES:
            assert classify_tail(f"{first}\n{second}").kind is ErrorKind.OTHER, (first, second)


def test_classify_tail_of_nothing() -> None:
    assert classify_tail("") == TailVerdict(ErrorKind.OTHER)
    assert classify_tail("\n\n") == TailVerdict(ErrorKind.OTHER)


def test_classify_tail_rejects_non_text() -> None:
    with pytest.raises(TypeError, match=r"^classify_tail expects a str, got bytes$"):
        classify_tail(b"out of memory")  # type: ignore[arg-type]


def test_classify_tail_prefers_the_last_failure() -> None:
    tail = "XPU out of memory. Tried to allocate 2 GiB\nretrying\nInsufficient VRAM to load\n"
    assert classify_tail(tail).pattern == "insufficient_vram"


# -- warnings never decide (issue 28) --------------------------------------------------------

# ComfyUI recovers from a VAE decode out of memory by tiling, and says so with a warning; what
# stops it later is something else. Composed from ComfyUI's messages (comfy/sd.py's warning,
# ComfyUI's prompt log lines) and Python's traceback form.
COMFY_RECOVERED = """\
got prompt
Requested to load AutoencodingEngine
Warning: Ran out of memory when regular VAE decoding, retrying with tiled VAE decoding.
Prompt executed in 41.27 seconds
Traceback (most recent call last):
  File "/app/main.py", line 312, in <module>
    import execution
  File "/app/execution.py", line 14, in <module>
    import nodes
ModuleNotFoundError: No module named 'comfy_extras.nodes_hidream'
"""


@pytest.mark.parametrize(
    ("tail", "error"),
    [
        (COMFY_RECOVERED, "ModuleNotFoundError: No module named 'comfy_extras.nodes_hidream'"),
        # the same warning with ComfyUI's log timestamps, the error a plain exit
        (
            "[2026-12-04 04:40:38.499] Warning: Ran out of memory when regular VAE decoding, "
            "retrying with tiled VAE decoding.\n[2026-12-04 04:41:02.001] Killed\n",
            "",
        ),
        # vLLM's logger at WARNING, behind its process tag
        (
            "(EngineCore_DP0 pid=3905) WARNING 12-04 04:42:04 [gpu_model_runner.py:3310] "
            "CUDA out of memory while capturing graphs, retrying with a smaller batch\n"
            "(EngineCore_DP0 pid=3905) ERROR 12-04 04:42:05 [core.py:708] RuntimeError: "
            "device lost\n",
            "RuntimeError: device lost",
        ),
        # Python logging, its default format and PyTorch's C++ warning prefix
        ("2026-12-04 04:40:12,001 - root - WARNING - out of memory, retrying\nexit\n", ""),
        ("WARNING:root:insufficient VRAM for the fast path, using the slow one\n", ""),
        ("[W1204 04:40:12.000000000 alloc.cpp:80] XPU out of memory, retrying\n", ""),
    ],
    ids=[
        "comfyui-vae-then-import-error",
        "comfyui-timestamped",
        "vllm-warning-prefix",
        "python-logging",
        "logging-default-format",
        "pytorch-cpp",
    ],
)
def test_a_warning_never_decides(tail: str, error: str) -> None:
    """Each of these tails was read as insufficient VRAM before: the warning's memory words
    decided the whole tail and the real error was dropped."""
    assert classify_tail(tail) == TailVerdict(ErrorKind.OTHER, None, error)


def test_a_warning_does_not_hide_the_failure_after_it() -> None:
    tail = COMFY_RECOVERED.replace(
        "ModuleNotFoundError: No module named 'comfy_extras.nodes_hidream'",
        "torch.OutOfMemoryError: Allocation on device",
    )
    assert classify_tail(tail) == TailVerdict(
        ErrorKind.INSUFFICIENT_VRAM,
        "comfyui_allocation_on_device",
        "torch.OutOfMemoryError: Allocation on device",
    )


def test_a_warning_is_not_joined_to_its_neighbours() -> None:
    assert classify_tail("XPU out of\nWarning: low memory\nmemory\n").kind is ErrorKind.OTHER
    assert classify_tail("XPU out of\nmemory\n").kind is ErrorKind.INSUFFICIENT_VRAM


def test_the_error_reported_is_the_cause_not_the_pointer_at_it() -> None:
    tail = "\n".join(
        [
            "(EngineCore_DP0 pid=1) ERROR 12-04 04:40:13 [core.py:708] ValueError: "
            "User-specified max_model_len (65536) is greater than the derived max_model_len",
            "(APIServer pid=2) Traceback (most recent call last):",
            "(APIServer pid=2) RuntimeError: Engine core initialization failed. "
            "See root cause above. Failed core proc(s): {}",
        ]
    )
    assert classify_tail(tail) == TailVerdict(
        ErrorKind.OTHER,
        None,
        "ValueError: User-specified max_model_len (65536) is greater than the derived "
        "max_model_len",
    )
    # only the pointer: it is what there is
    assert classify_tail(tail.split("\n", 1)[1]).excerpt.startswith("RuntimeError: Engine core")


# -- real vLLM 0.32 logs (tests/fixtures/vllm/README.md says how they were made) -----------

VLLM_LOGS = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"


def real_log(name: str) -> str:
    return (VLLM_LOGS / name).read_text(encoding="utf-8")


def test_a_real_kv_cache_failure_is_insufficient_vram() -> None:
    """167 lines; the cause at lines 74 and 106, the last 50 lines the API server's traceback
    (the old 50-line tail read it as exited)."""
    log = real_log("kv-cache-start-failure.log")
    assert not is_insufficient_vram_error("".join(log.splitlines(keepends=True)[-50:]))
    verdict = classify_tail(log)
    assert (verdict.kind, verdict.pattern) == (
        ErrorKind.INSUFFICIENT_VRAM,
        "vllm_kv_cache_too_small",
    )
    assert verdict.excerpt.startswith(
        "ValueError: To serve at least one request with the model's max seq len (32768), (0.01 "
        "GiB KV cache is needed, which is larger than the available KV cache memory (0.0 GiB)."
    )


@pytest.mark.parametrize(
    ("name", "error"),
    [
        (
            "yarn-refusal.log",
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig "
            "Value error, User-specified max_model_len (65536) is greater than the derived "
            "max_model_len (max_position_embeddings=32768.0 or model_max_length=None in model's "
            "config.json).",
        ),
        (
            "bad-flag-value.log",
            "vllm serve: error: argument --max-num-seqs: invalid int value: 'lots'",
        ),
        (
            "unknown-tool-call-parser.log",
            "KeyError: 'invalid tool call parser: nosuchparser (chose from {",
        ),
        (
            "engine-killed.log",
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See "
            "stack trace (above) for the root cause.",
        ),
    ],
)
def test_real_failures_that_are_not_memory(name: str, error: str) -> None:
    """The YaRN refusal, a bad flag value, an unknown parser, a killed engine: not memory (no
    VRAM pass may follow them), and their own error is what is reported."""
    verdict = classify_tail(real_log(name))
    assert (verdict.kind, verdict.pattern) == (ErrorKind.OTHER, None)
    assert verdict.excerpt.startswith(error)


# -- linear time: what keeps every pattern fast (the benchmark measures it) ------------------


def _lookahead_width(items: Any) -> int:
    """The widest look-ahead anywhere in a parsed pattern (a look-ahead reads past a match)."""
    width = 0
    for item in items:
        if isinstance(item, re_parser.SubPattern):
            width = max(width, _lookahead_width(item))
        elif isinstance(item, (tuple, list)):
            if (
                len(item) == 2
                and item[0] in (re_constants.ASSERT, re_constants.ASSERT_NOT)
                and item[1][0] == 1
            ):
                width = max(width, item[1][1].getwidth()[1])
            width = max(width, _lookahead_width(item))
    return width


@pytest.mark.parametrize(
    ("regex", "needle"),
    [pair for p in errors._PATTERNS for pair in zip(p.regexes, p.needles, strict=True)],
    ids=lambda x: x.pattern[:24] if isinstance(x, re.Pattern) else "",
)
def test_every_pattern_starts_with_a_literal_and_is_bounded(
    regex: re.Pattern[bytes], needle: bytes
) -> None:
    """A literal first lets a string search skip a text without it and the regex engine skip
    to candidates at string-search speed; a bounded length (look-aheads included) is what the
    search from the end relies on and what keeps each candidate's cost constant (the
    unbounded ``.*`` of the old free-memory pattern made one long line quadratic)."""
    parsed = re_parser.parse(regex.pattern, regex.flags)
    lead = bytes(
        value
        for op, value in itertools.takewhile(lambda item: item[0] is re_constants.LITERAL, parsed)
    )
    assert needle and lead.startswith(needle)
    widest = parsed.getwidth()[1] + _lookahead_width(parsed)
    assert widest < errors._REACH


@pytest.mark.parametrize("seed", range(20))
def test_the_search_from_the_end_agrees_with_a_whole_search(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 7 bytes, so matches straddle chunk edges: the verdict is the whole search's,
    and what is found is a real match."""
    rng = random.Random(seed)
    parts = [text for text, _ in POSITIVES] + NEGATIVES + ["out of", "memory", "\n", " ", "x"]
    tail = "".join(rng.choice(parts) + rng.choice(["\n", " ", ""]) for _ in range(30))
    whole = classify_tail(tail)
    low = errors._lowered(errors._normalised(tail))
    monkeypatch.setattr(errors, "_CHUNK", 7)
    assert classify_tail(tail) == whole
    for pattern in errors._PATTERNS:
        for regex in pattern.regexes:
            found = errors._last_of(regex, low)
            assert (found is None) == (regex.search(low) is None)
            if found is not None:
                again = regex.search(low, found[0])
                assert again is not None and again.span() == found
