"""Crash safety: (persisted phase, container states, ComfyUI history) -> actions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from arbiter_fakes import PNG, WORKFLOW, FakeClock, World, make_engine, run_until

from cardshare.arbiter.resume import JobStep, history_is_jobs, plan_job_step, plan_resume
from cardshare.arbiter.states import Outcome, Phase
from cardshare.arbiter.store import JobState
from cardshare.docker_api import DockerError

P = Phase


@pytest.mark.parametrize(
    ("phase", "llm", "image", "queue", "expected"),
    [
        (P.SERVE_LLM, True, False, 0, P.SERVE_LLM),
        (P.SERVE_LLM, False, False, 2, P.START_LLM),
        (P.SERVE_LLM, False, True, 0, P.STOP_IMAGE),
        (P.STOP_LLM, True, False, 2, P.STOP_LLM),
        (P.STOP_LLM, True, False, 0, P.SERVE_LLM),
        (P.STOP_LLM, False, False, 0, P.STOP_IMAGE),
        (P.STOP_LLM, False, False, 1, P.STOP_LLM),
        (P.WAIT_LLM_RELEASE, False, False, 1, P.WAIT_LLM_RELEASE),
        (P.WAIT_LLM_RELEASE, True, False, 1, P.STOP_LLM),
        (P.START_IMAGE, False, False, 1, P.START_IMAGE),
        (P.WAIT_IMAGE_READY, False, True, 1, P.WAIT_IMAGE_READY),
        (P.WAIT_IMAGE_READY, True, True, 1, P.STOP_IMAGE),
        (P.RUN_JOBS, False, True, 1, P.RUN_JOBS),
        (P.RUN_JOBS, False, False, 1, P.START_IMAGE),
        (P.RUN_JOBS, False, True, 0, P.STOP_IMAGE),
        (P.STOP_IMAGE, False, True, 0, P.STOP_IMAGE),
        (P.WAIT_IMAGE_RELEASE, False, False, 3, P.WAIT_IMAGE_RELEASE),
        (P.START_LLM, False, False, 0, P.START_LLM),
        (P.START_LLM, True, False, 0, P.WAIT_LLM_READY),
        (P.WAIT_LLM_READY, True, False, 0, P.WAIT_LLM_READY),
    ],
)
def test_plan_resume(phase: Phase, llm: bool, image: bool, queue: int, expected: Phase) -> None:
    assert plan_resume(phase, llm, image, queue).phase is expected


DONE: dict[str, Any] = {
    "status": {"status_str": "success", "completed": True, "messages": []},
    "outputs": {"9": {"images": [{"filename": "a.png", "subfolder": "", "type": "output"}]}},
}
ERROR: dict[str, Any] = {
    "status": {"status_str": "error", "completed": False, "messages": []},
    "outputs": {},
}
RUNNING: dict[str, Any] = {"status": {"status_str": None, "completed": False}, "outputs": {}}


@pytest.mark.parametrize(
    ("prompt_id", "history", "in_queue", "expected"),
    [
        (None, None, False, JobStep.NEW_ATTEMPT),
        ("p1", None, False, JobStep.LOOK_ON_DISK),
        ("p1", None, True, JobStep.POLL),
        ("p1", RUNNING, False, JobStep.POLL),
        ("p1", DONE, False, JobStep.FETCH_OUTPUTS),
        ("p1", ERROR, False, JobStep.FAILED),
        # the queue read first decides: a prompt still queued is polled, whatever else
        ("p1", DONE, True, JobStep.POLL),
    ],
    ids=["none", "in-neither", "queued", "running", "done", "error", "queue-first"],
)
def test_plan_job_step(
    prompt_id: str | None, history: dict[str, Any] | None, in_queue: bool, expected: JobStep
) -> None:
    assert plan_job_step(prompt_id, in_queue, history) is expected


def _persist(engine: Any, path: list[Phase]) -> None:
    for phase in path:
        engine.state = engine.store.transition(phase, Outcome.RESUME, "setup", engine.clock.now())


TO_RUN = [P.STOP_LLM, P.WAIT_LLM_RELEASE, P.START_IMAGE, P.WAIT_IMAGE_READY, P.RUN_JOBS]


@pytest.mark.parametrize(
    ("comfy_history", "expected_submissions", "outputs_fetched"),
    [
        ("done", 0, True),  # finished while the arbiter was down: fetch, never resubmit
        ("queued", 0, True),  # still running: keep polling the same prompt
        ("never", 1, True),  # killed between recording and submitting: submit the same id
    ],
)
async def test_killed_during_a_job_never_runs_it_twice(
    tmp_path: Path, comfy_history: str, expected_submissions: int, outputs_fetched: bool
) -> None:
    world = World(FakeClock())
    world.llm.running = False
    world.image.running = True
    engine = make_engine(tmp_path, world)
    job = engine.submit_job(WORKFLOW, {"in.png": PNG})
    _persist(engine, TO_RUN)
    job = engine.store.start_attempt(job.id, "prompt-1", engine.clock.now())
    if comfy_history == "done":  # saved under the job's own subfolder, as its prompt says
        image = {"filename": "s0_00001_.png", "subfolder": f"cardshare/{job.id}", "type": "output"}
        world.history["prompt-1"] = {
            "status": {"status_str": "success", "completed": True, "messages": []},
            "outputs": {"2": {"images": [image]}},
        }
        world.files[(f"cardshare/{job.id}", "s0_00001_.png")] = PNG
    elif comfy_history == "queued":
        world.prompts["prompt-1"] = await engine.jobs.prepare(job)
        world.queue.append("prompt-1")
    engine.store.close()

    # a new arbiter on the same database (as after SIGKILL)
    engine = make_engine(tmp_path, world)
    assert engine.state.phase is P.RUN_JOBS
    assert await engine.resume()
    await run_until(engine, lambda e: e.state.phase is P.SERVE_LLM)
    after = engine.store.job(job.id)
    assert after is not None
    assert (after.state, after.attempts, after.prompt_id) == (JobState.DONE, 1, "prompt-1")
    assert world.submissions == expected_submissions
    out = tmp_path / "data" / "jobs" / job.id / "outputs" / "0.png"
    assert out.exists() is outputs_fetched


@pytest.mark.parametrize(
    ("path", "llm", "image", "queue", "first_calls"),
    [
        # killed in stop_llm with vLLM still running and jobs queued: continue the swap
        (TO_RUN[:1], True, False, 1, ["stop llm", "start image"]),
        # killed in stop_llm, queue emptied meanwhile: back to llm without touching vLLM
        (TO_RUN[:1], True, False, 0, []),
        # killed in run_jobs after ComfyUI died: restart it, resume the queue
        (TO_RUN, False, False, 1, ["start image"]),
        # killed in start_llm: start it (idempotent), then wait until ready
        (
            [*TO_RUN, P.STOP_IMAGE, P.WAIT_IMAGE_RELEASE, P.START_LLM],
            False,
            False,
            0,
            ["start llm"],
        ),
    ],
    ids=["stop_llm-continue", "stop_llm-back", "run_jobs-comfy-dead", "start_llm"],
)
async def test_killed_in_a_phase_converges(
    tmp_path: Path, path: list[Phase], llm: bool, image: bool, queue: int, first_calls: list[str]
) -> None:
    world = World(FakeClock())
    world.llm.running, world.image.running = llm, image
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    ids = [engine.submit_job(WORKFLOW, {}).id for _ in range(queue)]
    _persist(engine, path)
    engine.store.close()

    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    assert await engine.resume()
    await run_until(engine, lambda e: e.state.phase is P.SERVE_LLM and e.store.queue_length() == 0)
    assert world.calls[: len(first_calls)] == first_calls
    assert world.llm.running and not world.image.running
    assert [engine.store.job(i).state for i in ids] == [JobState.DONE] * queue  # type: ignore[union-attr]


async def test_resume_waits_for_docker(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world)

    async def no_engine(role: str) -> Any:
        raise DockerError("Docker Engine at /run/docker.sock did not answer GET /x: refused")

    engine.containers.state = no_engine  # type: ignore[method-assign]
    assert await engine.resume() is False
    assert engine.alerts == {
        "docker": "Docker Engine at /run/docker.sock did not answer GET /x: refused"
    }
    assert engine.state.phase is P.SERVE_LLM


_OWN = {"9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "cardshare/j1/s0"}}}
_OTHER = {"9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "cardshare/j2/s0"}}}


def _saved(subfolder: str) -> dict[str, Any]:
    return {"9": {"images": [{"filename": "s0_00001_.png", "subfolder": subfolder}]}}


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"prompt": [0, "p", _OWN, {}, ["9"]], "outputs": _saved("cardshare/j1")}, True),
        # another job's prompt under the id: never taken, whatever its outputs say
        ({"prompt": [0, "p", _OTHER, {}, ["9"]], "outputs": _saved("cardshare/j1")}, False),
        # a look-alike subfolder is not the job's
        ({"prompt": [0, "p", {"9": {"inputs": {"filename_prefix": "cardshare/j10/s0"}}}]}, False),
        ({"prompt": [0, "p", "garbage"]}, False),
        # no prompt kept: its images decide
        ({"outputs": _saved("cardshare/j1")}, True),
        ({"outputs": _saved("cardshare/j2")}, False),
        ({"status": {"status_str": "error"}, "outputs": {}}, True),  # nothing says otherwise
    ],
    ids=["own", "other-prompt", "look-alike", "garbage", "own-images", "other-images", "error"],
)
def test_a_history_entry_is_the_jobs_only_when_its_prompt_writes_there(
    entry: dict[str, Any], expected: bool
) -> None:
    assert history_is_jobs(entry, "cardshare/j1") is expected
