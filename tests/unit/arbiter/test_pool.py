"""The arbiter trades the LLM pool as one owner: the write-up's second machine, two B70s as
one tensor-parallel pool (vLLM's workers hold memory on each), an A380 that takes Plex's
transcodes, and the iGPU driving the desktop.

The card data is the recorder's ``current.json`` layout (cards keyed by drm-pdev, as
``cardshare.recorder`` writes it), read by the arbiter's own parser: a swap to image waits
until vLLM's memory left every pool card; a client on the A380 or the iGPU is not on the
pool; a pool card's foreign client is named with its card.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from arbiter_fakes import (
    PNG,
    WORKFLOW,
    FakeCard,
    FakeClock,
    FakeComfy,
    FakeContainers,
    FakeLlm,
    FakeProxy,
    World,
    make_config,
    run_until,
)

from cardshare.arbiter.api import status_doc
from cardshare.arbiter.cardview import CardClient, CardDataError, CardView, parse_card_view
from cardshare.arbiter.config import Config, ConfigError, parse_config
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.plans import measure_free
from cardshare.arbiter.rules import (
    LlmActivity,
    ProxyState,
    SwapObservations,
    should_swap_to_image,
)
from cardshare.arbiter.states import Mode, Phase
from cardshare.arbiter.store import Store

GIB = 2**30
IGPU, A380, B70_A, B70_B = "0000:00:02.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"
POOL = (B70_A, B70_B)
SIZES = {IGPU: None, A380: 6 * GIB, B70_A: 32 * GIB, B70_B: 32 * GIB}

BASE: dict[str, Any] = {
    "data_dir": "/var/lib/cardshare/arbiter",
    "vllm_url": "http://127.0.0.1:8000",
    "served_model_name": "qwen",
    "comfyui_url": "http://127.0.0.1:8188",
    "card_current_json": "/var/lib/cardshare/current.json",
    "token_file": "/etc/cardshare/arbiter.token",
}


# -- the configuration ------------------------------------------------------------------------


def test_the_pool_defaults_to_the_one_card() -> None:
    """An old config (no pool) loads as before: the pool is card_pdev alone, or none named."""
    assert parse_config(BASE).pool == ()
    assert parse_config(BASE).image_pdev is None
    one = parse_config({**BASE, "card_pdev": B70_A})
    assert (one.pool_pdevs, one.pool, one.image_pdev) == ((), (B70_A,), B70_A)
    two = parse_config({**BASE, "card_pdev": B70_A, "pool_pdevs": list(POOL)})
    assert (two.pool, two.image_pdev) == (POOL, B70_A)
    named = parse_config({**BASE, "pool_pdevs": list(POOL), "image_card_pdev": B70_B})
    assert (named.pool, named.image_pdev, named.card_pdev) == (POOL, B70_B, None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"pool_pdevs": []},
            "config key 'pool_pdevs' has value []: set it to the LLM pool's cards, each PCI "
            "address once as sysfs prints it (such as ['0000:03:00.0', '0000:04:00.0']), or "
            "leave it out for card_pdev alone",
        ),
        (
            {"pool_pdevs": [B70_A, B70_A]},
            "config key 'pool_pdevs' has value ['0000:03:00.0', '0000:03:00.0']: set it to the "
            "LLM pool's cards",
        ),
        (
            {"pool_pdevs": ["0000:03:00.0", "renderD128"]},
            "config key 'pool_pdevs' has value ['0000:03:00.0', 'renderD128']: set it to",
        ),
        (
            {"pool_pdevs": list(POOL), "card_pdev": A380},
            "config key 'card_pdev' has value '0000:02:00.0': name one of pool_pdevs "
            "['0000:03:00.0', '0000:04:00.0'] (the pool's first), or leave card_pdev out",
        ),
        (
            {"pool_pdevs": list(POOL), "image_card_pdev": A380},
            "config key 'image_card_pdev' has value '0000:02:00.0': name one of the pool's "
            "cards ['0000:03:00.0', '0000:04:00.0'], or leave it out for the first",
        ),
        (
            {"card_pdev": B70_A, "image_card_pdev": B70_B},
            "config key 'image_card_pdev' has value '0000:04:00.0': name one of the pool's "
            "cards ['0000:03:00.0'], or leave it out for the first",
        ),
        (
            {"image_card_pdev": B70_A},
            "config key 'image_card_pdev' has value '0000:03:00.0': leave it out on a host "
            "whose cards are not named",
        ),
    ],
)
def test_a_bad_pool_is_refused_naming_key_value_fix(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **change})
    assert str(info.value).startswith(message)


# -- the card data over the pool --------------------------------------------------------------


def recorder_doc(now: float, clients: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """current.json as the recorder writes it: every card of the host, keyed by drm-pdev."""
    return {
        "timestamp_unix": now,
        "cards": {
            pdev: {"driver": "xe", "vram_total_bytes": size, "clients": clients.get(pdev, [])}
            for pdev, size in SIZES.items()
        },
    }


def client(name: str, vram: int, **engines: float) -> dict[str, Any]:
    return {"name": name, "vram_bytes": vram, "engines": engines}


SECOND_MACHINE = recorder_doc(
    100.0,
    {
        IGPU: [client("gnome-shell", 0, rcs=0.3)],
        A380: [client("plex/plex", 900 * 2**20, vcs=0.6, vecs=0.2)],
        B70_A: [client("vllm/vllm", 27 * GIB, ccs=0.1)],
        B70_B: [client("vllm/vllm", 27 * GIB, ccs=0.1), client("retrieval/ovms", 3 * GIB)],
    },
)


def test_the_pool_s_view_holds_its_cards_clients_by_card() -> None:
    view = parse_card_view(SECOND_MACHINE, POOL)
    assert view.cards == ((B70_A, 32 * GIB), (B70_B, 32 * GIB))
    assert [(c.name, c.pdev) for c in view.clients] == [
        ("vllm/vllm", B70_A),
        ("vllm/vllm", B70_B),
        ("retrieval/ovms", B70_B),
    ]
    # Plex on the A380 and the desktop on the iGPU are not on the pool
    assert [c.name for c in view.others(["vllm/vllm"])] == ["retrieval/ovms"]
    assert view.vram_of(["vllm/vllm"]) == 54 * GIB
    assert view.on(B70_B) == CardView(
        100.0,
        (CardClient("vllm/vllm", 27 * GIB, ("ccs",)), CardClient("retrieval/ovms", 3 * GIB, ())),
        32 * GIB,
    )
    with pytest.raises(CardDataError) as info:
        view.on(A380)
    assert str(info.value) == "card 0000:02:00.0 is not in the pool (0000:03:00.0, 0000:04:00.0)"


def test_a_pool_card_missing_from_the_card_data_is_an_error() -> None:
    with pytest.raises(CardDataError) as info:
        parse_card_view(SECOND_MACHINE, (B70_A, "0000:05:00.0"))
    assert str(info.value) == (
        "card data has no card 0000:05:00.0 (cards: 0000:00:02.0, 0000:02:00.0, 0000:03:00.0, "
        "0000:04:00.0): set pool_pdevs to the pool cards' PCI addresses"
    )


def test_vllm_s_plan_is_measured_on_the_tightest_pool_card() -> None:
    """vLLM asks one share of every card: the card where others hold more decides."""
    free = measure_free(parse_card_view(SECOND_MACHINE, POOL), ["vllm/vllm"])
    assert (free.total, free.held, free.free) == (32 * GIB, 3 * GIB, 29 * GIB)
    assert free.describe_holders() == "retrieval/ovms on 0000:04:00.0 3.0 GiB"
    # the A380's Plex never shrinks the pool's plan
    assert measure_free(parse_card_view(SECOND_MACHINE, (B70_A,)), ["vllm/vllm"]).free == 32 * GIB


# -- "someone else is on the card", per pool card ---------------------------------------------

NOW = 10_000.0


def swap_obs(view: CardView, peak: int | None = None) -> SwapObservations:
    return SwapObservations(
        queue_length=1,
        activity=LlmActivity(NOW - 120),
        proxy=ProxyState(0, 0),
        card=view,
        next_job_peak=peak,
    )


def pool_config(**overrides: Any) -> Config:
    return make_config(
        Path("/nonexistent"), card_data_max_age_seconds=120.0, pool_pdevs=POOL, **overrides
    )


def test_a_transcode_on_the_a380_is_not_on_the_pool() -> None:
    doc = recorder_doc(
        NOW,
        {
            IGPU: [client("gnome-shell", 0, rcs=0.3)],
            A380: [client("plex/plex", 900 * 2**20, vcs=0.6)],
            B70_A: [client("vllm/vllm", 27 * GIB)],
            B70_B: [client("vllm/vllm", 27 * GIB)],
        },
    )
    decision = should_swap_to_image(swap_obs(parse_card_view(doc, POOL)), pool_config(), NOW)
    assert decision.go, decision.reasons
    # the same Plex on the second pool card holds the swap, named with its card
    doc["cards"][B70_B]["clients"].append(client("plex/plex", 2 * GIB, vcs=0.6))
    decision = should_swap_to_image(swap_obs(parse_card_view(doc, POOL)), pool_config(), NOW)
    assert not decision.go
    assert decision.reasons == (
        "another client is on pool card 0000:04:00.0: plex/plex holds 2.0 GiB VRAM and keeps "
        "vcs busy",
    )


@pytest.mark.parametrize(("image_card", "go"), [(B70_A, True), (B70_B, False)])
def test_image_beside_a_foreign_client_is_judged_on_comfyui_s_card(
    image_card: str, go: bool
) -> None:
    """Plex holds 10 GiB of the second pool card: a 20 GiB job fits beside it on the first
    card (22 GiB free of Plex there), not on the second (20 + 10 + 4 reserve > 32 - 1)."""
    doc = recorder_doc(NOW, {B70_B: [client("plex/plex", 10 * GIB, vcs=0.6)]})
    config = pool_config(
        image_card_pdev=image_card,
        image_beside_foreign=True,
        foreign_reserve_bytes=4 * GIB,
        vram_headroom_bytes=GIB,
    )
    decision = should_swap_to_image(swap_obs(parse_card_view(doc, POOL), 20 * GIB), config, NOW)
    assert decision.go is go, decision.reasons


# -- the engine: a swap waits for every pool card ---------------------------------------------


class PoolCard(FakeCard):
    """The second machine's card data: vLLM (TP=2) holds its memory on both B70s, each
    card's share released ``release[pdev]`` seconds after vLLM's exit (a worker that is slow
    to exit); ComfyUI on its card; ``extra`` clients per card (Plex on the A380)."""

    def __init__(self, world: World, image_card: str = B70_A) -> None:
        super().__init__(world)
        self.release: dict[str, float] = {B70_A: 0.0, B70_B: 0.0}
        self.image_card = image_card
        self.extra: dict[str, list[dict[str, Any]]] = {}

    def look(self) -> CardView:
        w, now = self.w, self.w.clock.now()
        clients: dict[str, list[dict[str, Any]]] = {p: list(c) for p, c in self.extra.items()}
        for pdev in POOL:
            if w.llm.running or w.llm_vram_lingers or now < w.llm.finished + self.release[pdev]:
                clients.setdefault(pdev, []).append(client("vllm/vllm", w.llm_vram(), ccs=0.1))
        if w.image.running:
            clients.setdefault(self.image_card, []).append(client("comfyui/comfyui", w.comfy_now()))
        return parse_card_view(recorder_doc(now, clients), POOL)


def pool_engine(tmp_path: Path, world: World, card: PoolCard, **overrides: Any) -> Engine:
    config = make_config(tmp_path, pool_pdevs=POOL, idle_seconds=1.0, **overrides)
    return Engine(
        config=config,
        store=Store(config.data_dir / "arbiter.sqlite3"),
        containers=FakeContainers(world),
        llm=FakeLlm(world),
        comfy=FakeComfy(world),
        card=card,
        proxy=FakeProxy(world),
        clock=world.clock,
    )


async def test_a_swap_waits_until_both_pool_cards_released_vllm_s_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    world = World(FakeClock())
    card = PoolCard(world)
    card.release[B70_B] = 6.0  # the first card is free at once, the second 6 s later
    engine = pool_engine(tmp_path, world, card, llm_release_timeout_seconds=30.0)
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    await run_until(engine, lambda e: e.state.phase is Phase.WAIT_LLM_RELEASE)
    stopped = world.llm.finished
    caplog.set_level(logging.INFO, logger="cardshare.arbiter")
    await run_until(engine, lambda e: e.state.phase is not Phase.WAIT_LLM_RELEASE)
    assert engine.state.phase is Phase.START_IMAGE
    # ComfyUI starts only once the second card showed vLLM's memory gone
    assert world.clock.now() >= stopped + 6.0
    # the log says what the wait is on, once, naming the card that still holds vLLM's memory
    waits = [r.getMessage() for r in caplog.records if "waiting for the release" in r.getMessage()]
    assert waits == [
        "waiting for the release: vllm/vllm still hold 27.0 GiB on pool card 0000:04:00.0"
    ]
    assert "llm_release_timeout" not in engine.alerts
    await run_until(engine, lambda e: e.mode is Mode.LLM and e.store.queue_length() == 0)
    swaps = engine.store.swaps(2)
    assert [(s.direction, s.ok) for s in swaps] == [("to_llm", True), ("to_image", True)]


async def test_a_pool_card_that_keeps_vllm_s_memory_holds_the_swap_and_is_named(
    tmp_path: Path,
) -> None:
    world = World(FakeClock())
    card = PoolCard(world)
    card.release[B70_B] = 1e9  # a worker that never lets go of the second card
    engine = pool_engine(tmp_path, world, card, llm_release_timeout_seconds=3.0)
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    await run_until(engine, lambda e: e.state.phase is Phase.START_LLM)
    assert engine.alerts["llm_release_timeout"] == (
        "memory not released after 3 s: vllm/vllm still hold 27.0 GiB on pool card 0000:04:00.0"
    )
    assert "start image" not in world.calls


async def test_a_plex_transcode_on_the_a380_does_not_hold_the_swap(tmp_path: Path) -> None:
    world = World(FakeClock())
    card = PoolCard(world)
    card.extra = {
        A380: [client("plex/plex", 900 * 2**20, vcs=0.6, vecs=0.2)],
        IGPU: [client("gnome-shell", 0, rcs=0.3)],
    }
    engine = pool_engine(tmp_path, world, card)
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)
    assert engine.last_decision.go
    assert "no other client on the card" in engine.last_decision.reasons
    # the status shows the pool card by card, the A380 and the iGPU not at all
    await engine.watch.read(world.clock.now())  # a scan with ComfyUI up
    status = status_doc(engine)["card"]
    assert [c["name"] for c in status["clients"]] == ["comfyui/comfyui"]
    assert status["pool"] == [
        {"pdev": B70_A, "vram_total_bytes": 32 * GIB, "clients": ["comfyui/comfyui"]},
        {"pdev": B70_B, "vram_total_bytes": 32 * GIB, "clients": []},
    ]


async def test_a_plex_transcode_on_a_pool_card_holds_the_swap(tmp_path: Path) -> None:
    world = World(FakeClock())
    card = PoolCard(world)
    card.extra = {B70_B: [client("plex/plex", 900 * 2**20, vcs=0.6)]}
    engine = pool_engine(tmp_path, world, card)
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    for _ in range(20):
        await engine.step()
    assert engine.mode is Mode.LLM and "stop llm" not in world.calls
    assert (
        "another client is on pool card 0000:04:00.0: plex/plex holds 0.9 GiB VRAM and keeps "
        "vcs busy" in engine.last_decision.reasons
    )
    card.extra = {}
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)


async def test_the_hand_back_waits_for_comfyui_s_release_on_its_pool_card(
    tmp_path: Path,
) -> None:
    """ComfyUI on the second pool card (named): vLLM starts again only once that card shows
    its memory gone."""
    world = World(FakeClock())
    card = PoolCard(world, image_card=B70_B)
    engine = pool_engine(tmp_path, world, card, image_card_pdev=B70_B)
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)
    world.comfy_vram = 5 * GIB
    original = card.look

    def lingering() -> CardView:  # ComfyUI's memory stays 4 s past its stop
        view = original()
        if not world.image.running and world.clock.now() < world.image.finished + 4.0:
            doc = recorder_doc(view.scanned_at, {B70_B: [client("comfyui/comfyui", 5 * GIB)]})
            return parse_card_view(doc, POOL)
        return view

    card.look = lingering  # type: ignore[method-assign]
    await run_until(engine, lambda e: e.state.phase is Phase.WAIT_IMAGE_RELEASE)
    stopped = world.image.finished
    await run_until(engine, lambda e: e.state.phase is not Phase.WAIT_IMAGE_RELEASE)
    assert engine.state.phase is Phase.START_LLM
    assert world.clock.now() >= stopped + 4.0
    assert "image_release_timeout" not in engine.alerts
