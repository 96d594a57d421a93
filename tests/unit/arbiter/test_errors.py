"""The insufficient-VRAM classifier, pinned by real error strings and red-team negatives.

Positive strings are the messages as printed by their sources: vLLM's worker check at
start, PyTorch's allocator (CUDA and XPU), Level Zero / Unified Runtime status names,
IPEX, node-llama-cpp's context check, GGML's allocator.
"""

from __future__ import annotations

import pytest

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
    assert classify_tail(tail) == TailVerdict(ErrorKind.OTHER)
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
