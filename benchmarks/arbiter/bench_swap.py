"""Benchmark: the arbiter's own share of a swap, beyond the containers' stop/start times.

Setup: the real engine, store (SQLite on disk, synchronous=FULL) and decision code, with
fake containers whose stop and start each sleep a fixed time (default 0.5 s), a fake card
view that reflects the containers at once, and fake vLLM/ComfyUI that answer at once.
Each round is a full cycle: swap to image, one job, hand back. The engine measures the
time spent awaiting container stop/start/readiness calls ("waited"); the own share is a
swap's total time minus that.

Run from the repository root:  .venv/bin/python benchmarks/arbiter/bench_swap.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2] / "src"))
sys.path.insert(0, str(HERE.parents[2] / "tests" / "unit" / "arbiter"))

from arbiter_fakes import (  # noqa: E402
    PNG,
    WORKFLOW,
    FakeCard,
    FakeComfy,
    FakeContainers,
    FakeLlm,
    FakeProxy,
    World,
    make_config,
)

from cardshare.arbiter.common import RealClock  # noqa: E402
from cardshare.arbiter.engine import Engine  # noqa: E402
from cardshare.arbiter.states import Phase  # noqa: E402
from cardshare.arbiter.store import Store  # noqa: E402


class SlowContainers(FakeContainers):
    def __init__(self, world: World, seconds: float) -> None:
        super().__init__(world)
        self.seconds = seconds

    async def start(self, role):  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.seconds)
        await super().start(role)

    async def stop(self, role, timeout_seconds):  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.seconds)
        await super().stop(role, timeout_seconds)


async def bench(rounds: int, container_seconds: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        world = World(RealClock())  # type: ignore[arg-type]
        config = make_config(Path(tmp), idle_seconds=0.001, poll_interval_seconds=0.01)
        engine = Engine(
            config=config,
            store=Store(config.data_dir / "arbiter.sqlite3"),
            containers=SlowContainers(world, container_seconds),
            llm=FakeLlm(world),
            comfy=FakeComfy(world),
            card=FakeCard(world),
            proxy=FakeProxy(world),
        )
        for _ in range(rounds):
            engine.submit_job(WORKFLOW, {"in.png": PNG})
            while engine.state.phase is Phase.SERVE_LLM:
                await engine.step()
            while not (engine.state.phase is Phase.SERVE_LLM and engine.store.queue_length() == 0):
                await engine.step()
        swaps = engine.store.swaps(2 * rounds)
        print(
            f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
        )
        print(
            f"setup: {rounds} rounds (swap to image, 1 job, handback); each container stop/start "
            f"sleeps {container_seconds} s; poll interval {config.poll_interval_seconds} s"
        )
        for direction in ("to_image", "to_llm"):
            rows = [s for s in swaps if s.direction == direction and s.ok]
            own = [s.own_seconds or 0.0 for s in rows]
            total = [s.total_seconds or 0.0 for s in rows]
            waited = [s.waited_seconds for s in rows]
            print(
                f"{direction}: n={len(rows)} total median {statistics.median(total):.3f} s, "
                f"waited median {statistics.median(waited):.3f} s, own median "
                f"{statistics.median(own) * 1000:.1f} ms, own max {max(own) * 1000:.1f} ms"
            )
        engine.store.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--container-seconds", type=float, default=0.5)
    args = parser.parse_args()
    start = time.perf_counter()
    asyncio.run(bench(args.rounds, args.container_seconds))
    print(f"wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
