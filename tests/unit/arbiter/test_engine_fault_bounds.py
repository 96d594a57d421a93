"""The engine under faults that outlive its remedies (issue 29): a ComfyUI fault restarts do
not cure, against the fakes of arbiter_fakes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arbiter_fakes import PNG, WORKFLOW, FakeClock, World, make_engine, run_until

from cardshare.arbiter.engine import Alert, Engine
from cardshare.arbiter.states import Phase
from cardshare.arbiter.store import JobState


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
