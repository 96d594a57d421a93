"""Pre-warm vLLM's weights into the page cache while the last image job runs.

A handback's longest part is vLLM reading its weights (the seed measured 56 s for the whole
handback). Read while ComfyUI still renders, they come from memory when vLLM starts. Only
when the host can afford it: the files are read while ``MemAvailable`` stays above what is
left to read plus a margin, checked every ``check_every`` bytes, so the page cache never
pushes out the running job's memory (the kernel would evict cache, not the job's anonymous
memory, but a job that grows needs the room). Reading is plain ``read()`` in chunks, in a
thread; nothing is written.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

CHUNK = 8 * 1024 * 1024
CHECK_EVERY = 64 * 1024 * 1024


def mem_available(meminfo: str) -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; ValueError when it is not there."""
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            fields = rest.split()
            if fields and fields[0].isdigit():
                unit = fields[1].lower() if len(fields) > 1 else ""
                return int(fields[0]) * (1024 if unit == "kb" else 1)
    raise ValueError("no MemAvailable line in the meminfo text")


def weight_files(paths: Iterable[Path]) -> list[Path]:
    """The regular files under the given files or directories, in a stable order."""
    found: list[Path] = []
    for path in paths:
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink()))
    return found


@dataclass
class PrewarmReport:
    state: str = "idle"  # idle, running, done, stopped (memory), failed
    files: int = 0
    bytes_total: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    reason: str = ""

    def doc(self) -> dict[str, object]:
        return {
            "state": self.state,
            "files": self.files,
            "bytes_total": self.bytes_total,
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 3),
            "reason": self.reason,
        }


def _read_all(
    files: list[Path],
    margin: int,
    available: Callable[[], int],
    report: PrewarmReport,
    cancelled: Callable[[], bool],
) -> None:
    started = time.monotonic()
    left = report.bytes_total
    since_check = CHECK_EVERY  # check before the first byte
    try:
        for path in files:
            with path.open("rb", buffering=0) as handle:
                while True:
                    if cancelled():
                        report.state, report.reason = "stopped", "cancelled"
                        return
                    if since_check >= CHECK_EVERY:
                        since_check = 0
                        free = available()
                        if free < left + margin:
                            report.state = "stopped"
                            report.reason = (
                                f"MemAvailable {free} bytes is below the {left} left to read "
                                f"plus the margin {margin}"
                            )
                            return
                    chunk = handle.read(CHUNK)
                    if not chunk:
                        break
                    report.bytes_read += len(chunk)
                    left -= len(chunk)
                    since_check += len(chunk)
        report.state = "done"
    except OSError as exc:
        report.state, report.reason = "failed", f"{type(exc).__name__}: {exc}"
    finally:
        report.seconds = time.monotonic() - started


async def prewarm(
    paths: Iterable[Path],
    margin: int,
    available: Callable[[], int],
    report: PrewarmReport | None = None,
) -> PrewarmReport:
    """Read the weight files under ``paths`` into the page cache while memory allows."""
    report = report or PrewarmReport()
    files = weight_files(paths)
    report.files = len(files)
    report.bytes_total = sum(os.stat(p).st_size for p in files)
    report.state = "running"
    stop = False
    try:
        await asyncio.to_thread(_read_all, files, margin, available, report, lambda: stop)
    except asyncio.CancelledError:
        stop = True  # the thread sees it at its next chunk
        raise
    return report


def read_meminfo(path: Path = Path("/proc/meminfo")) -> int:
    return mem_available(path.read_text(encoding="ascii", errors="replace"))
