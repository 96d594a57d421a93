"""The status page in a real browser: headless Chromium (Debian's package, driven by
Playwright) loads the page the arbiter serves on the lab host, after test_site.py has run
swaps, jobs and a Plex transcode, with the history the lab host's recorder wrote (the card
under it is the lab's simulation, lab/SIMULATION.md).

It checks the DOM against the arbiter's own status and the recorder's history file, that
the console stays clean, that no request leaves the arbiter's origin, that the page
refreshes itself, and that it fits a phone's width. The first screen (390x844 and 1280x800)
answers without scrolling: the mode, the card's bar with its tenants and the data's age,
the alerts, the held requests and the queued jobs lie within the first viewport (by their
bounding boxes), and the swaps' full table stays folded behind its summary. Screenshots (the
first screen, and the whole page) are kept in .cache/artifacts/ (CI keeps that directory).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import requests
from playwright.sync_api import sync_playwright

HISTORY_DIR = "/var/lib/cardshare/recorder/history"
ARTIFACTS = Path(
    os.environ.get("CARDSHARE_ARTIFACTS", Path(__file__).parents[3] / ".cache/artifacts")
)
VIEWPORTS = {"desktop": (1280, 800), "phone": (390, 844)}
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
DAY_STEP, MONTH_STEP = 300, 3600


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Chromium is missing: tools/deps.sh installs Debian's chromium"
    return path


def expected_series(lines: list[str], last_scan: float, now: float) -> dict[str, dict[str, int]]:
    """Per chart, each client's count of buckets holding a VRAM figure, from the history
    lines up to the last scan the page read: what the page's charts must draw."""
    out: dict[str, dict[str, set[int]]] = {"vram-day": {}, "vram-month": {}}
    for line in lines:
        try:
            doc = json.loads(line)
            stamp = float(doc["timestamp_unix"])
            cards = doc["cards"]
        except (ValueError, KeyError, TypeError):
            continue
        if stamp > last_scan:
            continue
        for card in cards.values():
            for client in card.get("clients", []):
                if not isinstance(client.get("vram_bytes"), int):
                    continue
                for chart, step, span in (
                    ("vram-day", DAY_STEP, 86400),
                    ("vram-month", MONTH_STEP, 30 * 86400),
                ):
                    bucket = int(stamp // step) * step
                    if bucket >= now - span - step:
                        out[chart].setdefault(client["name"], set()).add(bucket)
    return {chart: {name: len(b) for name, b in names.items()} for chart, names in out.items()}


def read_history(host: Any) -> list[str]:
    names = sorted(n for n in host.file(HISTORY_DIR).listdir() if n.endswith(".jsonl"))
    assert names, f"the recorder wrote no history under {HISTORY_DIR}"
    return [
        line for n in names for line in host.file(f"{HISTORY_DIR}/{n}").content_string.splitlines()
    ]


def inspect_page(page: Any) -> dict[str, Any]:
    return page.evaluate(
        """(answers) => {
          const boxes = {};
          for (const [name, sel] of Object.entries(answers)) {
            const e = document.querySelector(sel);
            const r = e ? e.getBoundingClientRect() : null;
            boxes[name] = r && {top: r.top, bottom: r.bottom, left: r.left, right: r.right,
                                visible: r.width > 0 && r.height > 0};
          }
          const fold = document.querySelector('details#swaps-all');
          const one = (sel, attr) => {
            const e = document.querySelector(sel); return e ? e.getAttribute(attr) : null;
          };
          const series = {};
          document.querySelectorAll('figure[data-chart]').forEach(f => {
            series[f.dataset.chart] = {};
            f.querySelectorAll('svg g[data-series]').forEach(g => {
              series[f.dataset.chart][g.dataset.series] = Number(g.dataset.points);
            });
          });
          return {
            mode: one('[data-mode]', 'data-mode'),
            scans: Number(one('[data-scans]', 'data-scans')),
            lastScan: Number(one('[data-last-scan]', 'data-last-scan')),
            generated: Number(one('#generated', 'data-generated')),
            tenants: [...document.querySelectorAll('figure[data-chart=tenants] li[data-tenant]')]
              .map(r => r.dataset.tenant),
            pending: [...document.querySelectorAll('figure[data-chart=tenants] li[data-pending]')]
              .map(r => r.dataset.tenant),
            boxes: boxes,
            scrollY: window.scrollY,
            innerHeight: window.innerHeight,
            foldOpen: fold ? fold.open : null,
            swapRows: document.querySelectorAll('tr[data-swap]').length,
            swapRowsShown: [...document.querySelectorAll('tr[data-swap]')]
              .filter(r => r.checkVisibility()).length,
            lastSwap: one('[data-last-swap]', 'data-last-swap'),
            swapsToday: one('[data-swaps-today]', 'data-swaps-today'),
            bar: [...document.querySelectorAll('figure[data-chart=tenants] rect[data-tenant]')]
              .map(r => r.dataset.tenant),
            series: series,
            svgLabelled: [...document.querySelectorAll('figure[data-chart] > svg')].every(
              s => s.getAttribute('role') === 'img' && s.querySelector('title')
                && s.querySelector('desc')),
            tables: document.querySelectorAll('figure[data-chart] table').length,
            scrollWidth: document.documentElement.scrollWidth,
            innerWidth: window.innerWidth,
          };
        }""",
        ANSWERS,
    )


@pytest.fixture(scope="module")
def browser() -> Any:
    with sync_playwright() as pw:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        launched = pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.mark.parametrize("viewport", sorted(VIEWPORTS))
def test_the_status_page_in_chromium(browser: Any, host: Any, arbiter: str, viewport: str) -> None:
    width, height = VIEWPORTS[viewport]
    context = browser.new_context(
        viewport={"width": width, "height": height}, is_mobile=viewport == "phone"
    )
    page = context.new_page()
    problems: list[str] = []
    urls: list[str] = []
    page.on(
        "console",
        lambda m: (
            problems.append(f"console {m.type}: {m.text}")
            if m.type in ("error", "warning")
            else None
        ),
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("request", lambda r: urls.append(r.url))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} {r.failure}"))
    try:
        status = requests.get(f"{arbiter}/v1/overview", timeout=10).json()
        response = page.goto(f"{arbiter}/", wait_until="networkidle")
        assert response is not None and response.status == 200
        assert "default-src 'none'" in response.headers["content-security-policy"]
        seen = inspect_page(page)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"status-first-{viewport}.png"))
        history = read_history(host)

        # the first screen answers without scrolling, and nothing scrolls sideways
        assert seen["scrollY"] == 0
        for name, box in seen["boxes"].items():
            assert box is not None and box["visible"], (name, box)
            assert box["top"] >= 0 and box["bottom"] <= seen["innerHeight"], (name, box, seen)
            assert box["left"] >= 0 and box["right"] <= seen["innerWidth"], (name, box, seen)
        assert seen["scrollWidth"] <= seen["innerWidth"], seen
        # the swaps (test_site.py made some): the last one and today's numbers, the rest folded
        assert seen["lastSwap"] == str(status["swaps"][0]["id"]), (seen, status["swaps"][:1])
        assert int(seen["swapsToday"]) >= 1, seen
        assert seen["foldOpen"] is False and seen["swapRows"] == len(status["swaps"]), seen
        assert seen["swapRowsShown"] == 0, seen

        # the mode and the card's tenants as the arbiter reports them; an owner the arbiter
        # started after the last scan is shown by its own name, marked, in place of the
        # scan's figure for it
        assert seen["mode"] == status["mode"], (seen["mode"], status["mode"])
        started = {n for c in status["since_scan"] if c["event"] == "started" for n in c["names"]}
        names = {t["name"] for t in status["tenants"]} - started
        assert set(seen["tenants"]) >= names, (seen, status["tenants"], status["since_scan"])
        assert set(seen["pending"]) <= started | names, (seen, status["since_scan"])
        held = {t["name"] for t in status["tenants"] if t["vram_bytes"] > 0} - started
        assert held <= set(seen["bar"]), (seen["bar"], status["tenants"])
        # the charts: every client of the recorder's history, bucket for bucket
        assert seen["scans"] >= 3, (
            f"the recorder's history the page read is short: {seen['scans']} scans"
        )
        expected = expected_series(history, seen["lastScan"], seen["generated"])
        for chart in ("vram-day", "vram-month"):
            assert expected[chart], f"no VRAM in the recorder's history for {chart}"
            assert seen["series"][chart] == expected[chart], (
                chart,
                seen["series"][chart],
                expected[chart],
            )
        assert set(seen["series"]["busy-day"]) == {"render", "video"}
        assert "hours" in seen["series"]["transcode-days"]
        assert {"swaps", "jobs"} <= set(seen["series"]["swaps-jobs-days"])
        # accessible: each chart an image with a title and a description, and its numbers as a table
        assert seen["svgLabelled"] and seen["tables"] >= len(seen["series"]) - 1

        # live: the page fetches its main part again by itself and says so
        # (polled from here: the page's CSP refuses the eval a wait_for_function would need)
        deadline = time.monotonic() + 20
        while not page.text_content("#live").startswith("Updated"):
            assert time.monotonic() < deadline, f"no refresh: {page.text_content('#live')!r}"
            page.wait_for_timeout(500)
        again = inspect_page(page)
        assert again["generated"] > seen["generated"]
        # a phone's width: no sideways scrolling
        assert again["scrollWidth"] <= again["innerWidth"], again

        shot = ARTIFACTS / f"status-page-{viewport}.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
    finally:
        context.close()
    origin = urlparse(arbiter).netloc
    away = [u for u in urls if urlparse(u).scheme != "data" and urlparse(u).netloc != origin]
    assert not away, f"requests left the box: {away}"
    assert {urlparse(u).path for u in urls} >= {
        "/",
        "/static/status.css",
        "/static/status.js",
        "/status/main",
    }
    assert not problems, problems
