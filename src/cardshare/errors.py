"""Classify error text: is it the card running out of memory (VRAM), or something else?

Used by the arbiter for ComfyUI job errors and vLLM start failures. Deliberately
conservative: too broad and the arbiter would reclaim and retry on unrelated failures,
too narrow and it would miss the case the retry policy exists for. The patterns are
pinned by real error strings and by red-team negatives in the unit tests.

A container killed by its *host* memory cap (Docker's ``State.OOMKilled``) is not a VRAM
problem: :func:`oom_killed_message` words that case so nobody goes hunting on the card.

A failed start's log is classified as a whole by :func:`classify_tail`, up to
:data:`LOG_WINDOW_BYTES` of it: the root cause is wherever the program printed it (real
vLLM prints it mid-log and ends with the API server's own traceback). A message wrapped over
several lines (vLLM's engine-core errors, Python's ``textwrap``, a logger that splits long
records) still matches, and each line's log prefix is taken off first so a wrapped
continuation line joins its message. A warning never decides: it reports something the
program recovered from (ComfyUI's "Warning: Ran out of memory when regular VAE decoding,
retrying with tiled VAE decoding.").

Linear time. Every pattern is searched on an ASCII lower-cased copy of the text, begins with
a literal (so the regex engine skips to candidates at string-search speed) and has a bounded
length; the arbiter's loop waits on this, so no input may make it slow (the unbounded
``.*`` of an earlier free-memory pattern took seconds on one long line).
``benchmarks/classifier/bench_classifier.py`` measures it against that earlier classifier.
"""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass
from enum import StrEnum

# At most this many attempts (the first one plus two retries after reclaiming memory)
# when an operation fails for insufficient VRAM; no unbounded retry loop.
VRAM_MAX_ATTEMPTS = 3

# How much of a failed start's log is classified: its last 256 KiB. A real vLLM 0.32 KV-cache
# start failure is 167 lines, 20 KB, its cause printed 7.1 KB and 4.4 KB from the end (61
# lines up); a tensor-parallel start prints one traceback a worker, several times that.
# 256 KiB holds about ten such logs and classifies in 1-19 ms of CPU (the benchmark's shapes),
# and bounds what the arbiter holds whatever the container printed.
LOG_WINDOW_BYTES = 256 * 1024


class ErrorKind(StrEnum):
    INSUFFICIENT_VRAM = "insufficient_vram"
    OTHER = "other"


@dataclass(frozen=True)
class _Pattern:
    name: str
    # searched on lower-cased ASCII bytes; any one matching is the pattern matching
    regexes: tuple[re.Pattern[bytes], ...]
    # the literal each regex begins with (a text without it cannot match: a string search,
    # faster than the regex engine's, skips the regex)
    needles: tuple[bytes, ...]


def _needle(pattern: bytes) -> bytes:
    """The literal a pattern begins with: its leading letters, digits, underscores and spaces
    (less the last one when a quantifier follows it)."""
    run = re.match(rb"[a-z0-9_ ]*", pattern)
    assert run is not None  # an empty run matches anywhere
    literal = run.group()
    if pattern[len(literal) : len(literal) + 1] in (b"?", b"*", b"+", b"{"):
        literal = literal[:-1]
    return literal


def _p(name: str, *patterns: bytes) -> _Pattern:
    return _Pattern(
        name,
        tuple(re.compile(p, re.MULTILINE) for p in patterns),
        tuple(_needle(p) for p in patterns),
    )


def _after(literal: bytes, leads: tuple[bytes, ...]) -> bytes:
    """``literal`` preceded by one of ``leads`` (fixed-width look-behinds after the literal,
    so the pattern still begins with the literal)."""
    lit = re.escape(literal)
    return lit + b"(?:" + b"|".join(b"(?<=" + lead + lit + b")" for lead in leads) + b")"


# ComfyUI's bare "Allocation on device" stands alone on its line, or follows one of these,
# with a space between at most (lines are normalised to single spaces). The text searched
# always starts with a newline, so its first line's start is a newline too.
_ALLOCATION_LEADS = tuple(
    lead + space
    for lead in (
        b"\\n",
        b"!!!",
        b"error:",
        b"exception message:",
        b"exception message:\\*",
        b"exception message:\\*\\*",
        b"\\]",
    )
    for space in (b"", b" ")
)

