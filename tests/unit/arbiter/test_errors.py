"""The insufficient-VRAM classifier, pinned by real error strings and red-team negatives.

Positive strings are the messages as printed by their sources: vLLM's worker check at
start, PyTorch's allocator (CUDA and XPU), Level Zero / Unified Runtime status names,
IPEX, node-llama-cpp's context check, GGML's allocator.
"""

from __future__ import annotations

import pytest

from cardshare.errors import (
    ErrorKind,
    classify_error,
    is_insufficient_vram_error,
    matched_pattern,
    oom_killed_message,
    should_retry_for_vram,
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
]


@pytest.mark.parametrize(("text", "pattern"), POSITIVES)
def test_positives(text: str, pattern: str) -> None:
    assert matched_pattern(text) == pattern
    assert classify_error(text) is ErrorKind.INSUFFICIENT_VRAM


@pytest.mark.parametrize("text", NEGATIVES)
def test_negatives(text: str) -> None:
    assert classify_error(text) is ErrorKind.OTHER
    assert not is_insufficient_vram_error(text)


@pytest.mark.parametrize(
    ("text", "attempts", "expected"),
    [
        ("XPU out of memory", 1, True),
        ("XPU out of memory", 2, True),
        ("XPU out of memory", 3, False),
        ("model not found", 1, False),
    ],
)
def test_retry_at_most_three_attempts(text: str, attempts: int, expected: bool) -> None:
    assert should_retry_for_vram(text, attempts) is expected


def test_classify_rejects_non_text() -> None:
    with pytest.raises(TypeError, match=r"^classify_error expects a str, got bytes$"):
        classify_error(b"out of memory")  # type: ignore[arg-type]


def test_oom_killed_message() -> None:
    assert oom_killed_message("vllm-vllm-1") == (
        "container vllm-vllm-1 was killed by its memory cap (OOMKilled), not a VRAM problem; "
        "raise the memory limit"
    )
