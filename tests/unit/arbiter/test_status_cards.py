"""The status page on a host of several cards: one bar per card, grouped by job, and the link
to the fleet view.

The card data is the recorder's ``current.json`` layout for the write-up's second machine (two
B70s as the LLM pool, an A380 for transcodes, the iGPU), the fixture of ``test_pool`` (cards
keyed by drm-pdev as ``cardshare.recorder`` writes them), read by the arbiter's own
RecorderFileSource; the one-card page's cases are in ``test_status_page``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from arbiter_fakes import (
    FakeClock,
    FakeComfy,
    FakeContainers,
    FakeLlm,
    FakeProxy,
    World,
    make_config,
)
from test_pool import A380, B70_A, B70_B, BASE, GIB, IGPU, POOL, SECOND_MACHINE, client
from test_status_page import balanced, page_doc, tenant_items

from cardshare.arbiter.api import build_app
from cardshare.arbiter.cardview import RecorderFileSource
from cardshare.arbiter.config import ConfigError, parse_config
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.states import Outcome, Phase
from cardshare.arbiter.statuspage import render_page
from cardshare.arbiter.store import Store

TOKEN = "s3cret-token-for-tests"
SCANNED = float(SECOND_MACHINE["timestamp_unix"])


def pool_engine(tmp_path: Path, doc: dict[str, Any], **over: Any) -> Engine:
    """An engine whose card data is ``doc`` in a real current.json (no scan of its own)."""
    path = tmp_path / "current.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    settings: dict[str, Any] = {
        "pool_pdevs": POOL,
        "transcode_pdev": A380,
        "resident_client_names": ("retrieval/ovms", "plex/plex"),
        "llm_client_names": ("vllm/vllm",),
        **over,
    }
    config = make_config(tmp_path, **settings)
    world = World(clock=FakeClock(SCANNED + 30))
    pdevs = config.pool if config.pool else None
    return Engine(
        config=config,
        store=Store(config.data_dir / "arbiter.sqlite3"),
        containers=FakeContainers(world),
        llm=FakeLlm(world),
        comfy=FakeComfy(world),
        card=RecorderFileSource(path, (), pdev=pdevs),
        proxy=FakeProxy(world),
        clock=world.clock,
    )


async def overview_and_page(engine: Engine) -> tuple[dict[str, Any], str]:
    await engine.watch.read(None)
    http = TestClient(TestServer(build_app(engine, TOKEN)))
    await http.start_server()
    try:
        overview = await (await http.get("/v1/overview")).json()
        page = await (await http.get("/")).text()
    finally:
        await http.close()
    return overview, page


def figures(page: str) -> list[str]:
    """Each card's figure, in the page's order."""
    return re.findall(r'<figure data-chart="tenants"[^>]*>.*?</figure>', page)


async def test_the_overview_carries_the_cards_by_job(tmp_path: Path) -> None:
    overview, _ = await overview_and_page(pool_engine(tmp_path, SECOND_MACHINE))
    assert overview["cards"] == [
        {
            "job": "llm",
            "heading": "LLM pool (TP=2)",
            "cards": [
                {
                    "pdev": B70_A,
                    "vram_total_bytes": 32 * GIB,
                    "image": True,
                    "tenants": [{"name": "vllm/vllm", "kind": "owner", "vram_bytes": 27 * GIB}],
                },
                {
                    "pdev": B70_B,
                    "vram_total_bytes": 32 * GIB,
                    "image": False,
                    "tenants": [
                        {"name": "vllm/vllm", "kind": "owner", "vram_bytes": 27 * GIB},
                        {"name": "retrieval/ovms", "kind": "resident", "vram_bytes": 3 * GIB},
                    ],
                },
            ],
        },
        {
            "job": "transcode",
            "heading": "Transcode card",
            "cards": [
                {
                    "pdev": A380,
                    "vram_total_bytes": 6 * GIB,
                    "image": False,
                    "tenants": [
                        {"name": "plex/plex", "kind": "resident", "vram_bytes": 900 * 2**20}
                    ],
                }
            ],
        },
        {
            "job": "other",
            "heading": "Other card",
            "cards": [
                {
                    "pdev": IGPU,
                    "vram_total_bytes": None,
                    "image": False,
                    "tenants": [{"name": "gnome-shell", "kind": "foreign", "vram_bytes": 0}],
                }
            ],
        },
    ]
    # the decisions still see the pool only (the desktop and Plex are not on it)
    assert [t["name"] for t in overview["tenants"]] == ["vllm/vllm", "vllm/vllm", "retrieval/ovms"]


async def test_the_page_draws_a_bar_per_card_pool_first(tmp_path: Path) -> None:
    _, page = await overview_and_page(pool_engine(tmp_path, SECOND_MACHINE))
    balanced(page)
    first = page[page.index('<div class="first">') : page.index('aria-labelledby="swaps-h"')]
    assert '<h2 id="card-h">The cards</h2>' in first
    bars = figures(first)
    assert [re.findall(r'data-pdev="([^"]+)"', f)[0] for f in bars] == [
        B70_A,
        B70_B,
        A380,
        IGPU,
    ]
    headings = [first.index(h) for h in ("LLM pool (TP=2)", "Transcode card", "Other card")]
    assert headings == sorted(headings)
    assert first.index("LLM pool (TP=2)") < first.index(bars[0]) < first.index("Transcode card")
    assert first.index("Transcode card") < first.index(bars[2]) < first.index("Other card")
    # each bar its own tenants, memory and size
    assert tenant_items(bars[0]) == {
        "vllm/vllm": "vllm/vllm owner 27.0 GiB",
        "free": "free 5.0 GiB",
    }
    assert tenant_items(bars[1])["retrieval/ovms"] == "retrieval/ovms resident 3.0 GiB"
    assert tenant_items(bars[1])["free"] == "free 2.0 GiB"
    assert "30.0 GiB held of 32.0 GiB" in bars[1]
    assert tenant_items(bars[2]) == {
        "plex/plex": "plex/plex resident 0.9 GiB",
        "free": "free 5.1 GiB",
    }
    assert tenant_items(bars[3]) == {"gnome-shell": "gnome-shell foreign 0.0 GiB"}
    assert "unknown (the bar is what the clients hold)" in bars[3]
    assert "(ComfyUI&#x27;s card)" in first.split(bars[0])[0]
    # ids unique on the page (one title and description per bar)
    ids = re.findall(r' id="([^"]+)"', page)
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    # one colour per client across the bars: vLLM's the same on both pool cards
    fills = {re.findall(r'rect data-tenant="vllm/vllm"[^>]*fill="([^"]+)"', b)[0] for b in bars[:2]}
    assert len(fills) == 1


async def test_vllm_started_after_the_scan_is_striped_on_every_pool_card(tmp_path: Path) -> None:
    """Back in llm after a swap, the scan older than vLLM's start: each pool card shows the
    plan as started (vLLM asks the same share of each), the A380 and the iGPU do not."""
    doc = {
        **SECOND_MACHINE,
        "cards": {
            **SECOND_MACHINE["cards"],
            B70_A: {"driver": "xe", "vram_total_bytes": 32 * GIB, "clients": []},
            B70_B: {
                "driver": "xe",
                "vram_total_bytes": 32 * GIB,
                "clients": [client("retrieval/ovms", 3 * GIB)],
            },
        },
    }
    engine = pool_engine(tmp_path, doc)
    engine.store.transition(Phase.START_LLM, Outcome.OK, "test", SCANNED - 100)
    engine.store.transition(Phase.WAIT_LLM_READY, Outcome.OK, "test", SCANNED + 10)
    engine.state = engine.store.transition(Phase.SERVE_LLM, Outcome.OK, "test", SCANNED + 20)
    overview, page = await overview_and_page(engine)
    assert [c["event"] for c in overview["since_scan"]] == ["started"]
    bars = figures(page)
    pending = [re.findall(r"<li data-tenant=\"([^\"]+)\" data-pending", b) for b in bars]
    assert pending == [["vllm/vllm"], ["vllm/vllm"], [], []]
    assert "vllm/vllm owner started" in tenant_items(bars[1])["vllm/vllm"]


@pytest.mark.parametrize(
    ("over", "doc"),
    [
        ({"pool_pdevs": ()}, SECOND_MACHINE),  # no card named: every card is the card
        (  # the one card named, alone on the host
            {"pool_pdevs": (), "card_pdev": B70_A, "transcode_pdev": None},
            {**SECOND_MACHINE, "cards": {B70_A: SECOND_MACHINE["cards"][B70_A]}},
        ),
    ],
)
async def test_one_card_keeps_the_one_bar(
    tmp_path: Path, over: dict[str, Any], doc: dict[str, Any]
) -> None:
    overview, page = await overview_and_page(pool_engine(tmp_path, doc, **over))
    assert overview["cards"] == []
    assert '<h2 id="card-h">The card</h2>' in page and len(figures(page)) == 1
    assert 'aria-labelledby="tenants-t tenants-d"' in page and "data-pdev" not in page


async def test_a_named_card_beside_an_igpu_shows_both(tmp_path: Path) -> None:
    """card_pdev alone on a host with an iGPU: the LLM card, then the iGPU."""
    doc = {**SECOND_MACHINE, "cards": {k: SECOND_MACHINE["cards"][k] for k in (IGPU, B70_A)}}
    overview, page = await overview_and_page(
        pool_engine(tmp_path, doc, pool_pdevs=(), card_pdev=B70_A, transcode_pdev=None)
    )
    assert [(g["heading"], [c["pdev"] for c in g["cards"]]) for g in overview["cards"]] == [
        ("LLM card", [B70_A]),
        ("Other card", [IGPU]),
    ]
    assert len(figures(page)) == 2


# --- the fleet view ----------------------------------------------------------------------------


def test_the_now_block_links_to_the_fleet_view_when_set() -> None:
    url = "http://proxy.lan:8099/fleet"
    text = render_page(page_doc(fleet_view_url=url), "t")
    balanced(text)
    now = text[text.index('<section class="now"') : text.index('aria-labelledby="card-h"')]
    assert f'<a href="{url}" data-fleet>Fleet view</a>' in now
    for doc in (page_doc(), page_doc(fleet_view_url="")):
        assert "data-fleet" not in render_page(doc, "t")


async def test_the_overview_carries_the_fleet_view_url(tmp_path: Path) -> None:
    url = "https://fleet.example/view"
    overview, page = await overview_and_page(
        pool_engine(tmp_path, SECOND_MACHINE, fleet_view_url=url)
    )
    assert overview["fleet_view_url"] == url and f'href="{url}"' in page


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"fleet_view_url": "proxy:8099"},
            "config key 'fleet_view_url' has value 'proxy:8099': set it to the fleet view's "
            'http:// or https:// URL, or "" for no link',
        ),
        (
            {"fleet_view_url": None},
            "config key 'fleet_view_url' has value None: set it to the fleet view's http://",
        ),
        (
            {"transcode_pdev": "renderD129"},
            "config key 'transcode_pdev' has value 'renderD129': set it to the transcode card's "
            "PCI address as sysfs prints it (such as '0000:07:00.0'), or leave it out",
        ),
        (
            {"pool_pdevs": list(POOL), "transcode_pdev": B70_B},
            "config key 'transcode_pdev' has value '0000:04:00.0': name a card outside the LLM "
            "pool ['0000:03:00.0', '0000:04:00.0'] (a card takes one job), or leave it out when "
            "transcodes share the pool's card",
        ),
    ],
)
def test_bad_fleet_and_transcode_keys_are_refused(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **raw})
    assert str(info.value).startswith(message)


def test_the_fleet_and_transcode_keys_default_to_none() -> None:
    config = parse_config(BASE)
    assert (config.fleet_view_url, config.transcode_pdev) == ("", None)
    config = parse_config({**BASE, "fleet_view_url": "http://p:8099/fleet", "transcode_pdev": A380})
    assert (config.fleet_view_url, config.transcode_pdev) == ("http://p:8099/fleet", A380)