# Each pattern names the source of the message it matches. All are lower case: the text is
# lower-cased first.
_PATTERNS: tuple[_Pattern, ...] = (
    # vLLM at start: "Free memory on device (7.1/31.8 GiB) on startup is less than desired
    # GPU memory utilization (0.85, 27.0 GiB)." The gap is bounded and cannot hold the
    # pattern's own start again, so each character is looked at a bounded number of times.
    _p(
        "vllm_free_memory",
        rb"free memory on device\b(?:(?!free memory on device)[^\n]){0,200}?"
        rb"\bless than desired gpu memory utili[sz]ation",
    ),
    # vLLM: "No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"
    _p("vllm_no_cache_memory", rb"no available memory for the cache blocks"),
    # vLLM V1 at start, the KV cache for one request of max_model_len does not fit: "To serve
    # at least one request with the models's max seq len (40960), (5.62 GiB KV cache is needed,
    # which is larger than the available KV cache memory (4.50 GiB). Based on the available
    # memory, the estimated maximum model length is 32768. Try increasing
    # `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
    # (vllm/v1/core/kv_cache_utils.py; early V1 releases said "KV Cache memory").
    _p("vllm_kv_cache_too_small", rb"larger than the available kv cache memory"),
    # vLLM V0 (vllm/worker/worker.py), the same failure: "The model's max seq len (32768) is
    # larger than the maximum number of tokens that can be stored in KV cache (22032)."
    _p(
        "vllm_max_seq_len_over_kv_cache",
        rb"max seq len \(\d{1,20}\) is larger than the maximum number of tokens that can be "
        rb"stored in kv cache",
    ),
    # PyTorch: "CUDA out of memory", "XPU out of memory", "HIP out of memory", GGML/llama.cpp
    # "out of memory"; torch.OutOfMemoryError / torch.cuda.OutOfMemoryError class names.
    # The kernel's own OOM killer ("Out of memory: Killed process 42") is host memory: excluded.
    _p(
        "out_of_memory",
        rb"out of memory(?<![a-z_]out of memory)(?![a-z_])(?!\s{0,64}:\s{0,64}kill)",
    ),
    _p("out_of_memory_error", rb"outofmemoryerror\b(?<!\woutofmemoryerror)"),
    # Level Zero / Unified Runtime (Intel): UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY,
    # ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY; SYCL/PI: PI_ERROR_OUT_OF_RESOURCES is not memory.
    _p(
        "level_zero_oom",
        rb"ur_result_error_out_of_device_memory\b(?<!\wur_result_error_out_of_device_memory)",
        rb"ze_result_error_out_of_device_memory\b(?<!\wze_result_error_out_of_device_memory)",
    ),
    # IPEX / oneDNN: "Allocation is out of device memory on current platform."
    _p("allocation_out_of_device_memory", rb"allocation is out of device memory"),
    # OpenCL: CL_MEM_OBJECT_ALLOCATION_FAILURE, CL_OUT_OF_RESOURCES is ambiguous -> not used.
    _p(
        "opencl_alloc_failure",
        rb"cl_mem_object_allocation_failure\b(?<!\wcl_mem_object_allocation_failure)",
    ),
    # node-llama-cpp: "A context size of 4096 is too large for the available VRAM"
    _p("too_large_for_vram", rb"too large for the available vram"),
    # Generic safety checks: "insufficient VRAM", "not enough VRAM", "not enough device memory"
    _p(
        "insufficient_vram",
        rb"insufficient(?<!\winsufficient)\s{1,64}(?:free\s{1,64})?"
        rb"(?:vram|gpu memory|device memory)\b",
        rb"not enough(?<!\wnot enough)\s{1,64}(?:free\s{1,64})?"
        rb"(?:vram|gpu memory|device memory)\b",
    ),
    # Vulkan / GGML: "ErrorOutOfDeviceMemory", "failed to allocate ... buffer of size"
    _p(
        "vulkan_oom",
        rb"erroroutofdevicememory\b(?<!\werroroutofdevicememory)",
        rb"error_out_of_device_memory\b(?<!\werror_out_of_device_memory)",
    ),
    # ComfyUI: PyTorch's allocator (cudaMallocAsync backend) raises torch.OutOfMemoryError with
    # the bare message "Allocation on device " (ComfyUI issues 4852, 5278, 6073); ComfyUI logs
    # "!!! Exception during processing !!! Allocation on device " and reports
    # exception_message "Allocation on device ".  Only the message standing alone (at the
    # start of a line, after "!!!", a "...Error:" or "Exception Message:", optionally with a
    # device number) counts: "Allocation on device not large enough for array" (XLA) and
    # "// Mem allocation on device" do not.
    _p(
        "comfyui_allocation_on_device",
        _after(b"allocation on device", _ALLOCATION_LEADS) + rb"(?: \d{1,20})? ?$",
    ),
)

