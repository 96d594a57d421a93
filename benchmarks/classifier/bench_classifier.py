"""Benchmark: the error classifier on 1 MiB of adversarial log text, against the classifier
it replaced (issue 28), side by side.

The arbiter classifies a failed container's log in its event loop; the classifier before
issue 28 (``classifier_before.py``, a frozen copy) was super-linear: one line repeating "free
memory on device " for 80 KB took seconds. The goal: 1 MiB of any of these shapes classified
in under 100 ms (the arbiter reads at most ``LOG_WINDOW_BYTES``, 256 KiB, of a log).

Payloads, each exactly 1 MiB (``--size``) of text:

* ``free-memory-line``: one line, "free memory on device " repeated (the issue's report);
* ``pattern-prefixes``: one line of every pattern's message cut short at each length in turn
  (a near miss of every pattern at every step), with vLLM's log prefixes and "Warning: " mixed
  in;
* ``vllm-lines``: vLLM-shaped lines (process tag, logger prefix) each ending in a near miss,
  about 120 bytes a line;
* ``short-lines``: "x" lines, two bytes each (the most lines 1 MiB can hold but for empty ones);
* ``blanks``: one run of spaces and tabs, then a letter;
* ``warnings``: ComfyUI's VAE out-of-memory warning on every line (the new classifier reads
  no line of it; the old one read it as insufficient VRAM);
* ``real-failure``: vLLM's INFO lines, then the real vLLM 0.32 KV-cache start failure
  (tests/fixtures/vllm) at the end: the cause must be found (insufficient VRAM).

For each: the new ``classify_tail`` at the full size (median of ``--rounds`` wall times, and
its CPU time: the machine may be shared), then both classifiers at 16 KiB and 64 KiB (one round
each: the old one takes seconds there), and the old one at the full size in a child process
stopped after ``--old-timeout`` seconds. Ratios are old/new at the same size. The verdicts of
both are printed: they agree except where the old one was wrong (``warnings``).

Run from the repository root:
    .venv/bin/python benchmarks/classifier/bench_classifier.py [--rounds 5] [--old-timeout 60]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE.parent))

import classifier_before  # noqa: E402

from cardshare import errors  # noqa: E402

REAL_FAILURE = ROOT / "tests" / "fixtures" / "vllm" / "kv-cache-start-failure.log"
MESSAGES = (
    "ValueError: Free memory on device xpu:0 (7.12/31.84 GiB) on startup is less than desired "
    "GPU memory utilization (0.85, 27.06 GiB).",
    "No available memory for the cache blocks.",
    "(5.62 GiB KV cache is needed, which is larger than the available KV cache memory",
    "The model's max seq len (32768) is larger than the maximum number of tokens that can be "
    "stored in KV cache (22032).",
    "CUDA out of memory. Tried to allocate 2.00 GiB",
    "torch.OutOfMemoryError",
    "UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY",
    "Allocation is out of device memory on current platform.",
    "CL_MEM_OBJECT_ALLOCATION_FAILURE",
    "A context size of 8192 is too large for the available VRAM",
    "not enough free device memory for the KV cache",
    "vk::Device::allocateMemory: ErrorOutOfDeviceMemory",
    "!!! Exception during processing !!! Allocation on device 0",
    "(EngineCore_DP0 pid=18799) ",
    "ERROR 10-08 20:33:48 [core.py:708] ",
    "Warning: ",
)


def repeat_to(unit: str, size: int) -> str:
    return (unit * (size // len(unit) + 1))[:size]


def payloads(size: int) -> dict[str, str]:
    # each message cut at every length short of a match (a near miss of its pattern)
    prefixes = "".join(
        m[:k] + " "
        for m in MESSAGES
        for k in range(1, len(m))
        if errors.classify_tail(m[:k]).kind is errors.ErrorKind.OTHER
    )
    line = "(EngineCore_DP0 pid=18799) INFO 10-08 20:33:48 [gpu_worker.py:276] {} out of memor\n"
    vllm_lines = "".join(line.format(f"step {n:06d}") for n in range(size // len(line) + 1))
    real = REAL_FAILURE.read_text(encoding="utf-8")
    info = "(APIServer pid=19425) INFO 12-04 04:49:43 [loggers.py:335] Engine 000: idle\n"
    return {
        "free-memory-line": repeat_to("free memory on device ", size),
        "pattern-prefixes": repeat_to(prefixes, size),
        "vllm-lines": vllm_lines[:size],
        "short-lines": repeat_to("x\n", size),
        "blanks": repeat_to(" \t", size - 1) + "x",
        "warnings": repeat_to(
            "Warning: Ran out of memory when regular VAE decoding, retrying with tiled VAE "
            "decoding.\n",
            size,
        ),
        "real-failure": repeat_to(info, size - len(real)) + real,
    }


def timed(call: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds, result)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = call()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def verdict(result: Any) -> str:
    return f"{result.kind.value}{'/' + result.pattern if result.pattern else ''}"


def _old_child(text: str, out: Any) -> None:
    wall, cpu, result = timed(lambda: classifier_before.classify_tail(text))
    out.put((wall, cpu, verdict(result)))


def old_with_timeout(text: str, timeout: float) -> tuple[float, float, str] | None:
    """The old classifier in a child process (fork: the text is not copied through a pipe);
    None when it did not finish in ``timeout`` seconds."""
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_old_child, args=(text, out))
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        return None
    result: tuple[float, float, str] = out.get()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1024 * 1024, help="bytes of each payload")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--old-timeout", type=float, default=60.0)
    args = parser.parse_args()

    print(
        f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(f"python: {platform.python_implementation()} {platform.python_version()}")
    print(f"payload: {args.size} bytes a shape; new: median of {args.rounds} rounds")
    print(f"window the arbiter classifies: {errors.LOG_WINDOW_BYTES} bytes")
    worst = 0.0
    for name, text in payloads(args.size).items():
        print(f"\n{name}: {len(text)} characters, {text.count(chr(10))} newlines")
        runs = [timed(lambda t=text: errors.classify_tail(t)) for _ in range(args.rounds)]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        worst = max(worst, cpu)
        print(
            f"  new  {args.size // 1024:5d} KiB: {wall * 1e3:8.1f} ms wall, {cpu * 1e3:8.1f} ms "
            f"CPU  {verdict(runs[0][2])}"
        )
        for size in (16 * 1024, 64 * 1024):
            part = text[-size:]
            new = timed(lambda p=part: errors.classify_tail(p))
            old = timed(lambda p=part: classifier_before.classify_tail(p))
            print(
                f"  at {size // 1024:3d} KiB: new {new[1] * 1e3:8.1f} ms CPU  "
                f"old {old[1] * 1e3:9.1f} ms CPU  ratio old/new {old[1] / new[1]:8.1f}x  "
                f"(new {verdict(new[2])}, old {verdict(old[2])})"
            )
        full = old_with_timeout(text, args.old_timeout)
        if full is None:
            print(
                f"  old {args.size // 1024:5d} KiB: did not finish in {args.old_timeout:.0f} s "
                f"(ratio old/new over {args.old_timeout / cpu:.0f}x)"
            )
        else:
            print(
                f"  old {args.size // 1024:5d} KiB: {full[0] * 1e3:8.1f} ms wall, "
                f"{full[1] * 1e3:8.1f} ms CPU  {full[2]}  ratio old/new {full[1] / cpu:.1f}x"
            )
    print(f"\nslowest shape, new: {worst * 1e3:.1f} ms CPU (goal: under 100 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
