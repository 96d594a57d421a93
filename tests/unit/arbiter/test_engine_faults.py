"""The engine under faults (issue: never wedged, never twice, never silent), against fakes
with the real services' semantics (see arbiter_fakes): every test here failed before the
guard, the queue-first poll, the on-disk evidence, the real restart and the backoffs."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from arbiter_fakes import PNG, WORKFLOW, FakeClock, World, make_engine, run_until

from cardshare.arbiter.cardview import CardClient
from cardshare.arbiter.common import Alert
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.resume import save_prefix, saved_file_name
from cardshare.arbiter.states import Mode, Phase
from cardshare.arbiter.store import MARKER_NAME, JobState, Store, StoreError


def in_llm_with_no_jobs(e: Engine) -> bool:
    return e.state.phase is Phase.SERVE_LLM and e.store.queue_length() == 0


def submit(engine: Engine, n: int = 1) -> list[str]:
    return [engine.submit_job(WORKFLOW, {"in.png": PNG}).id for _ in range(n)]


def states(engine: Engine, ids: list[str]) -> list[JobState]:
    return [engine.store.job(i).state for i in ids]  # type: ignore[union-attr]


async def run_guarded(engine: Engine, predicate: Any, max_steps: int = 2000) -> int:
    """Step the engine under its guard (as ``run`` does) until ``predicate`` holds."""
    for n in range(max_steps):
        if predicate(engine):
            return n
        if not await engine.guarded(engine.step):
            await engine.pace.sleep(engine._backoff())
    raise AssertionError(f"not reached; phase {engine.state.phase}, alerts {engine.alerts}")


# -- exactly once ------------------------------------------------------------------------------


async def test_prompt_finishing_between_two_polls_runs_once(tmp_path: Path) -> None:
    """Each ComfyUI call takes 0-300 ms (the issue's 150 ms of /queue latency): a prompt
    finishes between the two reads of a poll again and again. Reading the history before
    the queue posted such a prompt again (12 of 130 jobs ran twice)."""
    world = World(FakeClock(), latency=(0.0, 0.3), job_seconds_range=(0.1, 1.5))
    engine = make_engine(tmp_path, world, idle_seconds=1.0, poll_interval_seconds=0.2)
    ids = submit(engine, 130)
    await run_until(engine, in_llm_with_no_jobs, max_steps=20_000)
    assert states(engine, ids) == [JobState.DONE] * 130
    assert world.duplicates() == {}
    assert world.submissions == 130


async def test_history_lost_in_a_restart_is_decided_by_the_files(tmp_path: Path) -> None:
    """The prompt finished, then ComfyUI restarted (history in memory only) before the
    arbiter saw it: the job's files on disk prove it ran; it is not posted again."""
    world = World(FakeClock(), job_seconds=0.5)
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    (job_id,) = submit(engine)

    def finish_then_restart(_: str) -> None:
        world.clock.t += 5  # it finishes ...
        engine.comfy._run()  # type: ignore[attr-defined]
        world.comfy_process_started()  # ... and ComfyUI restarts: history and queue gone
        world.image.starts += 1

    world.after_submit = finish_then_restart
    await run_until(engine, in_llm_with_no_jobs)
    job = engine.store.job(job_id)
    assert job is not None
    assert (job.state, job.attempts, job.outputs) == (JobState.DONE, 1, 1)
    assert world.submissions == 1
    assert world.duplicates() == {}


async def test_comfy_killed_between_creating_and_writing_its_file_runs_the_job_again(
    tmp_path: Path,
) -> None:
    """ComfyUI killed mid-save leaves an empty file: no evidence that the prompt ran, and no
    reason to restart ComfyUI over and over (a randomized fault run once looped on one): the
    job is run again, once, and its output is the new attempt's file."""
    world = World(FakeClock(), job_seconds=0.5)
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    (job_id,) = submit(engine)
    subfolder, stem = save_prefix(job_id, 0)

    def killed_mid_save(_: str) -> None:
        world.files[(subfolder, saved_file_name(stem, 1))] = b""
        world.image.running = False  # killed: its history and queue go with it
        world.comfy_process_started()

    world.after_submit = killed_mid_save
    await run_until(engine, in_llm_with_no_jobs)
    job = engine.store.job(job_id)
    assert job is not None
    assert (job.state, job.attempts, job.outputs) == (JobState.DONE, 2, 1)
    assert world.submissions == 2
    assert world.image.starts <= 4, world.image.starts


async def test_comfy_died_after_saving_is_not_run_again(tmp_path: Path) -> None:
    """ComfyUI crashed after the save (its files are there) but before the arbiter read the
    history: the next attempt finds the files and runs nothing."""
    world = World(FakeClock(), job_seconds=0.5)
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    (job_id,) = submit(engine)

    def finish_then_crash(_: str) -> None:
        world.clock.t += 5
        engine.comfy._run()  # type: ignore[attr-defined]
        world.image.running = False  # crashed

    world.after_submit = finish_then_crash
    await run_until(engine, in_llm_with_no_jobs)
    job = engine.store.job(job_id)
    assert job is not None
    assert (job.state, job.outputs) == (JobState.DONE, 1)
    assert world.duplicates() == {}
    assert "image_crashed" in engine.faults


async def test_randomized_1000_jobs_with_kills_and_crashes(tmp_path: Path) -> None:
    """1,000 jobs, random ComfyUI latencies (0-250 ms a call) and durations (50 ms-2 s),
    random kills of the arbiter (its loop cancelled at a random await: what survives is the
    database, as after SIGKILL) and random ComfyUI crashes: none lost, none run twice."""
    rng = random.Random(20261201)
    world = World(FakeClock(), latency=(0.0, 0.25), job_seconds_range=(0.05, 2.0), rng=rng)
    overrides: dict[str, Any] = {
        "idle_seconds": 1.0,
        "poll_interval_seconds": 0.25,
        "job_max_attempts": 10,
        "max_image_seconds": 120.0,
    }
    engine = make_engine(tmp_path, world, **overrides)
    ids: list[str] = []
    kills = crashes = 0
    while len(ids) < 1000 or engine.store.queue_length() > 0:
        if len(ids) < 1000 and rng.random() < 0.3:
            ids += submit(engine, min(1000 - len(ids), rng.randint(1, 40)))
        stop = asyncio.Event()
        task = asyncio.ensure_future(engine.run(stop))
        for _ in range(rng.randint(1, 400)):
            await asyncio.sleep(0)
            if world.image.running and rng.random() < 0.003:
                world.image.running = False  # ComfyUI crashes mid-whatever
                crashes += 1
        task.cancel()  # SIGKILL: only the database and the world remain
        with contextlib.suppress(asyncio.CancelledError):
            await task
        kills += 1
        engine.store.close()
        engine = make_engine(tmp_path, world, **overrides)
        assert kills < 20_000, (len(ids), engine.store.job_counts(), engine.state.phase)
    counts = engine.store.job_counts()
    assert counts["done"] == 1000, counts
    assert world.duplicates() == {}
    assert sum(world.executions.values()) == 1000
    assert kills > 100 and crashes >= 20, (kills, crashes)


# -- supervision -------------------------------------------------------------------------------


async def test_unexpected_error_is_alerted_and_the_loop_goes_on(tmp_path: Path) -> None:
    """An error that is not Docker's (here a bug's KeyError while polling one job) no longer
    ends the engine: it is logged, alerted, counted; the job fails after job_max_errors
    with the error as its reason; the next job runs."""
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=1.0, job_max_errors=3)
    poison, good = submit(engine, 2)
    real_queued = engine.comfy.queued

    async def queued(prompt_id: str, subfolder: str) -> str | None:
        job = engine.store.job(poison)
        if job is not None and job.prompt_id == prompt_id:
            raise KeyError("node_errors")
        return await real_queued(prompt_id, subfolder)

    engine.comfy.queued = queued  # type: ignore[method-assign]
    await run_guarded(engine, in_llm_with_no_jobs)
    failed = engine.store.job(poison)
    assert failed is not None
    assert failed.state is JobState.FAILED
    assert failed.errors == 3
    assert failed.reason.startswith("the arbiter failed on this job: KeyError: 'node_errors'")
    assert states(engine, [good]) == [JobState.DONE]
    assert engine.faults["engine_error_steps"] == 3
    assert "restart image" in world.calls  # its prompt may still run: ComfyUI restarted
    assert Alert.ENGINE_ERROR not in engine.alerts  # cleared by the steps that went through