# What a pattern can look at beyond where its match starts (its longest match and
# look-ahead, with room to spare): a unit test holds every pattern to it.
_REACH = 1024
_CHUNK = 8192


def _lowered(text: str) -> bytes:
    """ASCII lower case, one byte a character (anything else is ``?``): offsets agree."""
    return text.encode("ascii", "replace").lower()


def matched_pattern(text: str) -> str | None:
    """Name of the first insufficient-VRAM pattern the text matches, or None."""
    low = b"\n" + _lowered(_SPACES_RE.sub(" ", text.replace("\t", " ")))
    for pattern in _PATTERNS:
        for regex, needle in zip(pattern.regexes, pattern.needles, strict=True):
            if needle in low and regex.search(low):
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


def oom_killed_message(container: str) -> str:
    """The wording for a container that Docker reports as ``State.OOMKilled``."""
    return (
        f"container {container} was killed by its memory cap (OOMKilled), not a VRAM problem; "
        "raise the memory limit"
    )


# -- whole logs --------------------------------------------------------------------------------

_ANSI_RE = re.compile(r"\x1b\[[0-9;]{0,32}[A-Za-z]")
_SPACES_RE = re.compile(r"  +")
# line separators str.splitlines() knows besides \n and \r
_OTHER_BREAKS = ("\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")

# Prefixes a log line carries before its message, taken off (repeatedly, in any order) before
# lines are joined: Docker's --timestamps, vLLM's process tag "(EngineCore_DP0 pid=18799) "
# and logger prefix "ERROR 10-08 20:33:48 [core.py:708] ", ComfyUI's "[2024-11-06
# 23:40:38.499] " and Python logging's "2024-12-16 17:10:56,767 - root - ERROR - ". Each
# pattern begins with a newline and a literal (lines are normalised to single spaces first),
# so the search skips to candidates at string-search speed; the text starts with a newline
# for its first line.
_VLLM_PREFIX = r" \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{1,9})? \[[^\]\n]{0,200}\] "
_PYLOG_PREFIX = r"\n20\d\d-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d{1,9})? - [\w.]{1,100} - "

# A warning's line: its logger said WARNING (vLLM's prefix, Python logging's), or its message
# says it is one ("Warning: ...", "WARNING:root:...", PyTorch's C++ "[W1008 ..."). Such a line
# is replaced by a mark before the patterns run: it never decides, and it still separates its
# neighbours (they are not joined across it).
_WARNING_MARK = "\x00"

# (literal it begins with, pattern, replacement): a prefix goes, a WARNING level prefix leaves
# the mark. A pattern whose literal is not in the text is not run (a string search is faster).
_PREFIX_RES = (
    (
        "\n20",
        re.compile(r"\n20\d\d-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:?\d\d) "),
        "\n",
    ),
    ("\n(", re.compile(r"\n\([A-Za-z_]\w{0,63}(?: pid=\d{1,10})?\) "), "\n"),
    ("\n[20", re.compile(r"\n\[20\d\d-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?\] "), "\n"),
    ("\n20", re.compile(_PYLOG_PREFIX + r"(?:DEBUG|INFO|ERROR|CRITICAL) - "), "\n"),
    ("\n20", re.compile(_PYLOG_PREFIX + r"WARNING - "), "\n" + _WARNING_MARK),
    *(
        ("\n" + level + " ", re.compile(r"\n" + level + _VLLM_PREFIX), "\n")
        for level in ("DEBUG", "INFO", "ERROR", "CRITICAL")
    ),
    ("\nWARNING ", re.compile(r"\nWARNING" + _VLLM_PREFIX), "\n" + _WARNING_MARK),
)
# A line with more prefixes than this is left with the rest (no real logger writes so many;
# the bound keeps the work linear).
_PREFIX_ROUNDS = 6
# (literal it begins with, pattern): the lines replaced by the mark
_WARNING_RES = (
    ("\n\x00", re.compile(r"\n\x00[^\n]*")),
    ("\nWarning", re.compile(r"\nWarning\b[^\n]*")),
    ("\nWARNING", re.compile(r"\nWARNING\b[^\n]*")),
    ("\nwarning", re.compile(r"\nwarning\b[^\n]*")),
    ("\n[W", re.compile(r"\n\[W\d{4} [^\n]*")),
)
_BLANK_LINES_RE = re.compile(r"\n\n+")


