"""The status page: the recorder's history read incrementally into a day and a month, the
page and its JSON served by the arbiter's app, nothing on them that the token guards.

History lines here follow the recorder's documented snapshot (``cardshare.recorder``);
the lab's site scenario checks the page against a real recorder's history in Chromium."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, ClassVar

import pytest
from aiohttp.test_utils import TestClient, TestServer
from arbiter_fakes import WORKFLOW, FakeClock, World, make_engine, run_until

from cardshare.arbiter.api import PAGE_HEADERS, build_app
from cardshare.arbiter.cardview import CardClient
from cardshare.arbiter.history import DAY_STEP, HistoryView
from cardshare.arbiter.states import Phase
from cardshare.arbiter.statuspage import render_page

TOKEN = "s3cret-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NOW = 1_796_126_400.0  # 2026-12-01 12:00:00 UTC
GIB = 1024**3


def snapshot(stamp: float, clients: list[dict[str, Any]], interval: float | None = 60.0) -> str:
    return json.dumps(
        {
            "schema": 1,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp)),
            "timestamp_unix": stamp,
            "interval_seconds": interval,
            "host": "box",
            "cards": {
                "0000:03:00.0": {
                    "driver": "xe",
                    "vram_total_bytes": 16 * GIB,
                    "clients": clients,
                }
            },
        }
    )


def client(name: str, vram: int, **engines: float) -> dict[str, Any]:
    return {"name": name, "vram_bytes": vram, "engines": engines, "pids": [1]}


def month_file(root: Path, stamp: float, gz: bool = False) -> Path:
    return root / (time.strftime("%Y-%m", time.gmtime(stamp)) + (".jsonl.gz" if gz else ".jsonl"))


def append(root: Path, *lines: str) -> None:
    for line in lines:
        stamp = json.loads(line)["timestamp_unix"]
        with open(month_file(root, stamp), "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(NOW)


@pytest.fixture
def history(tmp_path: Path, clock: FakeClock) -> HistoryView:
    root = tmp_path / "history"
    root.mkdir()
    return HistoryView(root, ("plex/plex",), clock.now)


# --- the history -------------------------------------------------------------------------------


def test_peaks_busy_shares_and_transcode_hours(history: HistoryView) -> None:
    root = history.history_dir
    t0 = NOW - 600  # two 5-minute buckets: NOW-600 and NOW-300
    append(
        root,
        snapshot(t0, [client("vllm/vllm", 10 * GIB, ccs=0.5), client("plex/plex", GIB, vcs=0.2)]),
        snapshot(t0 + 60, [client("vllm/vllm", 12 * GIB, ccs=1.0)]),
        snapshot(t0 + 120, [client("vllm/vllm", 11 * GIB), client("plex/plex", GIB, vcs=0.0)]),
        snapshot(t0 + 300, [client("comfyui/comfyui", 14 * GIB, rcs=0.25, bcs=1.0)]),
    )
    history.refresh()
    doc = history.doc()
    assert doc["error"] is None and doc["scans"] == 4
    day = doc["day"]
    assert day["vram_bytes"]["vllm/vllm"] == [[t0, 12 * GIB]]
    assert day["vram_bytes"]["comfyui/comfyui"] == [[t0 + 300, 14 * GIB]]
    assert day["vram_bytes"]["plex/plex"] == [[t0, GIB]]
    # render: (0.5 + 1.0 + 0) / 3 scans of 60 s; the copy engine (bcs) is in no group
    assert day["busy_share"]["render"] == [[t0, 0.5], [t0 + 300, 0.25]]
    assert day["busy_share"]["video"] == [[t0, round(0.2 / 3, 4)], [t0 + 300, 0.0]]
    # the hourly bucket holds all four scans
    month = doc["month"]
    assert month["vram_bytes"]["comfyui/comfyui"] == [[int(t0 // 3600) * 3600, 14 * GIB]]
    today = time.strftime("%Y-%m-%d", time.gmtime(NOW))
    hours = dict(doc["transcode_hours_per_day"])
    assert len(hours) == 30 and hours[today] == round(60 / 3600, 3)
    assert sum(hours.values()) == hours[today]


def test_with_its_card_named_another_cards_clients_are_not_charted(
    tmp_path: Path, clock: FakeClock
) -> None:
    """An iGPU's busy desktop and a transcode there, beside the Arc card's vLLM."""
    root = tmp_path / "history"
    root.mkdir()
    line = json.loads(snapshot(NOW - 600, [client("vllm/vllm", 10 * GIB, ccs=0.5)]))
    line["cards"]["0000:00:02.0"] = {
        "driver": "i915",
        "vram_total_bytes": None,
        "clients": [client("gnome-shell", 0, rcs=0.5), client("plex/plex", 0, vcs=1.0)],
    }
    append(root, json.dumps(line))
    charts = {}
    for pdev in (None, "0000:03:00.0"):
        view = HistoryView(root, ("plex/plex",), clock.now, pdev=pdev)
        view.refresh()
        charts[pdev] = view.doc()
    every, arc = charts[None], charts["0000:03:00.0"]
    assert every["day"]["busy_share"]["render"] == [[NOW - 600, 1.0]]
    assert sorted(every["day"]["vram_bytes"]) == ["gnome-shell", "plex/plex", "vllm/vllm"]
    assert arc["day"]["busy_share"] == {"render": [[NOW - 600, 0.5]], "video": [[NOW - 600, 0.0]]}
    assert sorted(arc["day"]["vram_bytes"]) == ["vllm/vllm"]
    assert sum(dict(arc["transcode_hours_per_day"]).values()) == 0
    assert sum(dict(every["transcode_hours_per_day"]).values()) > 0


def test_reads_only_what_was_appended_and_waits_for_a_whole_line(history: HistoryView) -> None:
    root = history.history_dir
    append(root, snapshot(NOW - 120, [client("vllm/vllm", GIB)]))
    history.refresh()
    assert history.scans == 1
    line = snapshot(NOW - 60, [client("vllm/vllm", 2 * GIB)])
    path = month_file(root, NOW)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line[:40])  # a scan still writing its line
    history.refresh()
    assert history.scans == 1 and history.skipped == 0
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line[40:] + "\n")
    history.refresh()
    assert history.scans == 2
    history.refresh()  # nothing new: nothing counted twice
    assert history.scans == 2
    assert history.doc()["day"]["vram_bytes"]["vllm/vllm"][-1][1] == 2 * GIB


def test_a_closed_month_read_from_its_archive_counts_each_scan_once(
    history: HistoryView, clock: FakeClock
) -> None:
    root = history.history_dir
    last_month = NOW - 5 * 86400 - 20 * 86400  # in November
    lines = [snapshot(last_month + 60 * i, [client("plex/plex", GIB, vcs=0.5)]) for i in range(3)]
    append(root, *lines)
    history.refresh()
    before = history.doc()
    assert before["scans"] == 3
    # the recorder closes the month: archive written, then the plain file removed
    plain = month_file(root, last_month)
    with gzip.open(month_file(root, last_month, gz=True), "wb") as packed:
        packed.write(plain.read_bytes())
    history.refresh()  # a scan died between the two: both exist, each line counts once
    assert history.doc() == before
    plain.unlink()
    history.refresh()
    assert history.doc() == before
    # and a line appended to the plain file after the close is read beside the archive
    append(root, snapshot(last_month + 600, [client("plex/plex", GIB, vcs=0.5)]))
    history.refresh()
    assert history.scans == 4


def test_old_scans_leave_the_charts_and_garbage_is_counted(history: HistoryView) -> None:
    root = history.history_dir
    append(
        root,
        snapshot(NOW - 40 * 86400, [client("old/one", GIB)]),
        snapshot(NOW - 2 * 86400, [client("week/one", GIB)]),
        snapshot(NOW - 60, [client("vllm/vllm", GIB)]),
    )
    with open(month_file(root, NOW), "a", encoding="utf-8") as fh:
        fh.write('{"not": "a snapshot"}\nnot json\n')
    history.refresh()
    doc = history.doc()
    assert set(doc["day"]["vram_bytes"]) == {"vllm/vllm"}
    assert set(doc["month"]["vram_bytes"]) == {"week/one", "vllm/vllm"}
    assert doc["skipped_lines"] == 2


def test_a_missing_directory_is_an_error_not_an_exception(tmp_path: Path, clock: FakeClock) -> None:
    view = HistoryView(tmp_path / "nowhere", (), clock.now)
    view.refresh()
    doc = view.doc()
    assert "cannot list" in doc["error"] and str(tmp_path / "nowhere") in doc["error"]
    assert doc["scans"] == 0 and doc["day"]["vram_bytes"] == {}


def test_a_replaced_file_is_read_again_from_the_start(history: HistoryView) -> None:
    root = history.history_dir
    append(root, *(snapshot(NOW - 60 * i, [client("a/a", GIB)]) for i in (3, 2, 1)))
    history.refresh()
    path = month_file(root, NOW)
    path.unlink()  # restored from a backup with one line
    append(root, snapshot(NOW - 30, [client("b/b", GIB)]))
    history.refresh()
    doc = history.doc()
    assert doc["scans"] == 1 and set(doc["day"]["vram_bytes"]) == {"b/b"}


# --- the page ----------------------------------------------------------------------------------


class _Balance(HTMLParser):
    VOID: ClassVar[set[str]] = {
        "meta",
        "link",
        "br",
        "img",
        "input",
        "hr",
        "rect",
        "circle",
        "line",
        "polyline",
    }

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        pass

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def balanced(text: str) -> None:
    parser = _Balance()
    parser.feed(text)
    assert not parser.errors and not parser.stack, (parser.errors, parser.stack)


async def serve(tmp_path: Path, world: World) -> tuple[TestClient, Any]:
    engine = make_engine(
        tmp_path,
        world,
        history_dir=tmp_path / "history",
        transcode_client_names=("plex/plex",),
        card_vram_bytes=64 * GIB,
    )
    client_ = TestClient(TestServer(build_app(engine, TOKEN)))
    await client_.start_server()
    return client_, engine


async def test_the_page_shows_the_box_and_hides_what_the_token_guards(tmp_path: Path) -> None:
    world = World(clock=FakeClock(NOW))
    world.others = [CardClient("plex/plex", GIB, ("vcs",))]
    (tmp_path / "history").mkdir()
    append(
        tmp_path / "history",
        snapshot(
            NOW - 120, [client("vllm/vllm", 12 * GIB, ccs=0.5), client("plex/plex", GIB, vcs=1.0)]
        ),
        snapshot(NOW - 60, [client("vllm/vllm", 12 * GIB, ccs=0.1)]),
    )
    http, engine = await serve(tmp_path, world)
    try:
        await engine.step()
        submitted = await http.post("/v1/jobs", json={"workflow": WORKFLOW}, headers=AUTH)
        assert submitted.status == 201
        job_id = (await submitted.json())["id"]
        page = await http.get("/")
        assert page.status == 200 and page.content_type == "text/html"
        for header, value in PAGE_HEADERS.items():
            assert page.headers[header] == value
        text = await page.text()
        balanced(text)
        assert 'data-mode="llm"' in text and 'data-queue="1"' in text
        assert 'data-tenant="vllm/vllm"' in text and 'data-tenant="plex/plex"' in text
        assert 'data-tenant="free"' in text
        assert 'data-series="vllm/vllm" data-points="1"' in text  # one 5-minute bucket
        assert 'data-scans="2"' in text
        main = await http.get("/status/main")
        main_text = await main.text()
        balanced(main_text)
        assert 'data-chart="vram-day"' in main_text and "<html" not in main_text
        overview = await (await http.get("/v1/overview")).json()
        assert overview["mode"] == "llm" and overview["queue_length"] == 1
        assert overview["card_total_bytes"] == 64 * GIB
        assert overview["history"]["scans"] == 2
        assert overview["daily"][time.strftime("%Y-%m-%d", time.gmtime(NOW))]["jobs"] == 1
        for body in (text, main_text, json.dumps(overview)):
            assert job_id not in body
        # with the token, /v1/status does name the job: the page's data is the open one
        st = await (await http.get("/v1/status", headers=AUTH)).json()
        assert "current_job" in st
        assert job_id in json.dumps(
            await (await http.get(f"/v1/jobs/{job_id}", headers=AUTH)).json()
        )
    finally:
        await http.close()


async def test_the_assets_are_served_from_the_package_and_nothing_else(tmp_path: Path) -> None:
    http, _ = await serve(tmp_path, World(clock=FakeClock(NOW)))
    try:
        js = await http.get("/static/status.js")
        assert js.status == 200 and js.content_type == "text/javascript"
        assert "/status/main" in await js.text()
        css = await http.get("/static/status.css")
        assert css.status == 200 and css.content_type == "text/css"
        for name in ("../api.py", "status.py", "%2e%2e%2fapi.py"):
            assert (await http.get(f"/static/{name}")).status == 404
    finally:
        await http.close()


async def test_without_history_the_page_says_why(tmp_path: Path) -> None:
    world = World(clock=FakeClock(NOW))
    engine = make_engine(tmp_path, world)
    http = TestClient(TestServer(build_app(engine, TOKEN)))
    await http.start_server()
    try:
        await engine.step()
        text = await (await http.get("/")).text()
        assert "arbiter_recorder_data_dir" in text
        balanced(text)
        assert (await (await http.get("/v1/overview")).json())["history"] is None
    finally:
        await http.close()


async def test_the_history_is_read_again_only_after_the_refresh_period(tmp_path: Path) -> None:
    world = World(clock=FakeClock(NOW))
    (tmp_path / "history").mkdir()
    append(tmp_path / "history", snapshot(NOW - 60, [client("a/a", GIB)]))
    http, _ = await serve(tmp_path, world)
    try:
        assert (await (await http.get("/v1/overview")).json())["history"]["scans"] == 1
        append(tmp_path / "history", snapshot(NOW - 30, [client("a/a", GIB)]))
        assert (await (await http.get("/v1/overview")).json())["history"]["scans"] == 1
        world.clock.t += 15
        assert (await (await http.get("/v1/overview")).json())["history"]["scans"] == 2
    finally:
        await http.close()


def test_the_page_escapes_names_and_draws_a_lone_point(tmp_path: Path) -> None:
    hostile = '<script>alert("x")</script>'
    doc: dict[str, Any] = {
        "generated": NOW,
        "mode": "llm",
        "since": NOW - 10,
        "phase": "llm",
        "phase_since": NOW - 10,
        "queue_length": 0,
        "job_running": False,
        "engine": {"healthy": True, "health": "ok", "heartbeat_age_seconds": 1.0},
        "hold": None,
        "decision": {"go": False, "reasons": [hostile]},
        "swaps": [],
        "card": {"scanned_at": NOW - 30, "age_seconds": 30.0, "clients": []},
        "card_total_bytes": None,
        "llm_plan": {"service": "vllm", "max_model_len": 65536, "degraded": False},
        "tenants": [{"name": hostile, "kind": "foreign", "vram_bytes": GIB}],
        "alerts": [{"name": "card_data_stale", "message": hostile}],
        "history": {
            "error": None,
            "scans": 1,
            "skipped_lines": 0,
            "last_scan": NOW - 60,
            "transcode_clients": [],
            "day": {
                "step_seconds": DAY_STEP,
                "start": NOW - 86400,
                "end": NOW,
                "vram_bytes": {hostile: [[NOW - 300, GIB]]},
                "busy_share": {"render": [], "video": []},
            },
            "month": {
                "step_seconds": 3600,
                "start": NOW - 30 * 86400,
                "end": NOW,
                "vram_bytes": {},
                "busy_share": {"render": [], "video": []},
            },
            "transcode_hours_per_day": [["2026-12-01", 0.0]],
        },
        "daily": {},
    }
    text = render_page(doc, "cardshare: box")
    balanced(text)
    assert hostile not in text and "&lt;script&gt;" in text
    assert "<circle" in text  # one bucket: a point, not an empty line
    assert "no history in this period yet" in text  # the empty month chart says so


def test_daily_counts(tmp_path: Path) -> None:
    world = World(clock=FakeClock(NOW))
    engine = make_engine(tmp_path, world)
    store = engine.store
    store.add_job("j1", WORKFLOW, (), NOW - 86400)
    store.add_job("j2", WORKFLOW, (), NOW)
    assert store.daily_counts(NOW - 2 * 86400) == {
        "2026-11-30": {"swaps": 0, "swaps_failed": 0, "jobs": 1, "jobs_done": 0, "jobs_failed": 0},
        "2026-12-01": {"swaps": 0, "swaps_failed": 0, "jobs": 1, "jobs_done": 0, "jobs_failed": 0},
    }
    assert store.daily_counts(NOW - 60) == {
        "2026-12-01": {"swaps": 0, "swaps_failed": 0, "jobs": 1, "jobs_done": 0, "jobs_failed": 0}
    }


async def test_swaps_appear_per_day_and_on_the_page(tmp_path: Path) -> None:
    world = World(clock=FakeClock(NOW))
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    engine.store.add_job("j1", WORKFLOW, (), NOW)
    await run_until(engine, lambda e: e.store.swaps(1) and e.store.swaps(1)[0].finished)
    counts = engine.store.daily_counts(NOW - 86400)
    assert sum(d["swaps"] for d in counts.values()) >= 1
    http = TestClient(TestServer(build_app(engine, TOKEN)))
    await http.start_server()
    try:
        text = await (await http.get("/status/main")).text()
        swap = engine.store.swaps(1)[0]
        assert f'data-swap="{swap.id}"' in text and f"<td>{swap.direction}</td>" in text
    finally:
        await http.close()


def test_the_static_files_are_package_data() -> None:
    import cardshare.arbiter

    static = Path(cardshare.arbiter.__file__).parent / "static"
    assert sorted(os.listdir(static)) == ["status.css", "status.js"]
    pyproject = (Path(__file__).parents[3] / "pyproject.toml").read_text()
    assert '"cardshare.arbiter" = ["static/*"]' in pyproject


@pytest.mark.parametrize(
    ("raw", "fix"),
    [
        ({"history_dir": "relative/history"}, "absolute"),
        ({"history_dir": 7}, "absolute"),
        ({"transcode_client_names": "plex/plex"}, "list of non-empty strings"),
    ],
)
def test_bad_status_page_settings_are_refused_by_name(
    tmp_path: Path, raw: dict[str, Any], fix: str
) -> None:
    from cardshare.arbiter.config import ConfigError, parse_config

    base = {
        "data_dir": str(tmp_path),
        "vllm_url": "http://127.0.0.1:8000",
        "served_model_name": "m",
        "comfyui_url": "http://127.0.0.1:8188",
        "card_current_json": str(tmp_path / "current.json"),
        "token_file": str(tmp_path / "token"),
    }
    assert parse_config({**base, "history_dir": "/srv/h"}).history_dir == Path("/srv/h")
    with pytest.raises(ConfigError) as err:
        parse_config({**base, **raw})
    key = next(iter(raw))
    assert key in str(err.value) and repr(raw[key]) in str(err.value) and fix in str(err.value)


# --- the first screen: who is on the card now, how old that is; the swaps folded --------------


def page_doc(**over: Any) -> dict[str, Any]:
    """An overview as StatusData.overview writes it (the keys the page reads)."""
    doc: dict[str, Any] = {
        "generated": NOW,
        "mode": "llm",
        "since": NOW - 40,
        "phase": "serve_llm",
        "phase_since": NOW - 40,
        "queue_length": 0,
        "job_running": False,
        "engine": {"healthy": True, "health": "ok", "heartbeat_age_seconds": 1.0},
        "hold": None,
        "decision": {"go": False, "reasons": ["no image job queued"]},
        "swaps": [],
        "card": {"scanned_at": NOW - 90, "age_seconds": 90.0, "clients": []},
        "card_total_bytes": 32 * GIB,
        "card_data_max_age_seconds": 120.0,
        "since_scan": [],
        "proxy": {"at": NOW - 1, "held": 0, "in_flight": 0, "oldest_held_seconds": None},
        "swaps_today": {"since": NOW - NOW % 86400, "took_seconds": []},
        "llm_plan": {"service": "vllm", "max_model_len": 65536, "degraded": False},
        "tenants": [{"name": "retrieval/ovms", "kind": "resident", "vram_bytes": 2 * GIB}],
        "alerts": [],
        "history": None,
        "daily": {},
    }
    doc.update(over)
    return doc


def tenant_items(text: str) -> dict[str, str]:
    """The card's tenant list as text, by data-tenant."""

    class Items(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.items: dict[str, str] = {}
            self.current: str | None = None
            self.depth = 0

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag == "li" and dict(attrs).get("data-tenant"):
                self.current = dict(attrs)["data-tenant"]
                self.items[self.current or ""] = ""

        def handle_endtag(self, tag: str) -> None:
            if tag == "li":
                self.current = None

        def handle_data(self, data: str) -> None:
            if self.current is not None:
                self.items[self.current] += data

    parser = Items()
    parser.feed(text)
    return {k: " ".join(v.split()) for k, v in parser.items.items()}


def test_vllm_started_after_the_scan_is_shown_starting_not_as_free_memory() -> None:
    """The issue's case: back in llm, the last scan was taken before vLLM started (it shows
    the retrieval tier only, and a vLLM of before the swap is stale)."""
    plan = int(14.2 * GIB)
    doc = page_doc(
        tenants=[
            {"name": "retrieval/ovms", "kind": "resident", "vram_bytes": 2 * GIB},
            {"name": "vllm/vllm", "kind": "owner", "vram_bytes": 10 * GIB},
        ],
        since_scan=[
            {
                "role": "llm",
                "name": "vllm/vllm",
                "names": ["vllm/vllm"],
                "event": "started",
                "at": NOW - 12,
                "plan_bytes": plan,
            }
        ],
    )
    text = render_page(doc, "cardshare: box")
    balanced(text)
    items = tenant_items(text)
    assert items["vllm/vllm"] == (
        "vllm/vllm owner started 12 s ago, not yet measured (plan 14.2 GiB)"
    ), items
    assert items["free"] == f"free {(32 * GIB - 2 * GIB - plan) / GIB:.1f} GiB", items
    assert items["retrieval/ovms"] == "retrieval/ovms resident 2.0 GiB"
    # the bar: the plan's share, striped (not measured), and never the stale 10 GiB
    assert text.count('rect data-tenant="vllm/vllm"') == 1
    assert 'fill="url(#stripe-0)"' in text and "10.0 GiB" not in text
    # the card data's age beside the bar
    assert 'data-card-age="90"' in text and "scanned 11:58:30 UTC, 90 s ago" in text
    assert text.index("data-card-age") < text.index('data-chart="tenants"')


def test_without_the_plans_size_the_free_memory_is_said_to_be_the_scans() -> None:
    change = {"role": "image", "name": "comfyui/comfyui", "names": ["comfyui/comfyui"]}
    doc = page_doc(
        mode="image",
        since_scan=[{**change, "event": "started", "at": NOW - 5, "plan_bytes": None}],
    )
    items = tenant_items(render_page(doc, "t"))
    assert items["comfyui/comfyui"] == "comfyui/comfyui owner started 5 s ago, not yet measured"
    assert items["free"] == "free at the scan 30.0 GiB"


def test_an_owner_stopped_after_the_scan_is_marked_as_leaving() -> None:
    doc = page_doc(
        mode="swapping",
        phase="wait_image_release",
        tenants=[{"name": "comfyui/comfyui", "kind": "owner", "vram_bytes": 12 * GIB}],
        since_scan=[
            {
                "role": "image",
                "name": "comfyui/comfyui",
                "names": ["comfyui/comfyui"],
                "event": "stopped",
                "at": NOW - 3,
                "plan_bytes": None,
            }
        ],
    )
    text = render_page(doc, "t")
    items = tenant_items(text)
    assert items["comfyui/comfyui"] == (
        "comfyui/comfyui owner 12.0 GiB stopped 3 s ago, after this scan"
    )
    assert "now wait_image_release" in text  # a swap names its phase beside the mode


def test_old_card_data_is_flagged_and_nothing_measured_is_marked_without_changes() -> None:
    text = render_page(page_doc(card={"scanned_at": NOW - 600, "clients": []}), "t")
    assert 'class="scan old" data-card-age="600"' in text and "10 min ago" in text
    assert "(older than the 120 s the arbiter weighs a swap on: it scans again before one)" in text
    assert "stripe" not in text and "not yet measured" not in text


def swap(sid: int, started: float, took: float | None, direction: str) -> dict[str, Any]:
    phases = (
        ["stop_image", "wait_image_release", "start_llm", "wait_llm_ready"]
        if direction == "to_llm"
        else ["stop_llm", "wait_llm_release", "start_image", "wait_image_ready"]
    )
    return {
        "id": sid,
        "direction": direction,
        "started": started,
        "finished": None if took is None else started + took,
        "ok": None if took is None else True,
        "total_seconds": took,
        "phases": [
            {"phase": p, "seconds": (took or 4.0) / 4, "waited_seconds": 0.0, "outcome": "ok"}
            for p in phases
        ],
    }


def test_the_swaps_fold_into_the_last_one_and_todays_count_and_median() -> None:
    today = time.strftime("%Y-%m-%d", time.gmtime(NOW))
    swaps = [
        swap(7, NOW - 300, 41.2, "to_llm"),
        swap(6, NOW - 900, 20.0, "to_image"),
        swap(5, NOW - 4000, 90.0, "to_llm"),
        swap(4, NOW - 90000, 10.0, "to_image"),  # yesterday: listed, not in today's numbers
    ]
    doc = page_doc(
        swaps=swaps,
        swaps_today={"since": NOW - NOW % 86400, "took_seconds": [90.0, 20.0, 41.2]},
        daily={today: {"swaps": 3}},
    )
    text = render_page(doc, "t")
    balanced(text)
    assert 'data-swaps-today="3" data-swaps-median="41.2"' in text
    assert "3 swaps today (UTC), median took 41.2 s." in text
    assert (
        '<p data-last-swap="7">The last: <strong>to_llm</strong>, ok, started '
        "11:55:00 UTC, 5 min ago, took 41.2 s.</p>"
    ) in text
    assert '<ol class="phases" aria-label="Its phases"><li>stop_image 10.3 s</li>' in text
    # the full table only inside the fold, after the summary
    fold = text.index('<details id="swaps-all">')
    assert text.index("data-swaps-today") < fold
    assert all(text.index(f'data-swap="{s["id"]}"') > fold for s in swaps)
    assert "<summary>The last 4 swaps, each phase</summary>" in text


def test_a_running_swap_and_a_day_without_a_finished_one() -> None:
    today = time.strftime("%Y-%m-%d", time.gmtime(NOW))
    doc = page_doc(swaps=[swap(1, NOW - 20, None, "to_image")], daily={today: {"swaps": 1}})
    text = render_page(doc, "t")
    assert "1 swap today (UTC), none finished yet." in text
    assert '<p data-last-swap="1">The last: <strong>to_image</strong>, running,' in text
    quiet = render_page(page_doc(), "t")
    assert "No swap yet." in quiet and "swaps-all" not in quiet


@pytest.mark.parametrize(
    ("proxy", "shown"),
    [
        (None, '<span data-held="none">no proxy configured</span>'),
        ({"held": 3, "oldest_held_seconds": 14.0}, '<span data-held="3">3, the oldest for 14 s'),
        ({"held": None, "error": "GET /proxy/state answered 500"}, 'data-held="unknown">unknown'),
    ],
)
def test_held_requests_and_the_queue_are_on_the_first_screen(
    proxy: dict[str, Any] | None, shown: str
) -> None:
    text = render_page(page_doc(proxy=proxy, queue_length=2, job_running=True), "t")
    assert shown in text
    assert '<span data-queue="2">2</span>, one running' in text
    first = text[text.index('<div class="first">') : text.index('aria-labelledby="swaps-h"')]
    for mark in ("data-mode=", "data-held=", "data-queue=", 'data-chart="tenants"', "data-alerts"):
        assert mark in first, mark


async def test_the_overview_marks_vllm_started_after_the_last_scan(tmp_path: Path) -> None:
    """A swap back to llm through the engine: the last scan (the arbiter's own, while it
    waited for ComfyUI's memory to leave) is older than vLLM's start; a new scan clears it."""
    world = World(clock=FakeClock(NOW))
    world.others = [CardClient("retrieval/ovms", 2 * GIB, ())]
    world.card_total = 32 * GIB
    engine = make_engine(
        tmp_path, world, idle_seconds=1.0, resident_client_names=("retrieval/ovms",)
    )
    engine.card.recorder_every = None  # type: ignore[attr-defined]  # no recorder timer
    engine.store.add_job("j1", WORKFLOW, (), NOW)
    await run_until(
        engine,
        lambda e: (
            e.store.swaps(1)
            and e.store.swaps(1)[0].direction == "to_llm"
            and e.store.swaps(1)[0].finished
        ),
    )
    world.proxy = {"in_flight": 1, "held": 2, "oldest_held_seconds": 3.5}
    await engine.step()  # serving: the idle status read of the card finds the old scan
    http = TestClient(TestServer(build_app(engine, TOKEN)))
    await http.start_server()
    try:
        overview = await (await http.get("/v1/overview")).json()
        scanned = overview["card"]["scanned_at"]
        started = engine.store.last_move([(Phase.START_LLM, Phase.WAIT_LLM_READY)])
        assert started is not None and started > scanned
        assert overview["since_scan"] == [
            {
                "role": "llm",
                "name": "vllm/vllm",
                "names": ["vllm/vllm"],
                "event": "started",
                "at": started,
                "plan_bytes": None,
            }
        ]
        assert "vllm/vllm" not in {t["name"] for t in overview["tenants"]}
        assert overview["proxy"]["held"] == 2
        assert overview["swaps_today"]["took_seconds"] == [
            s.total_seconds for s in reversed(engine.store.swaps(10))
        ]
        text = await (await http.get("/")).text()
        assert "started" in tenant_items(text)["vllm/vllm"]
        assert tenant_items(text)["free"].startswith("free at the scan")
        # a scan after the start measures vLLM: no mark any more
        await engine.watch.read(NOW + 10**6)
        overview = await (await http.get("/v1/overview")).json()
        assert overview["since_scan"] == []
        assert "vllm/vllm" in {t["name"] for t in overview["tenants"]}
    finally:
        await http.close()


class _HangingProxy:
    async def state(self) -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_the_pages_look_at_the_proxy_is_bounded_and_garbage_is_named(
    tmp_path: Path,
) -> None:
    world = World(clock=FakeClock(NOW))
    engine = make_engine(tmp_path, world)
    engine.proxy = _HangingProxy()
    doc = await engine.proxy_doc(max_age=4.0, timeout=0.05)
    assert doc is not None and doc["held"] is None
    assert doc["error"] == "the proxy did not answer within 0.05 s"
    world.clock.t += 5
    engine.proxy = make_engine(tmp_path / "b", world).proxy
    world.proxy = {"in_flight": 0, "held": "many"}
    doc = await engine.proxy_doc(max_age=4.0, timeout=1.0)
    assert doc is not None and doc["held"] is None and "held is 'many'" in doc["error"]
    # within max_age the engine's own last look is used, not a new request
    world.proxy = {"in_flight": 0, "held": 1}
    again = await engine.proxy_doc(max_age=4.0, timeout=1.0)
    assert again == doc


def test_a_long_alert_folds_after_its_first_words_and_keeps_its_whole_message() -> None:
    long = "vLLM not ready within 600 s (attempt 3; last: " + "x" * 300 + ")"
    text = render_page(
        page_doc(
            alerts=[
                {"name": "llm_not_ready", "message": long},
                {"name": "docker", "message": "<b>"},
            ]
        ),
        "t",
    )
    balanced(text)
    assert (
        '<li data-alert="llm_not_ready"><details id="alert-llm_not_ready"><summary><strong>'
        "llm_not_ready</strong>: vLLM not ready within 600 s (attempt 3; last: …</summary>"
        f"<p>{long}</p></details></li>"
    ) in text
    assert '<li data-alert="docker"><strong>docker</strong>: &lt;b&gt;</li>' in text
    assert '<h2 id="alerts-h">Alerts (2)</h2>' in text