async def test_run_survives_any_step_error_and_beats(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, engine_backoff_max_seconds=8.0)
    calls = 0

    async def broken() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("garbage from somewhere")

    engine.step = broken  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.ensure_future(engine.run(stop))
    for _ in range(200):
        await asyncio.sleep(0)
    assert not task.done() and engine.alive
    assert engine.alerts[Alert.ENGINE_ERROR] == "ValueError in serve_llm: garbage from somewhere"
    assert calls > 3
    assert engine._backoff() == 8.0  # backed off to the cap
    assert engine.pace.age() <= 8.0  # beats around every backoff: never stale
    stop.set()
    await asyncio.wait_for(task, 5)
    assert not engine.alive
    assert engine.healthy() == (False, "the engine is not running")


async def test_stale_heartbeat_is_unhealthy(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, heartbeat_stale_seconds=30.0)
    engine.alive = True
    engine.pace.beat()
    assert engine.healthy()[0]
    world.clock.t += 31
    assert engine.healthy() == (
        False,
        "the engine's heartbeat is 31 s old (heartbeat_stale_seconds 30)",
    )


@pytest.mark.parametrize("kind", ["garbage", "hang"])
async def test_comfy_garbage_or_silence_tolerated_then_restarted(tmp_path: Path, kind: str) -> None:
    """Two unanswered polls while ComfyUI's container runs: poll again, no restart. Three in
    a row: it hangs: restart it; the job still runs exactly once."""
    world = World(FakeClock(), job_seconds=3.0)
    engine = make_engine(tmp_path, world, idle_seconds=1.0, comfyui_unanswered_polls=3)
    (job_id,) = submit(engine)
    world.after_submit = lambda _: world.garbage_next.update(queue=2)
    await run_until(engine, lambda e: e.store.queue_length() == 0)
    assert "restart image" not in world.calls
    (job2,) = submit(engine)
    world.after_submit = lambda _: world.garbage_next.update(queue=3)
    await run_until(engine, in_llm_with_no_jobs)
    assert "restart image" in world.calls
    assert states(engine, [job_id, job2]) == [JobState.DONE, JobState.DONE]
    assert world.duplicates() == {}
    assert engine.faults[Alert.IMAGE_CRASHED] == 1


