"""vLLM's plans and the card's tenants (pure): the choice from measured free VRAM, the
bounded passes after a VRAM failure, the restore rule and the tenants' kinds."""

from __future__ import annotations

import pytest

from cardshare.arbiter.cardview import CardClient, CardView
from cardshare.arbiter.config import ConfigError, parse_config
from cardshare.arbiter.plans import (
    FreeVram,
    LlmPlan,
    PassAction,
    TenantKind,
    card_changed,
    choose_plan,
    measure_free,
    should_restore,
    tenants,
    vram_pass,
)

GIB = 2**30
CARD = 32 * GIB
# the lab's ladder (Qwen2.5-7B on a 32 GiB card): utilisation x card, as the vllm role computes
PLANS = (
    LlmPlan("vllm", 0.70, 65536, int(0.70 * CARD)),
    LlmPlan("vllm-plan1", 0.67, 49152, int(0.67 * CARD)),
    LlmPlan("vllm-plan2", 0.61, 32768, int(0.61 * CARD)),
)
HEADROOM = int(0.8 * GIB)


def view(*clients: tuple[str, int], total: int | None = CARD) -> CardView:
    return CardView(0.0, tuple(CardClient(n, b, ()) for n, b in clients), total)


def test_free_is_the_size_minus_everyone_but_vllm() -> None:
    free = measure_free(
        view(("vllm/vllm-plan1", 21 * GIB), ("plex/plex", 2 * GIB), ("retrieval/ovms", 4 * GIB)),
        ["vllm/vllm", "vllm/vllm-plan1"],
    )
    assert free.total == CARD
    assert free.held == 6 * GIB
    assert free.free == 26 * GIB
    assert dict(free.holders) == {"plex/plex": 2 * GIB, "retrieval/ovms": 4 * GIB}


def test_the_config_size_wins_and_an_unknown_size_is_none() -> None:
    assert measure_free(view(total=None), ["vllm/vllm"], 16 * GIB).free == 16 * GIB
    assert measure_free(view(total=None), ["vllm/vllm"]).free is None


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        (0, 0),
        # exactly at the boundary: reservation + headroom == free
        (CARD - int(0.70 * CARD) - HEADROOM, 0),
        (CARD - int(0.70 * CARD) - HEADROOM + 1, 1),
        (CARD - int(0.67 * CARD) - HEADROOM, 1),
        (CARD - int(0.67 * CARD) - HEADROOM + 1, 2),
        (CARD - int(0.61 * CARD) - HEADROOM, 2),
        # nothing fits: the smallest anyway (vLLM refuses by itself; the passes bound it)
        (CARD - int(0.61 * CARD) - HEADROOM + 1, 2),
        (CARD, 2),
    ],
)
def test_the_largest_plan_that_fits_with_the_headroom(held: int, expected: int) -> None:
    free = measure_free(view(("plex/plex", held)), ["vllm/vllm"])
    choice = choose_plan(PLANS, free, HEADROOM)
    assert choice.index == expected
    assert "plex/plex" in choice.reason or held == 0


def test_no_fit_says_so() -> None:
    choice = choose_plan(PLANS, measure_free(view(("plex/plex", 20 * GIB)), ["vllm/vllm"]), 0)
    assert choice.index == 2
    assert "no plan fits" in choice.reason


def test_unknown_size_takes_the_full_plan() -> None:
    assert choose_plan(PLANS, FreeVram(None, 0, ()), HEADROOM).index == 0


@pytest.mark.parametrize(
    ("failed", "failures", "action", "plan"),
    [
        (0, 1, PassAction.RETRY_AFTER_RECLAIM, 0),
        (0, 2, PassAction.STEP_DOWN, 1),
        (1, 2, PassAction.STEP_DOWN, 2),
        (2, 2, PassAction.STEP_DOWN, 2),  # the smallest: the same plan again
        (1, 3, PassAction.GIVE_UP, 1),
        (0, 7, PassAction.GIVE_UP, 0),
    ],
)
def test_vram_passes(failed: int, failures: int, action: PassAction, plan: int) -> None:
    step = vram_pass(failed, failures, len(PLANS))
    assert (step.action, step.plan) == (action, plan)


def test_a_pass_follows_a_failure() -> None:
    with pytest.raises(ValueError, match="failures is 0"):
        vram_pass(0, 0, 3)


def test_card_changed_by_margin_or_holders() -> None:
    before = FreeVram(CARD, 10 * GIB, (("plex/plex", 10 * GIB),))
    assert not card_changed(before, FreeVram(CARD, 10 * GIB - 1, (("plex/plex", 1),)), GIB)
    assert card_changed(before, FreeVram(CARD, 9 * GIB, (("plex/plex", 9 * GIB),)), GIB)
    assert card_changed(before, FreeVram(CARD, 10 * GIB, (("other/x", 10 * GIB),)), GIB)


