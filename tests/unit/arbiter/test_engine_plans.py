"""The engine with vLLM's ladder of plans: the start on the largest plan that the measured
free VRAM allows, the bounded passes after an insufficient-VRAM failure (reclaim, step down,
give up), and the restore of the full plan at an idle moment."""

from __future__ import annotations

from pathlib import Path

from arbiter_fakes import PNG, WORKFLOW, FakeCard, FakeClock, World, make_engine, run_until

from cardshare.arbiter.api import metric_families, status_doc
from cardshare.arbiter.cardview import CardClient
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.plans import LlmPlan
from cardshare.arbiter.states import Mode, Phase

GIB = 2**30
CARD = 32 * GIB
PLANS = (
    LlmPlan("vllm", 0.70, 65536, int(0.70 * CARD)),
    LlmPlan("vllm-plan1", 0.67, 49152, int(0.67 * CARD)),
    LlmPlan("vllm-plan2", 0.61, 32768, int(0.61 * CARD)),
)
HEADROOM = int(0.8 * GIB)
VRAM_LOG = (
    "ValueError: Free memory on device xpu:0 (3.1/31.8 GiB) on startup is less than desired "
    "GPU memory utilization (0.70, 22.4 GiB). Decrease GPU memory utilization or reduce GPU "
    "memory used by other processes.\n"
)


def world_with_plans() -> World:
    world = World(FakeClock())
    world.card_total = CARD
    world.plan_reservations = {p.service: p.reservation_bytes for p in PLANS}
    return world


def engine_of(tmp_path: Path, world: World, **overrides: object) -> Engine:
    settings: dict[str, object] = {
        "llm_plans": PLANS,
        "vram_headroom_bytes": HEADROOM,
        "idle_seconds": 5.0,
        "vram_retry_margin_bytes": GIB,
    }
    settings.update(overrides)
    return make_engine(tmp_path, world, **settings)


def serving(e: Engine) -> bool:
    return e.state.phase is Phase.SERVE_LLM and e.store.queue_length() == 0


async def swap_and_hand_back(engine: Engine, world: World, during_jobs: object = None) -> None:
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)
    if callable(during_jobs):
        during_jobs()
    await run_until(engine, serving)


async def test_a_transcode_at_handback_gets_a_smaller_plan_then_the_full_one_returns(
    tmp_path: Path,
) -> None:
    world = world_with_plans()
    engine = engine_of(tmp_path, world)
    transcode = CardClient("plex/plex", 9 * GIB, ("vcs",))
    # the transcode starts while the image jobs run (the veto only holds swaps to image)
    await swap_and_hand_back(engine, world, lambda: world.others.append(transcode))
    assert world.plan_starts == ["vllm-plan1"]
    assert engine.reclaim.plan_index == 1
    doc = status_doc(engine)
    assert doc["llm_plan"]["degraded"] is True
    assert doc["llm_plan"]["max_model_len"] == 49152
    assert "plex/plex 9.0 GiB" in doc["llm_plan"]["reason"]
    assert {"name": "plex/plex", "kind": "foreign", "vram_bytes": 9 * GIB} in doc["tenants"]
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in metric_families(engine)
        for s in f.samples
    }
    assert samples[("cardshare_arbiter_llm_plan", ())] == 1
    assert samples[("cardshare_arbiter_llm_max_model_len", ())] == 49152
    # no replan while the transcode holds the room
    for _ in range(20):
        await engine.step()
    assert engine.reclaim.plan_index == 1
    # the transcode ends: at the next idle moment the full plan returns
    world.others.clear()
    await run_until(engine, lambda e: e.reclaim.plan_index == 0 and serving(e))
    assert world.plan_starts == ["vllm-plan1", "vllm"]
    assert not world.plans["vllm-plan1"].running
    assert world.llm.running
    assert status_doc(engine)["llm_plan"]["degraded"] is False


