"""The status page's first screen in a real browser, against an arbiter started here.

Headless Chromium (Debian's package, driven by Playwright, as in the site scenario's
test_status_page.py) loads the page this test's arbiter app serves: the engine over the unit
tests' fakes (arbiter_fakes: Docker, vLLM, ComfyUI, the proxy and the card are stand-ins) after
a few swaps, with vLLM started after the last scan, requests held, a job queued and two alerts
raised (a long one folds). At a phone's 390x844 and a desktop's 1280x800 the answers (the
mode, the card's bar and tenants, the alerts, the held requests, the queued jobs) must lie
within the first viewport without scrolling, nothing may scroll sideways, and the swaps' table
stays folded. Screenshots are kept in .cache/artifacts/ (CI keeps that directory)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from arbiter_fakes import WORKFLOW, FakeClock, World, make_engine, run_until

from cardshare.arbiter.api import build_app
from cardshare.arbiter.cardview import CardClient
from cardshare.arbiter.common import Alert
from cardshare.arbiter.plans import LlmPlan

playwright_api = pytest.importorskip("playwright.async_api")

NOW = 1_796_126_400.0  # 2026-12-01 12:00:00 UTC
GIB = 1024**3
TOKEN = "s3cret-token-for-tests"
VIEWPORTS = {"phone": (390, 844), "desktop": (1280, 800)}
ARTIFACTS = Path(
    os.environ.get("CARDSHARE_ARTIFACTS", Path(__file__).parents[3] / ".cache/artifacts")
)
# what the first screen must answer, by selector
ANSWERS = {
    "mode": "[data-mode]",
    "held": "[data-held]",
    "queued": "[data-queue]",
    "card bar": "figure[data-chart=tenants] svg",
    "card age": "[data-card-age]",
    "tenants": "figure[data-chart=tenants] ul.tenants",
    "alerts": "#alerts-h",
    "first alert": "#alerts > ul > li:first-child, #alerts > p",
}


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Chromium is missing: tools/deps.sh installs Debian's chromium")
    return path


def measure(page: Any) -> Any:
    return page.evaluate(
        """(answers) => {
          const boxes = {};
          for (const [name, sel] of Object.entries(answers)) {
            const e = document.querySelector(sel);
            if (!e) { boxes[name] = null; continue; }
            const r = e.getBoundingClientRect();
            boxes[name] = {top: r.top, bottom: r.bottom, left: r.left, right: r.right,
                           visible: r.width > 0 && r.height > 0};
          }
          const fold = document.querySelector('details#swaps-all');
          return {
            boxes: boxes,
            scrollX: window.scrollX, scrollY: window.scrollY,
            scrollWidth: document.documentElement.scrollWidth,
            innerWidth: window.innerWidth, innerHeight: window.innerHeight,
            foldOpen: fold ? fold.open : null,
            rowsShown: [...document.querySelectorAll('tr[data-swap]')]
              .filter(r => r.checkVisibility()).length,
            rows: document.querySelectorAll('tr[data-swap]').length,
            lastSwap: document.querySelector('[data-last-swap]') !== null,
            today: document.querySelector('[data-swaps-today]')?.dataset.swapsToday,
            pending: [...document.querySelectorAll('ul.tenants li[data-pending]')]
              .map(li => li.textContent.replace(/\\s+/g, ' ').trim()),
            held: document.querySelector('[data-held]')?.dataset.held,
            height: document.documentElement.scrollHeight,
          };
        }""",
        ANSWERS,
    )


async def busy_arbiter(tmp_path: Path) -> tuple[TestClient, Any]:
    world = World(clock=FakeClock(NOW))
    world.others = [CardClient("retrieval/ovms", 3 * GIB, ()), CardClient("plex/plex", GIB, ())]
    world.card_total = 32 * GIB
    engine = make_engine(
        tmp_path,
        world,
        idle_seconds=1.0,
        resident_client_names=("retrieval/ovms",),
        llm_plans=(LlmPlan("vllm", 0.45, 32768, int(14.2 * GIB)),),
    )
    engine.card.recorder_every = None  # type: ignore[attr-defined]  # the arbiter's scans only
    world.others = [CardClient("retrieval/ovms", 3 * GIB, ())]
    for n in range(3):  # three swaps each way
        engine.store.add_job(f"j{n}", WORKFLOW, (), world.clock.now())
        await run_until(
            engine,
            lambda e, n=n: len(s := e.store.swaps(10)) == 2 * n + 2 and s[0].finished,
        )
    world.others = [CardClient("retrieval/ovms", 3 * GIB, ()), CardClient("plex/plex", GIB, ())]
    world.proxy = {"in_flight": 1, "held": 2, "oldest_held_seconds": 6.0}
    engine.store.add_job("queued", WORKFLOW, (), world.clock.now())
    engine.alerts.set(
        Alert.CARD_DATA,
        "card data is 300 s old even after a fresh scan (max 120 s): is the recorder running?",
    )
    engine.alerts.set(  # a long one (the real message, with a log excerpt): folded
        Alert.LLM_OOM_KILLED,
        "vLLM was killed for want of host memory (OOMKilled) while starting plan 0; the card is "
        "held by: retrieval/ovms 3.0 GiB; log: " + "Loading safetensors checkpoint shards " * 8,
    )
    engine.alive = True
    world.clock.t += 12  # the page is looked at a little later
    http = TestClient(TestServer(build_app(engine, TOKEN)))
    await http.start_server()
    return http, engine


@pytest.mark.parametrize("viewport", sorted(VIEWPORTS))
async def test_the_first_screen_answers_without_scrolling(tmp_path: Path, viewport: str) -> None:
    executable = chromium()
    http, _ = await busy_arbiter(tmp_path)
    width, height = VIEWPORTS[viewport]
    try:
        async with playwright_api.async_playwright() as pw:
            # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
            browser = await pw.chromium.launch(executable_path=executable, args=["--no-sandbox"])
            try:
                context = await browser.new_context(
                    viewport={"width": width, "height": height},
                    is_mobile=viewport == "phone",
                    java_script_enabled=False,  # the page reads without its script
                )
                page = await context.new_page()
                response = await page.goto(str(http.make_url("/")))
                assert response is not None and response.status == 200
                seen = await measure(page)
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(ARTIFACTS / f"status-first-{viewport}.png"))
                await page.screenshot(
                    path=str(ARTIFACTS / f"status-full-{viewport}.png"), full_page=True
                )
            finally:
                await browser.close()
    finally:
        await http.close()
    assert seen["scrollX"] == 0 and seen["scrollY"] == 0
    for name, box in seen["boxes"].items():
        assert box is not None and box["visible"], (name, box)
        assert box["top"] >= 0 and box["bottom"] <= seen["innerHeight"], (name, box, seen)
        assert box["left"] >= 0 and box["right"] <= seen["innerWidth"], (name, box, seen)
    assert seen["scrollWidth"] <= seen["innerWidth"], seen
    # the swaps: the last one and today's numbers shown, the table of all folded away
    assert seen["lastSwap"] and seen["today"] == "6"
    assert seen["foldOpen"] is False and seen["rows"] == 6 and seen["rowsShown"] == 0
    # vLLM came back after the last scan: shown as started, not as free memory
    assert seen["pending"] == ["vllm/vllm owner started 12 s ago, not yet measured (plan 14.2 GiB)"]
    assert seen["held"] == "2"


# --- a host of several cards: one bar per card, grouped by job ---------------------------------


def measure_bars(page: Any) -> Any:
    return page.evaluate(
        """() => {
          const box = (e) => { const r = e.getBoundingClientRect();
            return {top: r.top, bottom: r.bottom, left: r.left, right: r.right,
                    width: r.width, height: r.height}; };
          return {
            bars: [...document.querySelectorAll('figure[data-chart=tenants]')].map(f => ({
              pdev: f.dataset.pdev, job: f.closest('[data-job]')?.dataset.job,
              svg: box(f.querySelector('svg')), list: box(f.querySelector('ul.tenants')),
              tenants: [...f.querySelectorAll('rect[data-tenant]')].map(r => r.dataset.tenant),
            })),
            headings: [...document.querySelectorAll('[data-job] > h3')].map(
              h => [h.textContent, box(h).top]),
            scrollWidth: document.documentElement.scrollWidth,
            innerWidth: window.innerWidth, innerHeight: window.innerHeight,
          };
        }"""
    )


@pytest.mark.parametrize("viewport", sorted(VIEWPORTS))
async def test_a_pool_host_draws_a_bar_per_card(tmp_path: Path, viewport: str) -> None:
    """The write-up's second machine (two B70s as the pool, the A380, the iGPU) in the
    recorder's current.json layout: the pool's bars first, together and on the first screen,
    then the transcode card's, then the iGPU's; each bar as wide as the others, none wider
    than the screen."""
    from test_pool import A380, B70_A, B70_B, IGPU, SECOND_MACHINE
    from test_status_cards import pool_engine

    executable = chromium()
    engine = pool_engine(tmp_path, SECOND_MACHINE)
    await engine.watch.read(None)
    engine.alive = True
    http = TestClient(TestServer(build_app(engine, TOKEN)))
    await http.start_server()
    width, height = VIEWPORTS[viewport]
    try:
        async with playwright_api.async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=executable, args=["--no-sandbox"])
            try:
                context = await browser.new_context(
                    viewport={"width": width, "height": height},
                    is_mobile=viewport == "phone",
                    java_script_enabled=False,
                )
                page = await context.new_page()
                response = await page.goto(str(http.make_url("/")))
                assert response is not None and response.status == 200
                seen = await measure_bars(page)
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                await page.screenshot(
                    path=str(ARTIFACTS / f"status-pool-{viewport}.png"), full_page=True
                )
            finally:
                await browser.close()
    finally:
        await http.close()
    bars = seen["bars"]
    assert [(b["pdev"], b["job"]) for b in bars] == [
        (B70_A, "llm"),
        (B70_B, "llm"),
        (A380, "transcode"),
        (IGPU, "other"),
    ]
    assert [b["tenants"] for b in bars] == [
        ["vllm/vllm", "free"],
        ["vllm/vllm", "retrieval/ovms", "free"],
        ["plex/plex", "free"],
        [],  # the iGPU's size is unknown and its desktop holds no VRAM: an empty bar
    ]
    assert seen["scrollWidth"] <= seen["innerWidth"], seen
    for bar in bars:
        svg = bar["svg"]
        assert svg["height"] > 10 and svg["left"] >= 0 and svg["right"] <= seen["innerWidth"], bar
        assert abs(svg["width"] - bars[0]["svg"]["width"]) < 1, bars
    # stacked in the page's order, each bar above its own tenants
    tops = [b["svg"]["top"] for b in bars]
    assert tops == sorted(tops) and len(set(tops)) == 4
    for bar in bars:
        assert bar["svg"]["bottom"] <= bar["list"]["top"] + 1, bar
    # the headings: the pool's above its bars, the A380's between the pool and the iGPU
    headings = dict((text, top) for text, top in seen["headings"])
    assert list(headings) == ["LLM pool (TP=2)", "Transcode card", "Other card"]
    assert headings["LLM pool (TP=2)"] < tops[0]
    assert tops[1] < headings["Transcode card"] < tops[2] < headings["Other card"] < tops[3]
    # the pool's bars answer on the first screen
    assert bars[1]["svg"]["bottom"] <= seen["innerHeight"], bars[1]
