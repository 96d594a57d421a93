"""Classify error text: is it the card running out of memory (VRAM), or something else?

Used by the arbiter for ComfyUI job errors and vLLM start failures. Deliberately
conservative: too broad and the arbiter would reclaim and retry on unrelated failures,
too narrow and it would miss the case the retry policy exists for. The patterns are
pinned by real error strings and by red-team negatives in the unit tests.

A container killed by its *host* memory cap (Docker's ``State.OOMKilled``) is not a VRAM
problem: :func:`oom_killed_message` words that case so nobody goes hunting on the card.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

# At most this many attempts (the first one plus two retries after reclaiming memory)
# when an operation fails for insufficient VRAM; no unbounded retry loop.
VRAM_MAX_ATTEMPTS = 3


class ErrorKind(StrEnum):
    INSUFFICIENT_VRAM = "insufficient_vram"
    OTHER = "other"


@dataclass(frozen=True)
class _Pattern:
    name: str
    regex: re.Pattern[str]


def _p(name: str, pattern: str) -> _Pattern:
    return _Pattern(name, re.compile(pattern, re.IGNORECASE))


# Each pattern names the source of the message it matches.
_PATTERNS: tuple[_Pattern, ...] = (
    # vLLM at start: "Free memory on device (7.1/31.8 GiB) on startup is less than desired
    # GPU memory utilization (0.85, 27.0 GiB)."
    _p(
        "vllm_free_memory",
        r"free memory on device\b.*\bless than desired gpu memory utili[sz]ation",
    ),
    # vLLM: "No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"
    _p("vllm_no_cache_memory", r"no available memory for the cache blocks"),
    # PyTorch: "CUDA out of memory", "XPU out of memory", "HIP out of memory", GGML/llama.cpp
    # "out of memory"; torch.OutOfMemoryError / torch.cuda.OutOfMemoryError class names.
    # The kernel's own OOM killer ("Out of memory: Killed process 42") is host memory: excluded.
    _p("out_of_memory", r"(?<![a-z_])out of memory(?![a-z_])(?!\s*:\s*kill)"),
    _p("out_of_memory_error", r"\b(?:torch\.(?:cuda\.|xpu\.)?)?OutOfMemoryError\b"),
    # Level Zero / Unified Runtime (Intel): UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY,
    # ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY; SYCL/PI: PI_ERROR_OUT_OF_RESOURCES is not memory.
    _p("level_zero_oom", r"\b(?:UR|ZE)_RESULT_ERROR_OUT_OF_DEVICE_MEMORY\b"),
    # IPEX / oneDNN: "Allocation is out of device memory on current platform."
    _p("allocation_out_of_device_memory", r"allocation is out of device memory"),
    # OpenCL: CL_MEM_OBJECT_ALLOCATION_FAILURE, CL_OUT_OF_RESOURCES is ambiguous -> not used.
    _p("opencl_alloc_failure", r"\bCL_MEM_OBJECT_ALLOCATION_FAILURE\b"),
    # node-llama-cpp: "A context size of 4096 is too large for the available VRAM"
    _p("too_large_for_vram", r"too large for the available vram"),
    # Generic safety checks: "insufficient VRAM", "not enough VRAM", "not enough device memory"
    _p(
        "insufficient_vram",
        r"\b(?:insufficient|not enough)\s+(?:free\s+)?(?:vram|gpu memory|device memory)\b",
    ),
    # Vulkan / GGML: "ErrorOutOfDeviceMemory", "failed to allocate ... buffer of size"
    _p("vulkan_oom", r"\bError(?:OutOfDeviceMemory|_OUT_OF_DEVICE_MEMORY)\b"),
)


def matched_pattern(text: str) -> str | None:
    """Name of the first insufficient-VRAM pattern the text matches, or None."""
    for pattern in _PATTERNS:
        if pattern.regex.search(text):
            return pattern.name
    return None


def classify_error(text: str) -> ErrorKind:
    """Classify one error text (a message, a log tail, an exception string)."""
    if not isinstance(text, str):
        raise TypeError(f"classify_error expects a str, got {type(text).__name__}")
    return ErrorKind.INSUFFICIENT_VRAM if matched_pattern(text) else ErrorKind.OTHER


def is_insufficient_vram_error(text: str) -> bool:
    return classify_error(text) is ErrorKind.INSUFFICIENT_VRAM


def should_retry_for_vram(text: str, attempts_made: int) -> bool:
    """Retry (after reclaiming memory) only for VRAM errors and only up to three attempts."""
    return is_insufficient_vram_error(text) and attempts_made < VRAM_MAX_ATTEMPTS


def oom_killed_message(container: str) -> str:
    """The wording for a container that Docker reports as ``State.OOMKilled``."""
    return (
        f"container {container} was killed by its memory cap (OOMKilled), not a VRAM problem; "
        "raise the memory limit"
    )
