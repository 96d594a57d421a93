"""The engine against fakes at every edge: swaps, jobs, faults, handback, timings."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from arbiter_fakes import PNG, WORKFLOW, FakeClock, World, make_engine, run_until

from cardshare.arbiter.cardview import CardClient
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.states import Mode, Phase
from cardshare.arbiter.store import JobState


def in_llm_with_no_jobs(e: Engine) -> bool:
    return e.state.phase is Phase.SERVE_LLM and e.store.queue_length() == 0


def submit(engine: Engine, n: int = 1) -> list[str]:
    return [engine.submit_job(WORKFLOW, {"in.png": PNG}).id for _ in range(n)]


async def test_three_jobs_swap_run_and_hand_back(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world)
    ids = submit(engine, 3)
    await run_until(engine, lambda e: e.state.phase is Phase.RUN_JOBS)
    assert world.calls[:2] == ["stop llm", "start image"]
    await run_until(engine, in_llm_with_no_jobs)
    assert world.calls == ["stop llm", "start image", "stop image", "start llm", "one_token"]
    for job_id in ids:
        job = engine.store.job(job_id)
        assert job is not None
        assert (job.state, job.outputs, job.attempts) == (JobState.DONE, 1, 1)
        out = tmp_path / "data" / "jobs" / job_id / "outputs" / "0.png"
        assert out.read_bytes() == PNG + b"s0_00001_.png"
        assert world.files[(f"cardshare/{job_id}", "s0_00001_.png")] == out.read_bytes()
    # the workflow points at the uploaded input under its unique name
    uploaded = f"cardshare-{ids[0]}-in.png"
    assert world.uploads[uploaded] == PNG
    first = engine.store.job(ids[0])
    assert first is not None and first.prompt_id is not None
    assert world.prompts[first.prompt_id]["1"]["inputs"]["image"] == uploaded
    swaps = engine.store.swaps(10)
    assert [(s.direction, s.ok) for s in swaps] == [("to_llm", True), ("to_image", True)]
    assert [p.phase for p in swaps[1].phases] == [
        "stop_llm",
        "wait_llm_release",
        "start_image",
        "wait_image_ready",
    ]
    assert [p.phase for p in swaps[0].phases] == [
        "stop_image",
        "wait_image_release",
        "start_llm",
        "wait_llm_ready",
    ]


async def test_no_swap_before_idle_seconds(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=30.0)
    submit(engine)
    start = world.clock.now()
    await run_until(engine, lambda e: e.state.phase is Phase.STOP_LLM)
    assert world.clock.now() - start >= 30.0
    assert engine.last_decision.go


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (
            lambda w: w.others.append(CardClient("plex", 2 * 2**30, ("vcs",))),
            "another client is on the card: plex holds 2.0 GiB VRAM and keeps vcs busy",
        ),
        (
            lambda w: w.proxy.update(in_flight=0, held=2),
            "the proxy has 0 request(s) in flight and 2 held",
        ),
        (lambda w: setattr(w, "running", 1), "needs 5 s idle"),
    ],
    ids=["plex", "held", "running"],
)
async def test_vetoes_block_the_swap(tmp_path: Path, setup: object, reason: str) -> None:
    world = World(FakeClock())
    setup(world)  # type: ignore[operator]
    engine = make_engine(tmp_path, world, idle_seconds=5.0)
    submit(engine)
    for _ in range(20):
        await engine.step()
    assert engine.state.phase is Phase.SERVE_LLM
    assert any(reason in r for r in engine.last_decision.reasons), engine.last_decision


async def test_veto_lifts_when_plex_ends(tmp_path: Path) -> None:
    world = World(FakeClock())
    world.others.append(CardClient("plex", 2 * 2**30, ("vcs",)))
    engine = make_engine(tmp_path, world, idle_seconds=5.0)
    submit(engine)
    for _ in range(10):
        await engine.step()
    assert engine.mode is Mode.LLM
    world.others.clear()
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)


async def test_comfy_rejection_fails_job_with_node_errors(tmp_path: Path) -> None:
    world = World(FakeClock())
    world.reject_next = {
        "error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed"},
        "node_errors": {"2": {"errors": [{"message": "Required input is missing"}]}},
    }
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    (job_id,) = submit(engine)
    await run_until(engine, in_llm_with_no_jobs)
    job = engine.store.job(job_id)
    assert job is not None
    assert job.state is JobState.FAILED
    assert job.reason == (
        "ComfyUI rejected the workflow: Prompt outputs failed; node_errors: "
        '{"2": {"errors": [{"message": "Required input is missing"}]}}'
    )


async def test_comfy_dies_mid_job_is_restarted_and_job_retried(tmp_path: Path) -> None:
    world = World(FakeClock())
    world.die_on_submit = 1
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    (job_id,) = submit(engine)
    await run_until(engine, in_llm_with_no_jobs)
    job = engine.store.job(job_id)
    assert job is not None
    assert (job.state, job.attempts) == (JobState.DONE, 2)
    # restart means restart: a new start time, whatever the container's state was
    assert world.calls.count("start image") == 1
    assert world.calls.count("restart image") == 1
    assert world.image.starts == 2
    assert world.duplicates() == {}


async def test_comfy_dies_every_time_gives_up_after_max_attempts(tmp_path: Path) -> None:
    world = World(FakeClock())
    world.die_on_submit = 5
    world.oom_on_die = True
    engine = make_engine(tmp_path, world, idle_seconds=1.0, job_max_attempts=3)
    (job_id,) = submit(engine)
    await run_until(engine, in_llm_with_no_jobs)
    job = engine.store.job(job_id)
    assert job is not None
    assert (job.state, job.attempts) == (JobState.FAILED, 3)
    assert job.reason == (
        "ComfyUI stopped answering (POST /prompt: connection reset); container "
        "comfyui-comfyui-1 was killed by its memory cap (OOMKilled), not a VRAM problem; "
        "raise the memory limit; gave up after 3 attempt(s)"
    )


@pytest.mark.parametrize(
    ("errors", "state", "attempts", "reason_start"),
    [
        (["XPU out of memory. Tried to allocate 2.00 GiB"], JobState.DONE, 2, ""),
        (
            ["XPU out of memory."] * 3,
            JobState.FAILED,
            3,
            "insufficient VRAM after 3 attempt(s): node KSampler raised RuntimeError: XPU out",
        ),
        (
            ["mat1 and mat2 shapes cannot be multiplied"],
            JobState.FAILED,
            1,
            "ComfyUI error: node KSampler raised RuntimeError: mat1 and mat2",
        ),
    ],
    ids=["vram-once", "vram-thrice", "other-error"],
)
async def test_job_errors_vram_retried_at_most_three_times(
    tmp_path: Path, errors: list[str], state: JobState, attempts: int, reason_start: str
) -> None:
    world = World(FakeClock())
    world.error_next = list(errors)
    engine = make_engine(tmp_path, world, idle_seconds=1.0, job_max_attempts=5)
    (job_id,) = submit(engine)
    await run_until(engine, in_llm_with_no_jobs)
    job = engine.store.job(job_id)
    assert job is not None
    assert (job.state, job.attempts) == (state, attempts)
    assert job.reason.startswith(reason_start)


async def test_vllm_not_ready_retries_with_backoff_and_stays_swapping(tmp_path: Path) -> None:
    world = World(FakeClock())
    world.llm_never_ready = True
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    submit(engine)
    await run_until(engine, lambda e: e.state.phase is Phase.STOP_IMAGE)
    for _ in range(12):
        await engine.step()
        assert engine.mode is not Mode.LLM
    assert engine.mode is Mode.SWAPPING
    assert engine.alerts["llm_not_ready"].startswith("vLLM not ready within 10 s (attempt ")
    assert world.calls.count("start llm") >= 3
    world.llm_never_ready = False
    await run_until(engine, lambda e: e.mode is Mode.LLM)
    assert "llm_not_ready" not in engine.alerts


@pytest.mark.parametrize(
    ("logs", "oom", "alert", "message"),
    [
        (
            "ValueError: Free memory on device (3.1/31.8 GiB) on startup is less than desired "
            "GPU memory utilization (0.85, 27.0 GiB).",
            False,
            "llm_insufficient_vram",
            "vLLM could not get its memory",
        ),
        (
            "",
            True,
            "llm_oom_killed",
            "container vllm-vllm-1 was killed by its memory cap (OOMKilled), not a VRAM problem; "
            "raise the memory limit",
        ),
    ],
    ids=["vram", "oomkilled"],
)
async def test_vllm_start_failures_are_classified(
    tmp_path: Path, logs: str, oom: bool, alert: str, message: str
) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    submit(engine)
    await run_until(engine, lambda e: e.state.phase is Phase.STOP_IMAGE)
    if oom:
        world.llm.oom_killed = True
        world.llm_never_ready = True

        async def start_oom(role: str) -> None:
            world.calls.append(f"start {role}")
            world.container(role).running = role != "llm"  # type: ignore[arg-type]

        engine.containers.start = start_oom  # type: ignore[method-assign]
    else:
        world.llm_fails_start = logs
    for _ in range(8):
        await engine.step()
    assert engine.mode is Mode.SWAPPING
    assert engine.alerts[alert].startswith(message)
    if not oom:
        assert "insufficient VRAM: ValueError: Free memory on device" in engine.alerts[alert]


async def test_max_image_seconds_hands_back_between_jobs(tmp_path: Path) -> None:
    world = World(FakeClock())
    world.job_seconds = 4.5  # each job takes about 5 s
    engine = make_engine(tmp_path, world, idle_seconds=1.0, max_image_seconds=8.0)
    ids = submit(engine, 4)
    await run_until(engine, lambda e: e.state.phase is Phase.STOP_IMAGE)
    states = [engine.store.job(i).state for i in ids]  # type: ignore[union-attr]
    assert states.count(JobState.DONE) == 2
    assert states.count(JobState.QUEUED) == 2
    assert "image mode has lasted" in engine.last_decision.reasons[0]


async def test_waiting_agent_hands_back_after_current_job(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    ids = submit(engine, 3)
    await run_until(engine, lambda e: e.store.job(ids[0]).state is JobState.DONE)
    world.proxy.update(held=1)
    await run_until(engine, lambda e: e.state.phase is Phase.STOP_IMAGE)
    assert engine.last_decision.reasons == ("1 agent request(s) held at the proxy",)
    assert engine.store.job(ids[2]).state is JobState.QUEUED  # type: ignore[union-attr]


async def test_memory_never_released_goes_back_to_llm(tmp_path: Path) -> None:
    world = World(FakeClock())
    world.llm_vram_lingers = True
    engine = make_engine(tmp_path, world, idle_seconds=1.0, llm_release_timeout_seconds=3.0)
    submit(engine)
    await run_until(engine, lambda e: e.state.phase is Phase.START_LLM)
    assert engine.alerts["llm_release_timeout"] == (
        "memory not released after 3 s: vllm/vllm still hold 27.0 GiB"
    )
    assert "start image" not in world.calls


async def test_memory_released_after_the_first_look_is_seen_at_a_later_one(
    tmp_path: Path,
) -> None:
    """vLLM's memory lingers past the first scan after its stop: each look of the wait
    scans again, so the release is seen within a poll, not at the timeout."""
    world = World(FakeClock())
    world.llm_release_seconds = 3.0
    engine = make_engine(tmp_path, world, idle_seconds=1.0, llm_release_timeout_seconds=30.0)
    submit(engine)
    await run_until(engine, lambda e: e.state.phase is Phase.WAIT_LLM_RELEASE)
    began = world.clock.now()
    await run_until(engine, lambda e: e.state.phase is not Phase.WAIT_LLM_RELEASE)
    assert engine.state.phase is Phase.START_IMAGE
    assert world.clock.now() - began < 3.0 + 2 * engine.config.poll_interval_seconds
    assert "llm_release_timeout" not in engine.alerts


async def test_a_client_that_came_after_the_last_scan_vetoes_the_swap(tmp_path: Path) -> None:
    """A Plex transcode starts after the arbiter's last scan, which is still young enough
    to weigh a swap on: the swap is confirmed on a scan of its own, which shows Plex."""
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=5.0, card_data_max_age_seconds=120.0)
    submit(engine)
    await engine.step()  # queued, vLLM not idle long enough yet: the card scanned now
    assert engine.watch.last is not None and engine.watch.last.others(("vllm/vllm",)) == ()
    world.others.append(CardClient("plex/plex", 2 * 2**30, ("vcs",)))
    for _ in range(20):
        await engine.step()
    assert "stop llm" not in world.calls
    assert engine.state.phase is Phase.SERVE_LLM
    assert any("plex/plex" in r for r in engine.last_decision.reasons), engine.last_decision
    world.others.clear()
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)


async def test_swap_timings_split_waited_and_own(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    submit(engine)
    await run_until(engine, in_llm_with_no_jobs)
    for swap in engine.store.swaps(2):
        assert swap.total_seconds is not None
        assert swap.own_seconds == pytest.approx(swap.total_seconds - swap.waited_seconds)
        assert swap.own_seconds == pytest.approx(0.0)  # the fake clock moves only in waits


def test_decode_inputs_rejects_paths() -> None:
    from cardshare.arbiter.jobs import decode_inputs

    with pytest.raises(ValueError, match=r"^input name '../x.png' must be a plain file name: "):
        decode_inputs({"../x.png": base64.b64encode(PNG).decode()})
    assert decode_inputs({"a.png": base64.b64encode(PNG).decode()}) == {"a.png": PNG}