# -- restart means restart ---------------------------------------------------------------------


async def test_a_hung_job_is_stopped_by_a_real_restart(tmp_path: Path) -> None:
    """A job past its timeout: its prompt is interrupted, the queue cleared, the container
    restarted (a new start time); the next job does not queue behind the hung one."""
    world = World(FakeClock(), hang_next=1)
    engine = make_engine(tmp_path, world, idle_seconds=1.0, job_timeout_seconds=30.0)
    hung, nxt = submit(engine, 2)
    await run_until(engine, in_llm_with_no_jobs)
    first = engine.store.job(hung)
    assert first is not None
    assert first.state is JobState.FAILED
    assert first.reason == "not finished within job_timeout_seconds (30)"
    assert states(engine, [nxt]) == [JobState.DONE]
    assert world.interrupts >= 1
    assert world.calls.count("restart image") == 1
    assert world.image.starts == 2  # the swap's start and the restart


async def test_a_restart_that_does_not_restart_is_a_failure(tmp_path: Path) -> None:
    world = World(FakeClock(), hang_next=1)
    engine = make_engine(tmp_path, world, idle_seconds=1.0, job_timeout_seconds=30.0)
    submit(engine, 2)
    await run_until(engine, lambda e: e.state.phase is Phase.RESTART_IMAGE)

    async def restart_noop(role: Any, timeout_seconds: int) -> None:  # a start of a running one
        world.calls.append("restart image (no-op)")

    engine.containers.restart = restart_noop  # type: ignore[method-assign]
    await engine.step()
    assert engine.state.phase is Phase.STOP_IMAGE
    assert engine.swaps.image_failure.startswith(
        "ComfyUI did not restart (running True, started at"
    )