def test_restore_only_a_larger_plan_that_fits() -> None:
    tight = measure_free(view(("plex/plex", 9 * GIB)), ["vllm/vllm", "vllm/vllm-plan2"])
    assert should_restore(PLANS, 2, tight, HEADROOM) is not None
    assert should_restore(PLANS, 2, tight, HEADROOM).index == 1  # type: ignore[union-attr]
    roomy = measure_free(view(), ["vllm/vllm"])
    assert should_restore(PLANS, 2, roomy, HEADROOM).index == 0  # type: ignore[union-attr]
    full = measure_free(view(("plex/plex", 12 * GIB)), ["vllm/vllm"])
    assert should_restore(PLANS, 2, full, HEADROOM) is None
    assert should_restore(PLANS, 0, roomy, HEADROOM) is None  # the full plan serves


def test_tenants_by_kind() -> None:
    got = tenants(
        view(
            ("vllm/vllm", 20 * GIB),
            ("retrieval/ovms", 4 * GIB),
            ("campaign/encoder", GIB),
            ("plex/plex", 2 * GIB),
            ("someone/else", 1),
        ),
        owners=["vllm/vllm", "comfyui/comfyui"],
        residents=["retrieval/ovms"],
        yielding=["campaign/encoder"],
    )
    assert [(t.name, t.kind) for t in got] == [
        ("vllm/vllm", TenantKind.OWNER),
        ("retrieval/ovms", TenantKind.RESIDENT),
        ("campaign/encoder", TenantKind.YIELDING),
        ("plex/plex", TenantKind.FOREIGN),
        ("someone/else", TenantKind.FOREIGN),
    ]


BASE = {
    "data_dir": "/d",
    "vllm_url": "http://v",
    "served_model_name": "m",
    "comfyui_url": "http://c",
    "card_current_json": "/c.json",
    "token_file": "/t",
}


def plan(service: str, util: float, length: int, reservation: int) -> dict[str, object]:
    return {
        "service": service,
        "gpu_memory_utilization": util,
        "max_model_len": length,
        "reservation_bytes": reservation,
    }


def test_config_plans_and_the_names_of_their_containers() -> None:
    config = parse_config(
        {
            **BASE,
            "llm_plans": [plan("vllm", 0.7, 65536, 3000), plan("vllm-plan1", 0.6, 32768, 2000)],
            "vram_headroom_bytes": 0,
        }
    )
    assert [p.service for p in config.plans] == ["vllm", "vllm-plan1"]
    assert config.llm_names == ("vllm/vllm", "vllm/vllm-plan1")
    assert config.plan_container(1).client_name == "vllm/vllm-plan1"
    # a plan in a compose project of its own (the vllm role's vllm-ladder)
    other = parse_config(
        {
            **BASE,
            "llm_plans": [
                plan("vllm", 0.7, 65536, 3000),
                {**plan("plan1", 0.6, 32768, 2000), "project": "vllm-ladder"},
            ],
        }
    )
    assert other.llm_names == ("vllm/vllm", "vllm-ladder/plan1")
    # without plans: one, the llm container, as before
    assert parse_config(BASE).llm_names == ("vllm/vllm",)


@pytest.mark.parametrize(
    ("plans", "message"),
    [
        ([plan("vllm-plan1", 0.7, 1, 3)], "llm_plans[0].service"),
        ([plan("vllm", 0.7, 1, 3), plan("vllm-plan1", 0.6, 1, 3)], "llm_plans[1].reservation"),
        ([plan("vllm", 1.5, 1, 3)], "llm_plans[0].gpu_memory_utilization"),
        ([plan("vllm", 0.5, 0, 3)], "llm_plans[0].max_model_len"),
        ([{"service": "vllm"}], "give the keys"),
        ([{**plan("vllm", 0.7, 1, 3), "project": ""}], "llm_plans[0].project"),
        ([{**plan("vllm", 0.7, 1, 3), "project": "other"}], "llm_plans[0].service"),
        ([plan("vllm", 0.7, 1, 3), plan("vllm", 0.6, 1, 2)], "its own compose service"),
    ],
)
def test_config_refuses_bad_plans(plans: list[object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config({**BASE, "llm_plans": plans})


def test_config_refuses_a_bad_headroom() -> None:
    with pytest.raises(ConfigError, match="vram_headroom_bytes"):
        parse_config({**BASE, "vram_headroom_bytes": -1})


@pytest.mark.parametrize(
    ("failed", "failures", "action", "plan"),
    [
        (0, 1, PassAction.STEP_DOWN, 1),  # no reclaim-and-retry: the context is the problem
        (1, 2, PassAction.STEP_DOWN, 2),
        (2, 1, PassAction.GIVE_UP, 2),  # the smallest: the same context cannot fit again
        (0, 3, PassAction.GIVE_UP, 0),
    ],
)
def test_a_kv_cache_that_does_not_fit_steps_down_at_once(
    failed: int, failures: int, action: PassAction, plan: int
) -> None:
    step = vram_pass(failed, failures, len(PLANS), context_bound=True)
    assert (step.action, step.plan) == (action, plan)
