"""The engine under faults that outlive its remedies (issue 29): a ComfyUI fault restarts do
not cure, against the fakes of arbiter_fakes."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from arbiter_fakes import PNG, WORKFLOW, FakeClock, World, make_engine, run_until

from cardshare.arbiter.api import check_workflow
from cardshare.arbiter.common import Alert
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.states import Mode, Phase
from cardshare.arbiter.store import JobState, Store


def submit(engine: Engine, n: int = 1, workflow: dict[str, Any] | None = None) -> list[str]:
    return [engine.submit_job(workflow or WORKFLOW, {"in.png": PNG}).id for _ in range(n)]


def in_llm_with_no_jobs(e: Engine) -> bool:
    return e.state.phase is Phase.SERVE_LLM and e.store.queue_length() == 0


def restarts(world: World) -> int:
    return sum(1 for c in world.calls if c.startswith("restart image"))


async def test_a_look_on_disk_that_keeps_failing_fails_the_job_after_bounded_restarts(
    tmp_path: Path,
) -> None:
    """Every /view answers garbage: the look for the job's files before its first attempt
    failed, ComfyUI was restarted, and the attempt counter never moved (a restart without
    end). Now each restart counts against the job."""
    world = World(FakeClock(), garbage_next={"view": 10**6})
    engine = make_engine(tmp_path, world, idle_seconds=1.0)  # job_max_restarts 3
    ids = submit(engine, 2)
    await run_until(engine, in_llm_with_no_jobs, max_steps=2000)
    for job_id in ids:
        job = engine.store.job(job_id)
        assert job is not None and job.state is JobState.FAILED
        assert job.restarts == 3
        assert "gave up after 3 restarts of ComfyUI for this job (job_max_restarts 3)" in (
            job.reason
        ), job.reason
    assert restarts(world) == 6
    assert engine.faults[Alert.IMAGE_CRASHED] >= 1


async def test_the_restarts_of_an_hour_are_bounded_then_the_card_goes_back(
    tmp_path: Path,
) -> None:
    world = World(FakeClock(), garbage_next={"view": 10**6})
    engine = make_engine(
        tmp_path, world, idle_seconds=1.0, job_max_restarts=3, comfyui_max_restarts_per_hour=4
    )
    ids = submit(engine, 3)
    await run_until(
        engine,
        lambda e: e.state.phase is Phase.SERVE_LLM and Alert.IMAGE_RESTART_LIMIT in e.alerts,
        max_steps=2000,
    )
    assert restarts(world) == 4
    message = engine.alerts[Alert.IMAGE_RESTART_LIMIT]
    assert "(comfyui_max_restarts_per_hour 4)" in message and "2 job(s) kept queued" in message
    # no swap to image while the hour's restarts are spent, the jobs kept
    t0 = world.clock.now()
    await run_until(engine, lambda e: world.clock.now() - t0 > 1800, max_steps=100_000)
    assert restarts(world) == 4 and engine.state.phase is Phase.SERVE_LLM
    assert [engine.store.job(i).state for i in ids].count(JobState.FAILED) == 1  # type: ignore[union-attr]
    assert engine.store.queue_length() == 2
    # an hour after the first restart, the jobs are tried again (and fail: the fault stays)
    world.garbage_next.clear()
    await run_until(engine, in_llm_with_no_jobs, max_steps=100_000)
    assert Alert.IMAGE_RESTART_LIMIT not in engine.alerts
    assert [engine.store.job(i).state for i in ids][1:] == [JobState.DONE, JobState.DONE]  # type: ignore[union-attr]


# -- a database that cannot be written ------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    ["attempt to write a readonly database", "database or disk is full", "disk I/O error"],
)
async def test_a_database_that_cannot_be_written_gives_the_card_back_to_vllm(
    tmp_path: Path, error: str
) -> None:
    """Every write of the database fails while a job runs: the handback could not be
    written, and vLLM stayed stopped until storage healed (the card pinned in image mode).
    Now the way back to vLLM is taken in memory; new jobs are refused meanwhile; once the
    database works the state is written and the jobs end, each run once."""
    world = World(FakeClock(), job_seconds=5.0)
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    ids = submit(engine, 2)
    store = engine.store
    real_tx = store._tx

    @contextmanager
    def broken() -> Iterator[Any]:
        raise sqlite3.OperationalError(error)
        yield  # pragma: no cover

    stop = asyncio.Event()
    task = asyncio.ensure_future(engine.run(stop))
    for _ in range(20_000):
        await asyncio.sleep(0)
        if world.queue:  # ComfyUI runs the first job
            break
    assert engine.mode is Mode.IMAGE
    store._tx = broken  # type: ignore[method-assign]
    for _ in range(20_000):
        await asyncio.sleep(0)
        if engine.state.phase is Phase.SERVE_LLM and world.llm.running:
            break
    assert engine.state.phase is Phase.SERVE_LLM and engine.mode is Mode.LLM
    assert world.llm.running and not world.image.running
    assert store.machine(0.0).phase is not Phase.SERVE_LLM  # not written: taken in memory
    assert error in engine.alerts[Alert.STORAGE] or "database" in engine.alerts[Alert.STORAGE]
    assert engine.unwritten is not None
    store._tx = real_tx  # type: ignore[method-assign]
    for _ in range(50_000):
        await asyncio.sleep(0)
        if store.queue_length() == 0 and engine.state.phase is Phase.SERVE_LLM:
            break
    stop.set()
    await asyncio.wait_for(task, 5)
    assert [store.job(i).state for i in ids] == [JobState.DONE, JobState.DONE]  # type: ignore[union-attr]
    assert world.duplicates() == {}
    assert engine.unwritten is None and Alert.STORAGE not in engine.alerts
    assert store.machine(0.0).phase is Phase.SERVE_LLM


# -- save nodes the arbiter can find afterwards ---------------------------------------------


def _saving_through(kind: str) -> dict[str, Any]:
    return {
        "1": {"class_type": "LoadImage", "inputs": {"image": "in.png"}},
        "7": {"class_type": kind, "inputs": {"images": ["1", 0], "filename_prefix": "x"}},
    }


@pytest.mark.parametrize("kind", ["SaveImage", "SaveAnimatedPNG", "SaveAnimatedWEBP"])
def test_a_saver_whose_files_are_found_afterwards_is_taken(kind: str) -> None:
    assert check_workflow(_saving_through(kind))["7"]["class_type"] == kind


@pytest.mark.parametrize("kind", ["SaveAudio", "SaveVideo", "SaveLatent", "Image Save"])
def test_a_saver_whose_files_cannot_be_found_afterwards_is_refused(kind: str) -> None:
    with pytest.raises(ValueError) as err:
        check_workflow(_saving_through(kind))
    assert str(err.value) == (
        f"workflow saves through node 7 ({kind}): the arbiter finds a job's files after a "
        "restart of ComfyUI (so that it never runs twice) only for SaveAnimatedPNG, "
        "SaveAnimatedWEBP, SaveImage; save through one of them"
    )


async def test_a_webp_saved_before_comfyui_restarted_is_found_not_run_again(
    tmp_path: Path,
) -> None:
    """ComfyUI's history is gone (a restart) after a SaveAnimatedWEBP job saved its file:
    the look on disk found only .png files, and the job ran again."""
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    workflow = _saving_through("SaveAnimatedWEBP")
    (job_id,) = submit(engine, 1, workflow)
    job = engine.store.start_attempt(job_id, "p-1", world.clock.now())
    webp = b"RIFF\x0c\x00\x00\x00WEBPVP8 " + job_id.encode()
    world.files[(f"cardshare/{job_id}", "s0_00001_.webp")] = webp
    assert job.prompt_id == "p-1"  # recorded; ComfyUI knows it no more
    await run_until(engine, in_llm_with_no_jobs, max_steps=2000)
    done = engine.store.job(job_id)
    assert done is not None and done.state is JobState.DONE
    assert world.submissions == 0
    assert (tmp_path / "data" / "jobs" / job_id / "outputs" / "0.png").read_bytes() == webp


# -- the wall clock steps -------------------------------------------------------------------


@pytest.mark.parametrize("step", [-3600.0, 3600.0])
async def test_a_wall_clock_step_moves_no_timeout(tmp_path: Path, step: float) -> None:
    """Stepped back an hour, vLLM looked active an hour into the future (swaps blocked) and a
    hung job went untimed; stepped forward, a healthy job was failed at once."""
    world = World(FakeClock(), job_seconds=8.0)
    engine = make_engine(tmp_path, world, idle_seconds=5.0, job_timeout_seconds=20.0)
    world.clock.wall_step = step
    (healthy,) = submit(engine, 1)
    await run_until(engine, lambda e: world.submissions == 1, max_steps=2000)
    assert world.clock.monotonic() - 1_000_000.0 < 30.0  # the swap was not held an hour
    world.hang_next = 1  # the next prompt
    (hung,) = submit(engine, 1)
    begun = world.clock.monotonic()
    await run_until(engine, in_llm_with_no_jobs, max_steps=5000)
    done, failed = engine.store.job(healthy), engine.store.job(hung)
    assert done is not None and done.state is JobState.DONE, done
    assert failed is not None and failed.state is JobState.FAILED
    assert failed.reason.startswith("not finished within job_timeout_seconds (20)")
    assert world.clock.monotonic() - begun < 60.0


def test_the_store_tells_a_deleted_or_replaced_database_file(tmp_path: Path) -> None:
    store = Store(tmp_path / "arbiter.sqlite3")
    assert store.identity_problem() is None
    copy = tmp_path / "copy"
    shutil.copyfile(store.path, copy)
    copy.replace(store.path)
    assert store.identity_problem() == (
        f"the database {store.path} was replaced by another file while the arbiter ran"
    )
    store.path.unlink()
    assert store.identity_problem() == (
        f"the database {store.path} was deleted while the arbiter ran"
    )
    store.close()
