"""The error classifier as it was before issue 28 (commit a8582d0, src/cardshare/errors.py),
its code unchanged (its own docstring left out), the baseline of bench_classifier.py: its
unbounded free-memory pattern, joined over the whole tail, makes it super-linear. Not used by
the package."""

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
    return _Pattern(name, re.compile(pattern, re.IGNORECASE | re.MULTILINE))


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
    # vLLM V1 at start, the KV cache for one request of max_model_len does not fit: "To serve
    # at least one request with the models's max seq len (40960), (5.62 GiB KV cache is needed,
    # which is larger than the available KV cache memory (4.50 GiB). Based on the available
    # memory, the estimated maximum model length is 32768. Try increasing
    # `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
    # (vllm/v1/core/kv_cache_utils.py; early V1 releases said "KV Cache memory").
    _p("vllm_kv_cache_too_small", r"larger than the available kv cache memory"),
    # vLLM V0 (vllm/worker/worker.py), the same failure: "The model's max seq len (32768) is
    # larger than the maximum number of tokens that can be stored in KV cache (22032)."
    _p(
        "vllm_max_seq_len_over_kv_cache",
        r"max seq len \(\d+\) is larger than the maximum number of tokens that can be stored "
        r"in kv cache",
    ),
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
    # ComfyUI: PyTorch's allocator (cudaMallocAsync backend) raises torch.OutOfMemoryError with
    # the bare message "Allocation on device " (ComfyUI issues 4852, 5278, 6073); ComfyUI logs
    # "!!! Exception during processing !!! Allocation on device " and reports
    # exception_message "Allocation on device ".  Only the message standing alone (at the
    # start of a line, after "!!!", a "...Error:" or "Exception Message:", optionally with a
    # device number) counts: "Allocation on device not large enough for array" (XLA) and
    # "// Mem allocation on device" do not.
    _p(
        "comfyui_allocation_on_device",
        r"(?:^|!!!|Error:|Exception Message:\**|\])[ \t]*Allocation on device(?:[ \t]+\d+)?[ \t]*$",
    ),
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
    """True when :func:`classify_error` says the text is the card running out of memory."""
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


# -- whole log tails -------------------------------------------------------------------------

# Prefixes a log line carries before its message, taken off (repeatedly, in any order) before
# lines are joined: ANSI colour codes, Docker's --timestamps, vLLM's process tag
# "(EngineCore_DP0 pid=18799) " and logger prefix "ERROR 10-08 20:33:48 [core.py:708] ",
# ComfyUI's "[2024-11-06 23:40:38.499] " and Python logging's "2024-12-16 17:10:56,767 - root -
# ERROR - ".
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PREFIX_RES = (
    re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)[ \t]+"),
    re.compile(r"^\([A-Za-z_][\w]*(?: pid=\d+)?\)[ \t]+"),
    re.compile(
        r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)[ \t]+\d\d-\d\d[ \t]+\d\d:\d\d:\d\d(?:\.\d+)?"
        r"[ \t]+\[[^\]]*\][ \t]+"
    ),
    re.compile(r"^\[\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?\][ \t]+"),
    re.compile(
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)? - [\w.]+ - "
        r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) - "
    ),
)


@dataclass(frozen=True)
class TailVerdict:
    """What :func:`classify_tail` found: the kind, the pattern and the message it matched.

    ``excerpt`` is the matching message with its log prefixes taken off and wrapped lines
    joined (empty for ``OTHER``).
    """

    kind: ErrorKind
    pattern: str | None = None
    excerpt: str = ""


def normalise_log_lines(tail: str) -> list[str]:
    """The lines of a log tail without colour codes and log prefixes, stripped."""
    out = []
    for raw in tail.splitlines():
        line = _ANSI_RE.sub("", raw).strip()
        changed = True
        while changed:
            changed = False
            for prefix in _PREFIX_RES:
                cut = prefix.sub("", line, count=1)
                if cut != line:
                    line, changed = cut.strip(), True
        out.append(line)
    return out


def _last_match(text: str) -> tuple[int, int, str] | None:
    """(start, end, pattern name) of the match ending last in ``text``."""
    best: tuple[int, int, str] | None = None
    for pattern in _PATTERNS:
        for found in pattern.regex.finditer(text):
            if best is None or found.end() > best[1]:
                best = (found.start(), found.end(), pattern.name)
    return best


def _excerpt(lines: list[str], starts: list[int], start: int, end: int, sep: str) -> str:
    first = max(i for i, s in enumerate(starts) if s <= start)
    last = max(i for i, s in enumerate(starts) if s < max(end, start + 1))
    return sep.join(lines[first : last + 1]).strip()


def classify_tail(tail: str) -> TailVerdict:
    """Classify a whole log tail; a message wrapped over several lines still matches.

    Lines are normalised (:func:`normalise_log_lines`), then searched line by line, then
    joined with a space (wrapped at a space, as ``textwrap`` and vLLM's messages do) and
    without one (split inside a word, as a logger cutting a long record does).  The match
    nearest the end of the tail wins: it is the failure that stopped the process.  The
    red-team negatives of :func:`classify_error` hold: only the known messages match, whether
    on one line or wrapped.
    """
    if not isinstance(tail, str):
        raise TypeError(f"classify_tail expects a str, got {type(tail).__name__}")
    lines = [line for line in normalise_log_lines(tail) if line]
    for sep in ("\n", " ", ""):
        starts = []
        offset = 0
        for line in lines:
            starts.append(offset)
            offset += len(line) + len(sep)
        text = sep.join(lines)
        found = _last_match(text)
        if found is not None:
            start, end, name = found
            joiner = " " if sep == "\n" else sep
            excerpt = _excerpt(lines, starts, start, end, joiner)
            return TailVerdict(ErrorKind.INSUFFICIENT_VRAM, name, excerpt)
    return TailVerdict(ErrorKind.OTHER)