async def test_no_restore_while_agents_talk_or_when_turned_off(tmp_path: Path) -> None:
    world = world_with_plans()
    engine = engine_of(tmp_path, world)
    transcode = CardClient("plex/plex", 9 * GIB, ("vcs",))
    await swap_and_hand_back(engine, world, lambda: world.others.append(transcode))
    world.others.clear()
    world.proxy["in_flight"] = 1
    for _ in range(30):
        await engine.step()
    assert engine.reclaim.plan_index == 1
    assert world.plan_starts == ["vllm-plan1"]
    # the agents go quiet: now it returns
    world.proxy["in_flight"] = 0
    await run_until(engine, lambda e: e.reclaim.plan_index == 0 and serving(e))

    world2 = world_with_plans()
    engine2 = engine_of(tmp_path / "off", world2, restore_full_plan=False)
    await swap_and_hand_back(engine2, world2, lambda: world2.others.append(transcode))
    world2.others.clear()
    for _ in range(30):
        await engine2.step()
    assert world2.plan_starts == ["vllm-plan1"]


async def test_a_restore_is_confirmed_on_a_scan_made_then(tmp_path: Path) -> None:
    """The data a restore is weighed on may be up to card_data_max_age_seconds old, and a
    transcode that began since is not in it.  Going on it, the arbiter left llm mode for a
    start that then found no room (the proxy held the agents meanwhile, though the smaller
    plan served on).  A scan made when the restore would go sees the transcode: the mode
    stays llm and the smaller plan serves."""
    world = world_with_plans()
    engine = engine_of(tmp_path, world)
    card: FakeCard = engine.card  # type: ignore[assignment]
    transcode = CardClient("plex/plex", 9 * GIB, ("vcs",))
    await swap_and_hand_back(engine, world, lambda: world.others.append(transcode))
    assert world.plan_starts == ["vllm-plan1"]
    # the transcode ends; the recorder's timer scans; a new transcode begins right after
    world.others.clear()
    card.recorder_view = card.look()
    world.clock.t += 1  # type: ignore[attr-defined]
    world.others.append(CardClient("plex/plex", 9 * GIB, ("vcs",)))
    scans = card.scans
    for _ in range(40):
        await engine.step()
        assert engine.mode is Mode.LLM, engine.state.phase
    assert world.plan_starts == ["vllm-plan1"]
    assert engine.reclaim.plan_index == 1 and serving(engine)
    assert card.scans > scans  # the confirmation scanned
    # the transcode ends for good: the full plan returns, confirmed on a scan that shows it
    world.others.clear()
    await run_until(engine, lambda e: e.reclaim.plan_index == 0 and serving(e))
    assert world.plan_starts == ["vllm-plan1", "vllm"]


async def test_the_retrieval_tier_resident_is_accounted(tmp_path: Path) -> None:
    world = world_with_plans()
    # the tier holds more than its reservation after a burst of long documents
    world.others.append(CardClient("retrieval/ovms", 9 * GIB, ()))
    engine = engine_of(tmp_path, world, resident_client_names=("retrieval/ovms",))
    await swap_and_hand_back(engine, world)
    assert world.plan_starts == ["vllm-plan1"]
    kinds = {t["name"]: t["kind"] for t in status_doc(engine)["tenants"]}
    assert kinds["retrieval/ovms"] == "resident"


async def test_a_vram_failure_is_reclaimed_then_the_same_plan_starts(tmp_path: Path) -> None:
    world = world_with_plans()
    engine = engine_of(tmp_path, world)
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)
    world.llm_fails_start = VRAM_LOG  # the first start only: cleared below
    await run_until(engine, lambda e: e.state.phase is Phase.WAIT_LLM_READY)
    await engine.step()  # vLLM exits at start: the first pass
    assert engine.reclaim.llm_vram_failures == 1
    assert "attempt 1 of 3: reclaimed; retrying plan 0" in engine.alerts["llm_insufficient_vram"]
    world.llm_fails_start = None
    reads = engine.card.reads  # type: ignore[attr-defined]
    await run_until(engine, serving)
    assert world.plan_starts == ["vllm", "vllm"]
    # the reclaim looked at the card (ComfyUI's release) before the retry
    assert engine.card.reads > reads  # type: ignore[attr-defined]
    assert "llm_insufficient_vram" not in engine.alerts


