"""Benchmark: vLLM's start at a handback, with and without the arbiter's pre-warm.

Setup: a model directory of weight files (random bytes, ``--gib`` in all, written once and
fsynced), and the lab's vLLM stand-in (SIMULATION: it runs no model) started as a real
process with ``STANDIN_READ_WEIGHTS=1``: like vLLM's loader it reads every ``*.safetensors``
file to its end before it answers ``/health``, from the page cache when the files are there,
else from the disk. Each round runs both arms, in alternating order, side by side:

* cold: the files are dropped from the page cache (``posix_fadvise(DONTNEED)`` after
  ``fsync``: the pages are clean), then the stand-in starts;
* pre-warmed: the files are dropped, the arbiter's own pre-warm reads them (as it does while
  the last image job runs: not part of the handback), then the stand-in starts.

The time of an arm is from the stand-in's start to its first ``/health`` 200. The result is
the ratio of the medians (pre-warmed / cold) with the machine stated. The reference box's
handback took 56 s in the seed; the goal there is half. On a machine whose disk is fast
against its memory the ratio is closer to 1 than on a box reading 16 GB from a SATA SSD.

Run from the repository root:
    .venv/bin/python benchmarks/arbiter/bench_prewarm.py [--gib 1] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "src"))

from cardshare.arbiter.prewarm import prewarm, read_meminfo  # noqa: E402

STANDIN = ROOT / "lab" / "standins" / "vllm_standin.py"
FILE_BYTES = 256 * 1024 * 1024


def write_model(directory: Path, total: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"max_position_embeddings": 32768}\n')
    files = []
    index = 0
    while total > 0:
        size = min(FILE_BYTES, total)
        path = directory / f"model-{index:05d}-of-99999.safetensors"
        with path.open("wb") as handle:
            left = size
            while left > 0:
                block = os.urandom(min(left, 8 * 1024 * 1024))
                handle.write(block)
                left -= len(block)
            handle.flush()
            os.fsync(handle.fileno())
        files.append(path)
        total -= size
        index += 1
    return files


def drop(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_to_health(model: Path) -> float:
    port = free_port()
    env = {
        **os.environ,
        "STANDIN_READ_WEIGHTS": "1",
        "STANDIN_LOAD_SECONDS": "0",
        "CARDSHARE_SIM_ROOT": "/nonexistent",  # no simulated card: nothing registered
    }
    started = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(STANDIN),
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - started
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"the stand-in exited with {proc.returncode}") from None
                time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the weights (GiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the weights")
    args = parser.parse_args()
    total = int(args.gib * 1024**3)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        model = Path(tmp) / "model"
        files = write_model(model, total)
        cold: list[float] = []
        warm: list[float] = []
        prewarm_seconds: list[float] = []
        for round_ in range(args.rounds):
            for arm in ("cold", "warm") if round_ % 2 == 0 else ("warm", "cold"):
                drop(files)
                if arm == "warm":
                    report = asyncio.run(prewarm([model], 0, read_meminfo))
                    assert report.state == "done", report.doc()
                    prewarm_seconds.append(report.seconds)
                    warm.append(start_to_health(model))
                else:
                    cold.append(start_to_health(model))
        drop(files)
    ratio = statistics.median(warm) / statistics.median(cold)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(
        f"payload: {len(files)} weight files, {total / 1024**3:.2f} GiB; {args.rounds} rounds, "
        "arms alternating, one process at a time"
    )
    print(f"cold start to /health: median {statistics.median(cold):.3f} s  ({cold})")
    print(f"pre-warmed start to /health: median {statistics.median(warm):.3f} s  ({warm})")
    during = statistics.median(prewarm_seconds)
    print(f"pre-warm itself (during the last job): median {during:.3f} s")
    print(f"ratio pre-warmed / cold: {ratio:.2f}")


if __name__ == "__main__":
    main()
