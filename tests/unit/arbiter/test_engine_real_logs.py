"""The engine on real vLLM 0.32 failure logs in their real length (tests/fixtures/vllm): the
cause of a failed start is found wherever vLLM printed it, and only a memory failure starts
the VRAM passes."""

from __future__ import annotations

from pathlib import Path

from arbiter_fakes import PNG, WORKFLOW, FakeClock, World, make_engine, run_until

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
VLLM_LOGS = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"


def real_log(name: str) -> str:
    return (VLLM_LOGS / name).read_text(encoding="utf-8")


def serving(e: Engine) -> bool:
    return e.state.phase is Phase.SERVE_LLM and e.store.queue_length() == 0


async def handback_failing_with(tmp_path: Path, log: str) -> tuple[World, Engine]:
    """A swap to image and back, whose first vLLM start exits printing ``log``."""
    world = World(FakeClock())
    world.card_total = CARD
    world.plan_reservations = {p.service: p.reservation_bytes for p in PLANS}
    engine = make_engine(
        tmp_path, world, llm_plans=PLANS, idle_seconds=5.0, vram_retry_margin_bytes=GIB
    )
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)
    world.llm_fails_start = log
    await run_until(engine, lambda e: e.state.phase is Phase.WAIT_LLM_READY)
    await engine.step()  # vLLM exited at start: its log is read
    world.llm_fails_start = None
    return world, engine


async def test_a_real_kv_cache_failure_steps_the_plan_down(tmp_path: Path) -> None:
    """The cause is at lines 74 and 106 of 167; the last 50 lines (all the engine read before)
    are the API server's traceback, and the failure was "exited": no step down."""
    world, engine = await handback_failing_with(tmp_path, real_log("kv-cache-start-failure.log"))
    assert engine.reclaim.llm_vram_failures == 1
    alert = engine.alerts["llm_insufficient_vram"]
    assert "stepping down to plan 1" in alert
    assert "larger than the available KV cache memory" in alert
    assert "llm_not_ready" not in engine.alerts
    await run_until(engine, serving)
    assert world.plan_starts == ["vllm", "vllm-plan1"]


async def test_a_real_yarn_refusal_is_no_vram_pass(tmp_path: Path) -> None:
    world, engine = await handback_failing_with(tmp_path, real_log("yarn-refusal.log"))
    assert engine.reclaim.llm_vram_failures == 0
    assert "llm_insufficient_vram" not in engine.alerts
    alert = engine.alerts["llm_not_ready"]
    assert "(exit code 1): pydantic_core._pydantic_core.ValidationError" in alert
    assert "User-specified max_model_len (65536) is greater than the derived" in alert
    assert world.plan_starts == ["vllm"]