async def test_three_attempts_at_most_then_out_of_llm_until_the_card_changes(
    tmp_path: Path,
) -> None:
    world = world_with_plans()
    engine = engine_of(tmp_path, world, llm_retry_backoff_max_seconds=3600.0)
    hog = CardClient("someone/else", 20 * GIB, ())

    engine.submit_job(WORKFLOW, {"in.png": PNG})
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)
    world.others.append(hog)
    # 12 GiB free: no plan fits; the smallest is tried, then the passes: reclaim and the same
    # plan, one down (there is none below: the same), then the series gives up
    await run_until(engine, lambda e: e.reclaim.vram_gave_up is not None, max_steps=200)
    assert world.plan_starts == ["vllm-plan2"] * 3
    alert = engine.alerts["llm_insufficient_vram"]
    assert "in 3 attempts (plans 2, 2, 2" in alert
    assert "someone/else 20.0 GiB" in alert
    assert "staying out of llm" in alert
    for _ in range(50):
        await engine.step()
    assert world.plan_starts == ["vllm-plan2"] * 3  # out of llm: no start loop
    assert engine.state.phase is Phase.START_LLM
    assert engine.mode is Mode.SWAPPING
    # the hog shrinks: a new series, on the plan that fits now
    world.others[:] = [CardClient("someone/else", 5 * GIB, ())]
    await run_until(engine, serving)
    assert world.plan_starts == ["vllm-plan2"] * 3 + ["vllm"]
    assert "llm_insufficient_vram" not in engine.alerts


async def test_non_vram_failures_are_not_vram_passes(tmp_path: Path) -> None:
    world = world_with_plans()
    engine = engine_of(tmp_path, world)
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)
    world.llm_fails_start = "RuntimeError: model file is corrupt\n"
    for _ in range(40):
        await engine.step()
    assert engine.reclaim.llm_vram_failures == 0
    assert engine.reclaim.vram_gave_up is None
    assert "llm_not_ready" in engine.alerts
    assert "llm_insufficient_vram" not in engine.alerts
    assert set(world.plan_starts) == {"vllm"}


async def test_a_restarted_arbiter_finds_the_plan_that_runs(tmp_path: Path) -> None:
    world = world_with_plans()
    world.llm.running = False
    world.use_plan("vllm-plan1")
    world.llm.running = True
    world.use_plan("vllm")
    engine = engine_of(tmp_path, world)
    assert await engine.resume()
    assert engine.reclaim.plan_index == 1
    assert world.llm_service == "vllm-plan1"
    assert engine.state.phase is Phase.SERVE_LLM
    assert status_doc(engine)["llm_plan"]["service"] == "vllm-plan1"


KV_LOG = (
    "ValueError: To serve at least one request with the models's max seq len (65536), (7.00 "
    "GiB KV cache is needed, which is larger than the available KV cache memory (4.50 GiB). "
    "Based on the available memory, the estimated maximum model length is 42000. Try "
    "increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the "
    "engine.\n"
)


async def test_a_kv_cache_too_small_for_the_context_steps_down_without_a_retry(
    tmp_path: Path,
) -> None:
    world = world_with_plans()
    engine = engine_of(tmp_path, world)
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)
    world.llm_fails_start = KV_LOG  # plan 0's context does not fit its KV cache
    await run_until(engine, lambda e: e.state.phase is Phase.WAIT_LLM_READY)
    await engine.step()
    assert "stepping down to plan 1" in engine.alerts["llm_insufficient_vram"]
    world.llm_fails_start = None
    await run_until(engine, serving)
    assert world.plan_starts == ["vllm", "vllm-plan1"]
    assert engine.reclaim.plan_index == 1
    # the card did not change: no restore that would fail the same way
    for _ in range(30):
        await engine.step()
    assert world.plan_starts == ["vllm", "vllm-plan1"]


async def test_a_vllm_its_restart_policy_restarts_still_fails_for_want_of_vram(
    tmp_path: Path,
) -> None:
    """With ``restart: unless-stopped`` Docker starts a vLLM that exited at once again and
    reports it running while it is "restarting": that is a failed start, read from its log,
    not a slow one (the VRAM passes engage instead of the readiness timeout)."""
    world = world_with_plans()
    engine = engine_of(tmp_path, world)
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)
    await run_until(engine, lambda e: e.state.phase is Phase.WAIT_LLM_READY)
    world.llm.running = False
    world.llm.restarting = True
    world.llm.logs = VRAM_LOG
    await engine.step()
    assert engine.reclaim.llm_vram_failures == 1
    assert "attempt 1 of 3" in engine.alerts["llm_insufficient_vram"]
    assert "llm_not_ready" not in engine.alerts
