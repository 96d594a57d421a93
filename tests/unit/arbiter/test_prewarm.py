"""Pre-warming vLLM's weights while the last image job runs: read while MemAvailable allows,
stopped when it does not (never pushing out the job's memory), cancelled when vLLM is up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from arbiter_fakes import PNG, WORKFLOW, FakeClock, World, make_engine, run_until

from cardshare.arbiter import prewarm as pw
from cardshare.arbiter.api import status_doc
from cardshare.arbiter.states import Mode

MIB = 2**20
GIB = 2**30

# /proc/meminfo as Linux 6.x prints it (the fields around the one that counts)
MEMINFO = """MemTotal:       24576000 kB
MemFree:         1024000 kB
MemAvailable:   16384000 kB
Buffers:          102400 kB
Cached:         12000000 kB
"""


def test_mem_available_in_bytes() -> None:
    assert pw.mem_available(MEMINFO) == 16384000 * 1024
    with pytest.raises(ValueError, match="MemAvailable"):
        pw.mem_available("MemTotal: 1 kB\n")


def weights(tmp_path: Path, sizes: list[int]) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    for i, size in enumerate(sizes):
        (model / f"model-{i:05d}.safetensors").write_bytes(bytes([i % 251]) * size)
    (model / "config.json").write_text("{}")
    return model


def test_weight_files_in_a_stable_order(tmp_path: Path) -> None:
    model = weights(tmp_path, [10, 20])
    names = [p.name for p in pw.weight_files([model])]
    assert names == ["config.json", "model-00000.safetensors", "model-00001.safetensors"]


async def test_reads_everything_when_memory_allows(tmp_path: Path) -> None:
    model = weights(tmp_path, [3 * MIB, 70 * MIB])
    report = await pw.prewarm([model], GIB, lambda: 8 * GIB)
    assert report.state == "done"
    assert report.bytes_read == report.bytes_total == 73 * MIB + 2


async def test_stops_when_memory_runs_short(tmp_path: Path) -> None:
    model = weights(tmp_path, [100 * MIB])
    levels = iter([8 * GIB, 100 * MIB])  # plenty, then the job grew

    report = await pw.prewarm([model], GIB, lambda: next(levels))
    assert report.state == "stopped"
    assert "MemAvailable" in report.reason
    assert 0 < report.bytes_read < report.bytes_total


async def test_never_starts_below_the_margin(tmp_path: Path) -> None:
    model = weights(tmp_path, [MIB])
    report = await pw.prewarm([model], GIB, lambda: GIB)
    assert (report.state, report.bytes_read) == ("stopped", 0)


async def test_the_engine_prewarms_with_the_last_job_and_reports_it(tmp_path: Path) -> None:
    model = weights(tmp_path, [5 * MIB])
    world = World(FakeClock())
    engine = make_engine(
        tmp_path, world, idle_seconds=1.0, prewarm_paths=(str(model),), prewarm_margin_bytes=GIB
    )
    engine.swaps.meminfo = lambda: 8 * GIB
    job = engine.submit_job(WORKFLOW, {"in.png": PNG}).id
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)
    await run_until(engine, lambda e: e.swaps.prewarm_task is not None)
    task = engine.swaps.prewarm_task
    assert task is not None
    await asyncio.wait_for(asyncio.shield(task), 10)
    doc = status_doc(engine)["prewarm"]
    assert doc["state"] == "done" and doc["bytes_read"] == 5 * MIB + 2
    await run_until(
        engine,
        lambda e: e.mode is Mode.LLM and e.store.job(job).state.value == "done",  # type: ignore[union-attr]
    )
    assert engine.swaps.prewarm_task is None  # ended with the handback: the next period starts anew
