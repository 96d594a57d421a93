"""The status page: the recorder's history read incrementally into a day and a month, the
page and its JSON served by the arbiter's app, nothing on them that the token guards.

History lines here follow the recorder's documented snapshot (``cardshare.recorder``);
the lab's site scenario checks the page against a real recorder's history in Chromium."""

from __future__ import annotations

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
        "card": {"clients": []},
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