@dataclass(frozen=True)
class TailVerdict:
    """What :func:`classify_tail` found: the kind, the pattern and the message it matched.

    ``excerpt`` is the matching message with its log prefixes taken off and wrapped lines
    joined; for ``OTHER``, the last error the log shows (the last exception line, vLLM's
    "See root cause above" pointer passed over for the cause it points at), or empty.
    """

    kind: ErrorKind
    pattern: str | None = None
    excerpt: str = ""


def _one_of_each_break(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    for sep in _OTHER_BREAKS:
        if sep in text:
            text = text.replace(sep, "\n")
    return text


def _normalised(tail: str) -> str:
    """The log as lines without colour codes or log prefixes, runs of blanks made one space,
    warnings replaced by a mark, empty lines dropped; joined by newlines, with one at the
    start (so every line, the first too, follows a newline)."""
    text = _one_of_each_break(tail)
    if "\x1b" in text:
        text = _ANSI_RE.sub("", text)
    text = text.replace(_WARNING_MARK, " ").replace("\t", " ")
    text = _SPACES_RE.sub(" ", text)
    text = "\n" + text.replace("\n ", "\n").replace(" \n", "\n").strip(" ") + "\n"
    for _ in range(_PREFIX_ROUNDS):
        before = text
        for head, regex, replacement in _PREFIX_RES:
            if head in text:
                text = regex.sub(replacement, text)
        if text == before:
            break
    for head, regex in _WARNING_RES:
        if head in text:
            text = regex.sub("\n" + _WARNING_MARK, text)
    return _BLANK_LINES_RE.sub("\n", text).rstrip("\n")


def normalise_log_lines(tail: str) -> list[str]:
    """The lines of a log without colour codes and log prefixes, single-spaced, stripped;
    a warning's line is the mark ``"\\x00"``; empty lines dropped."""
    text = _normalised(tail)
    return text[1:].split("\n") if len(text) > 1 else []


def _last_of(regex: re.Pattern[bytes], text: bytes) -> tuple[int, int] | None:
    """(start, end) of a match of ``regex`` nearest the end of ``text``, or None.

    One search from the start says whether there is any; then chunks are searched from the
    end backwards, each only as far as its matches can reach, so the text is read about twice
    and only the last chunk's matches are walked in Python.
    """
    first = regex.search(text)
    if first is None:
        return None
    hi = len(text)
    while True:
        lo = max(first.start(), hi - _CHUNK)
        last = None
        for found in regex.finditer(text, lo, min(len(text), hi + _REACH)):
            if found.start() >= hi:
                break
            last = found
        if last is not None:
            return last.start(), last.end()
        hi = lo


def _last_match(text: bytes) -> tuple[int, int, str] | None:
    """(start, end, pattern name) of the match ending last in ``text``."""
    best: tuple[int, int, str] | None = None
    for pattern in _PATTERNS:
        for regex, needle in zip(pattern.regexes, pattern.needles, strict=True):
            found = _last_of(regex, text) if needle in text else None
            if found is not None and (best is None or found[1] > best[1]):
                best = (found[0], found[1], pattern.name)
    return best


def _lines_around(text: str, start: int, end: int) -> tuple[int, int]:
    """The span of the whole lines of ``text`` holding ``text[start:end]``."""
    first = text.rfind("\n", 0, start) + 1
    last = text.find("\n", max(end, start + 1) - 1)
    return first, len(text) if last < 0 else last


# The last line of a Python traceback ("ModuleNotFoundError: No module named 'x'",
# "torch.OutOfMemoryError: ...", "KeyboardInterrupt"), or argparse's refusal of a flag
# ("vllm serve: error: argument --max-num-seqs: invalid int value: 'lots'").
_EXCEPTION_RE = re.compile(
    r"\n((?:[A-Za-z_]\w{0,100}\.){0,10}[A-Za-z_]\w{0,100}"
    r"(?:Error|Exception|Exit|Interrupt)(?:: [^\n]*)?"
    r"|[\w./-]{1,100}(?: [\w./-]{1,100}){0,3}: error: [^\n]*)(?=\n|\Z)"
)
# pydantic's ValidationError says what failed on the lines after its own (vLLM's configs):
# "1 validation error for ModelConfig" then "Value error, User-specified max_model_len ..."
_PYDANTIC_RE = re.compile(r"(\d{1,3}) validation errors? for \S+$")
_PYDANTIC_TRAILER = "For further information visit "
# vLLM's API server ends a failed start with "RuntimeError: Engine core initialization
# failed. See root cause above." and a dead engine's requests with "EngineDeadError: ... See
# stack trace (above) for the root cause.": the cause, when printed, is before them
_POINTER_RE = re.compile(
    r"see root cause above|see stack trace \(above\) for the root cause", re.IGNORECASE
)
_ERROR_SEARCH_CHARS = 64 * 1024


def _last_error(text: str) -> str:
    """The last error the log's end shows (an exception line, with a pydantic error's
    details), preferring a cause to a pointer at one; empty when there is none."""
    cut = max(0, len(text) - _ERROR_SEARCH_CHARS)
    cut = max(0, text.find("\n", cut)) if cut else 0
    found = list(_EXCEPTION_RE.finditer(text, cut))
    causes = [m for m in found if not _POINTER_RE.search(m.group(1))]
    chosen = causes[-1] if causes else found[-1] if found else None
    if chosen is None:
        return ""
    error = chosen.group(1)
    pydantic = _PYDANTIC_RE.search(error)
    if pydantic is not None:
        after = text[chosen.end() + 1 :].split("\n", 2 * int(pydantic[1]) + 1)
        details = [line for line in after[: 2 * int(pydantic[1])] if line != _WARNING_MARK]
        details = [line for line in details if not line.startswith(_PYDANTIC_TRAILER)]
        error = " ".join([error, *details])
    return error[:1000]


def classify_tail(tail: str) -> TailVerdict:
    """Classify a whole log (the last :data:`LOG_WINDOW_BYTES` of it, say); a message
    wrapped over several lines still matches; a warning never decides.

    Lines are normalised (:func:`normalise_log_lines`), then searched line by line, then
    joined with a space (wrapped at a space, as ``textwrap`` and vLLM's messages do) and
    without one (split inside a word, as a logger cutting a long record does).  The match
    nearest the end of the log wins: it is the failure that stopped the process.  The
    red-team negatives of :func:`classify_error` hold: only the known messages match, whether
    on one line or wrapped.  Time is linear in the log's length.
    """
    if not isinstance(tail, str):
        raise TypeError(f"classify_tail expects a str, got {type(tail).__name__}")
    norm = _normalised(tail)
    low = _lowered(norm)
    for sep in (b"\n", b" ", b""):
        # the leading newline stays: the first line starts after one in every pass
        text = low if sep == b"\n" else b"\n" + low[1:].replace(b"\n", sep)
        found = _last_match(text)
        if found is None:
            continue
        start, end, name = found
        if sep == b"":  # back to offsets in ``norm``: add the newlines taken out before
            ends = list(itertools.accumulate(len(line) for line in norm[1:].split("\n")))
            start += bisect.bisect_right(ends, start - 1)
            end += bisect.bisect_right(ends, end - 2)
        first, last = _lines_around(norm, start, end)
        joiner = "" if sep == b"" else " "
        excerpt = norm[first:last].replace(_WARNING_MARK, "").replace("\n", joiner).strip()
        return TailVerdict(ErrorKind.INSUFFICIENT_VRAM, name, excerpt)
    return TailVerdict(ErrorKind.OTHER, None, _last_error(norm))