# -- Docker failures are bounded ---------------------------------------------------------------


async def test_comfy_that_will_not_start_backs_off_and_keeps_the_jobs(tmp_path: Path) -> None:
    """Before: stop vLLM, fail, reload vLLM, about once a minute, forever, silently."""
    world = World(FakeClock())
    world.image.start_fails = True
    engine = make_engine(
        tmp_path,
        world,
        idle_seconds=1.0,
        image_retry_backoff_seconds=60.0,
        image_retry_backoff_max_seconds=1800.0,
    )
    ids = submit(engine, 3)
    end = world.clock.t + 2 * 3600
    while world.clock.t < end:
        await engine.guarded(engine.step)
    tries = world.calls.count("start image")
    # 60, 120, 240, 480, 960, 1800, 1800 ... s apart (plus the swaps' own time)
    assert 5 <= tries <= 9, world.calls
    assert states(engine, ids) == [JobState.QUEUED] * 3
    assert engine.alerts[Alert.IMAGE_START_FAILED].startswith(
        f"ComfyUI failed to come up {tries} times in a row (last: starting the image container "
        "failed: Docker Engine POST /containers/image/start answered 500"
    )
    assert "3 job(s) kept queued" in engine.alerts[Alert.IMAGE_START_FAILED]
    world.image.start_fails = False
    await run_until(engine, in_llm_with_no_jobs, max_steps=5000)
    assert states(engine, ids) == [JobState.DONE] * 3
    assert Alert.IMAGE_START_FAILED not in engine.alerts


async def test_comfy_that_will_not_stop_never_gives_llm_back_beside_it(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    submit(engine)
    await run_until(engine, lambda e: e.state.phase is Phase.STOP_IMAGE)
    world.image.stop_fails = True
    for _ in range(6):
        await engine.step()
        assert engine.state.phase is Phase.STOP_IMAGE
        assert not world.llm.running
    assert engine.mode is Mode.SWAPPING
    stop_alert = engine.alerts[Alert.IMAGE_STOP_FAILED]
    assert stop_alert.startswith("ComfyUI could not be stopped (6 tries)")
    world.image.stop_fails = False
    await run_until(engine, in_llm_with_no_jobs)
    assert world.llm.running and not world.image.running
    assert Alert.IMAGE_STOP_FAILED not in engine.alerts


async def test_own_containers_are_never_foreign_clients(tmp_path: Path) -> None:
    world = World(FakeClock())
    world.others.append(CardClient("comfyui/comfyui", 512 * 2**20, ()))  # e.g. a probe
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    submit(engine)
    await run_until(engine, lambda e: e.state.phase is Phase.RUN_JOBS)


async def test_docker_down_is_alerted_and_resumed(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    (job_id,) = submit(engine)

    async def down(role: Any) -> Any:
        from cardshare.docker_api import DockerError

        raise DockerError("Docker Engine at /var/run/docker.sock did not answer GET: refused")

    real_state = engine.containers.state
    engine.containers.state = down  # type: ignore[method-assign]
    assert not await engine.resume()
    assert engine.alerts[Alert.DOCKER].startswith("Docker Engine at /var/run/docker.sock")
    engine.containers.state = real_state  # type: ignore[method-assign]
    assert await engine.resume()
    await run_until(engine, in_llm_with_no_jobs)
    assert states(engine, [job_id]) == [JobState.DONE]
    assert Alert.DOCKER not in engine.alerts


# -- cancelling a running job ------------------------------------------------------------------


async def test_running_job_is_cancelled_by_interrupting_its_prompt(tmp_path: Path) -> None:
    world = World(FakeClock(), hang_next=1)
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    running, nxt = submit(engine, 2)
    cancelled: list[JobState | None] = []
    world.after_submit = lambda _: cancelled.append(engine.store.cancel(running, world.clock.t))
    await run_until(engine, in_llm_with_no_jobs)
    assert cancelled == [JobState.RUNNING]
    job = engine.store.job(running)
    assert job is not None
    assert (job.state, job.reason) == (JobState.CANCELLED, "cancelled by request while running")
    assert world.interrupts == 1
    assert "restart image" not in world.calls
    assert states(engine, [nxt]) == [JobState.DONE]


# -- storage -----------------------------------------------------------------------------------


async def test_read_only_disk_pauses_keeps_jobs_and_leaves_no_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outputs cannot be written (EROFS): alert, pause, no temporary file left; once the
    disk works again the job ends done, its prompt run once."""
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    ids = submit(engine, 2)
    import cardshare.atomicfile as atomicfile

    def read_only(fd: int) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(atomicfile.os, "fsync", read_only)
    stop = asyncio.Event()
    task = asyncio.ensure_future(engine.run(stop))
    for _ in range(2000):
        await asyncio.sleep(0)
        if Alert.STORAGE in engine.alerts:
            break
    for _ in range(200):
        await asyncio.sleep(0)
    assert engine.alerts[Alert.STORAGE].startswith("cannot write to ")
    assert not task.done()
    assert [p.name for p in (tmp_path / "data").rglob("*" + atomicfile.TMP_SUFFIX)] == []
    assert states(engine, ids) == [JobState.RUNNING, JobState.QUEUED]
    monkeypatch.undo()
    for _ in range(3000):
        await asyncio.sleep(0)
        if engine.store.queue_length() == 0:
            break
    stop.set()
    await asyncio.wait_for(task, 5)
    assert states(engine, ids) == [JobState.DONE, JobState.DONE]
    assert Alert.STORAGE not in engine.alerts
    assert world.duplicates() == {}
    assert sum(world.executions.values()) == 2


async def test_full_disk_pauses_before_any_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    ids = submit(engine, 1)
    import cardshare.arbiter.engine as engine_module

    class Usage:
        free = 10 * 2**20

    monkeypatch.setattr(engine_module.shutil, "disk_usage", lambda _: Usage())
    stop = asyncio.Event()
    task = asyncio.ensure_future(engine.run(stop))
    for _ in range(500):
        await asyncio.sleep(0)
    assert engine.alerts[Alert.STORAGE].startswith(
        f"{tmp_path / 'data'} has 10 MiB free (min_free_bytes 64 MiB): free space there"
    )
    assert engine.state.phase is Phase.SERVE_LLM and world.submissions == 0
    monkeypatch.undo()
    for _ in range(3000):
        await asyncio.sleep(0)
        if engine.store.queue_length() == 0:
            break
    stop.set()
    await asyncio.wait_for(task, 5)
    assert states(engine, ids) == [JobState.DONE]
    assert Alert.STORAGE not in engine.alerts


def test_too_little_free_space_is_a_storage_problem(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, min_free_bytes=2**62)
    problem = engine.storage_problem()
    assert problem is not None and "min_free_bytes" in problem


def test_empty_database_is_refused_and_kept(tmp_path: Path) -> None:
    db = tmp_path / "arbiter.sqlite3"
    db.write_bytes(b"")
    with pytest.raises(StoreError, match=r"is empty \(0 bytes\): it is kept for inspection"):
        Store(db)
    assert db.exists() and db.stat().st_size == 0


def test_damaged_database_is_refused_and_kept(tmp_path: Path) -> None:
    db = tmp_path / "arbiter.sqlite3"
    garbage = b"this is not a database" * 300
    db.write_bytes(garbage)
    with pytest.raises(StoreError, match=r"is damaged .*kept as it is for inspection"):
        Store(db)
    assert db.read_bytes() == garbage


def test_lost_database_is_refused_when_one_was_created(tmp_path: Path) -> None:
    db = tmp_path / "arbiter.sqlite3"
    Store(db).close()
    assert (tmp_path / MARKER_NAME).exists()
    for p in tmp_path.glob("arbiter.sqlite3*"):
        p.unlink()
    with pytest.raises(StoreError, match=r"is missing while .* says one was created"):
        Store(db)


def test_database_of_an_older_release_gains_the_new_columns(tmp_path: Path) -> None:
    db = tmp_path / "arbiter.sqlite3"
    conn = sqlite3.connect(db)
    conn.execute(
        "CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,"
        " state TEXT NOT NULL, workflow TEXT NOT NULL, inputs TEXT NOT NULL,"
        " reason TEXT NOT NULL DEFAULT '', attempts INTEGER NOT NULL DEFAULT 0, prompt_id TEXT,"
        " outputs INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL, started REAL,"
        " finished REAL)"
    )
    conn.execute(
        "INSERT INTO jobs (id, state, workflow, inputs, created) VALUES ('a', 'queued', '{}',"
        " '[]', 1.0)"
    )
    conn.commit()
    conn.close()
    store = Store(db)
    job = store.job("a")
    assert job is not None
    assert (job.errors, job.cancel_requested) == (0, False)


# -- a hold for a probe survives a restart of the arbiter ----------------------------------


async def test_a_hold_survives_a_restart_and_resume_leaves_the_probe_alone(
    tmp_path: Path,
) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world)
    until = engine.hold_swaps("comfyui-probe", 300)
    assert until == world.clock.t + 300
    world.image.running = True  # the probe started ComfyUI beside vLLM
    engine.store.close()
    engine = make_engine(tmp_path, world)  # the arbiter restarted meanwhile
    assert await engine.resume()
    assert engine.state.phase is Phase.SERVE_LLM
    assert "stop image" not in world.calls
    assert engine.held_by() == "comfyui-probe"
    world.clock.t += 301  # expired: a ComfyUI left running now is stopped
    world_calls = len(world.calls)
    assert await engine.resume()
    assert engine.state.phase is Phase.STOP_IMAGE
    assert world.calls[world_calls:] == []
    assert engine.held_by() is None


async def test_the_card_view_stays_fresh_while_idle(tmp_path: Path) -> None:
    """No jobs, no swap: the status still shows who is on the card, from the recorder's file
    (its timer scans each minute), without a scan of the arbiter's that would wake it."""
    world = World(FakeClock())
    engine = make_engine(tmp_path, world)
    await engine.step()
    assert engine.watch.last is not None
    assert [c.name for c in engine.watch.last.clients] == ["vllm/vllm"]
    first = engine.watch.last.scanned_at
    world.others.append(CardClient("plex/plex", 2**30, ("vcs",)))
    world.clock.t += 61
    await engine.step()
    assert engine.watch.last.scanned_at > first
    assert "plex/plex" in [c.name for c in engine.watch.last.clients]
    assert engine.card.scans == 0  # type: ignore[attr-defined]


# -- found by the real-process fault suite (tests/faults) -------------------------------------


async def test_vllm_dying_while_serving_is_started_again(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world)
    await engine.step()
    world.llm.running, world.llm.exit_code = False, 137
    await engine.step()
    assert engine.state.phase is Phase.START_LLM
    assert engine.alerts[Alert.LLM_NOT_READY] == (
        "vLLM stopped while serving: container vllm-vllm-1 is exited (exit code 137)"
    )
    await run_until(engine, lambda e: e.state.phase is Phase.SERVE_LLM)
    assert world.llm.running
    assert Alert.LLM_NOT_READY not in engine.alerts


async def test_vllm_dead_before_a_swap_is_reported_not_absorbed(tmp_path: Path) -> None:
    """vLLM crashed after the serving loop's last look, when it had already decided to swap:
    the swap's own stop must not hide the crash (the fault suite's vllm-dies-while-serving
    lost its alert this way on a loaded machine)."""
    world = World(FakeClock())
    engine = make_engine(tmp_path, world)
    submit(engine)
    await run_until(engine, lambda e: e.state.phase is Phase.STOP_LLM)
    world.llm.running, world.llm.exit_code = False, 137
    world.llm.finished = engine.state.phase_since - 0.2
    await engine.step()
    assert engine.alerts[Alert.LLM_NOT_READY] == (
        "vLLM stopped while serving, before the swap to image: container vllm-vllm-1 exited "
        "with code 137; it starts again when the card comes back"
    )
    await run_until(engine, in_llm_with_no_jobs)
    assert world.llm.running
    assert Alert.LLM_NOT_READY not in engine.alerts
    assert engine.faults[Alert.LLM_NOT_READY] == 1


@pytest.mark.parametrize(
    ("exit_code", "oom", "alerted"),
    [(137, False, True), (1, False, True), (0, True, True), (0, False, False), (143, False, False)],
)
async def test_vllm_found_dead_at_the_start_is_reported_when_it_crashed(
    tmp_path: Path, exit_code: int, oom: bool, alerted: bool
) -> None:
    """The arbiter (re)starts in serve_llm and finds vLLM exited: a crash (killed, an error
    exit, the OOM killer) is reported; a clean stop (0, or 143 after docker stop's SIGTERM)
    is only started again."""
    world = World(FakeClock())
    world.llm.running, world.llm.exit_code, world.llm.oom_killed = False, exit_code, oom
    engine = make_engine(tmp_path, world)
    assert await engine.resume()
    assert engine.state.phase is Phase.START_LLM
    assert (Alert.LLM_NOT_READY in engine.alerts) is alerted
    await run_until(engine, in_llm_with_no_jobs)
    assert world.llm.running
    assert Alert.LLM_NOT_READY not in engine.alerts


async def test_vllm_stopped_by_the_swap_itself_is_no_crash(tmp_path: Path) -> None:
    """A swap resumed after a restart of the arbiter finds the vLLM it stopped in this phase:
    exited after the phase began, which is no crash."""
    world = World(FakeClock())
    engine = make_engine(tmp_path, world)
    submit(engine)
    await run_until(engine, lambda e: e.state.phase is Phase.STOP_LLM)
    world.llm.running, world.llm.exit_code = False, 0
    world.llm.finished = engine.state.phase_since + 0.1
    await engine.step()
    assert Alert.LLM_NOT_READY not in engine.alerts
    assert engine.faults[Alert.LLM_NOT_READY] == 0


async def test_outputs_reported_saved_but_not_found_are_asked_again_never_rerun(
    tmp_path: Path,
) -> None:
    """History says done, /view says 404: asked again (two 404s, then the file): done; a
    404 every time fails the job after job_max_errors. Never is the prompt run again (before:
    ComfyUI was restarted, the files looked for again and a 404 taken as 'never ran')."""
    world = World(FakeClock(), view_not_found=2)
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    (job_id,) = submit(engine)
    await run_until(engine, in_llm_with_no_jobs)
    assert states(engine, [job_id]) == [JobState.DONE]
    world.view_not_found = 100
    (gone,) = submit(engine)
    await run_until(engine, in_llm_with_no_jobs)
    job = engine.store.job(gone)
    assert job is not None
    assert job.state is JobState.FAILED
    assert job.reason.startswith("its outputs could not be fetched 3 times: GET /view answered 404")
    assert sum(world.executions.values()) == 2 and world.duplicates() == {}


async def test_outputs_fetched_after_comfy_died_are_never_run_again(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    (job_id,) = submit(engine)

    def crash_before_fetch(_: str) -> None:
        world.clock.t += 5
        engine.comfy._run()  # type: ignore[attr-defined]
        world.garbage_next["view"] = 1  # the fetch gets no answer ...

        async def dead_view(*args: Any) -> bytes:  # ... because ComfyUI died
            world.image.running = False
            engine.comfy.view = real_view  # type: ignore[method-assign]
            raise Unavailable("GET /view: connection refused")

        engine.comfy.view = dead_view  # type: ignore[method-assign]

    from cardshare.arbiter.edges import Unavailable

    real_view = engine.comfy.view
    world.after_submit = crash_before_fetch
    await run_until(engine, in_llm_with_no_jobs)
    job = engine.store.job(job_id)
    assert job is not None
    assert (job.state, job.outputs, job.attempts) == (JobState.DONE, 1, 1)
    assert world.submissions == 1 and world.duplicates() == {}


async def test_a_comfyui_its_policy_restarted_is_waited_for_not_charged_to_the_job(
    tmp_path: Path,
) -> None:
    """The prompt ran and saved; ComfyUI then crashed and its restart policy brought it back:
    the container runs, ComfyUI is still starting and refuses connections.  Before, each
    refused fetch was an error of the job, and three polls failed a job whose files were on
    disk.  Now the silence is polled as a running job's is, then ComfyUI restarted (the one
    error), and the files are fetched: done, run once."""
    from cardshare.arbiter.edges import Unavailable

    world = World(FakeClock())
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    (job_id,) = submit(engine)
    refused = {"left": 4}  # three polls, then once more after the restart

    def respawned_before_fetch(_: str) -> None:
        world.clock.t += 5
        engine.comfy._run()  # type: ignore[attr-defined]

        async def starting_view(*args: Any) -> bytes:
            if refused["left"] > 0:
                refused["left"] -= 1
                raise Unavailable("GET /view: connection refused")
            return await real_view(*args)

        engine.comfy.view = starting_view  # type: ignore[method-assign]

    real_view = engine.comfy.view
    world.after_submit = respawned_before_fetch
    await run_until(engine, in_llm_with_no_jobs)
    job = engine.store.job(job_id)
    assert job is not None
    assert (job.state, job.outputs, job.attempts, job.errors) == (JobState.DONE, 1, 1, 1)
    assert refused["left"] == 0 and world.image.starts >= 2  # restarted once for the fetch
    assert world.submissions == 1 and world.duplicates() == {}


async def test_a_non_image_answer_is_not_stored_as_an_output(tmp_path: Path) -> None:
    world = World(FakeClock(), view_not_image=1)
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    (job_id,) = submit(engine)
    await run_until(engine, in_llm_with_no_jobs)
    job = engine.store.job(job_id)
    assert job is not None
    assert (job.state, job.outputs) == (JobState.DONE, 1)
    data = (tmp_path / "data" / "jobs" / job_id / "outputs" / "0.png").read_bytes()
    assert data.startswith(PNG[:8])
    assert sum(world.executions.values()) == 1
    world.view_not_image = 10
    (bad,) = submit(engine)
    await run_until(engine, in_llm_with_no_jobs)
    failed = engine.store.job(bad)
    assert failed is not None
    assert failed.state is JobState.FAILED
    assert failed.reason.startswith("its outputs could not be fetched 3 times: GET /view of")
    assert sum(world.executions.values()) == 2


async def test_stale_card_data_raises_the_card_data_alert(tmp_path: Path) -> None:
    world = World(FakeClock())
    engine = make_engine(tmp_path, world, card_data_max_age_seconds=10.0)
    submit(engine)

    async def stale(newer_than: float | None = None) -> Any:
        from cardshare.arbiter.cardview import CardView

        return CardView(world.clock.now() - 60, ())

    engine.card.read = stale  # type: ignore[method-assign]
    await engine.step()
    assert engine.alerts[Alert.CARD_DATA] == (
        "card data is 60 s old even after a fresh scan (max 10 s): is the recorder running?"
    )


async def test_low_disk_in_image_mode_hands_the_card_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = World(FakeClock(), job_seconds=5.0)
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    ids = submit(engine, 3)
    await run_until(engine, lambda e: e.state.phase is Phase.RUN_JOBS)
    import cardshare.arbiter.engine as engine_module

    class Usage:
        free = 1

    monkeypatch.setattr(engine_module.shutil, "disk_usage", lambda _: Usage())
    stop = asyncio.Event()
    task = asyncio.ensure_future(engine.run(stop))
    for _ in range(3000):
        await asyncio.sleep(0)
        if engine.state.phase is Phase.SERVE_LLM:
            break
    assert engine.state.phase is Phase.SERVE_LLM
    assert world.llm.running and not world.image.running
    assert any(r.startswith("jobs are paused: ") for r in engine.last_decision.reasons)
    monkeypatch.undo()
    for _ in range(5000):
        await asyncio.sleep(0)
        if engine.store.queue_length() == 0:
            break
    stop.set()
    await asyncio.wait_for(task, 5)
    assert states(engine, ids) == [JobState.DONE] * 3
    assert world.duplicates() == {}
