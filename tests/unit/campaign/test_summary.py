"""The campaign's line in the recorder's report: its month read from the service's database.

The database is written by the service's own :class:`Store` (with a clock set to the moments
of each case), and read back by ``cardshare report`` as a user runs it.
"""

from __future__ import annotations

import calendar
import json
from pathlib import Path

import pytest

from cardshare.campaign.store import FileState, Store
from cardshare.campaign.summary import (
    CampaignMonth,
    CampaignSummaryError,
    format_campaign_line,
    read_campaign_month,
)
from cardshare.cli import main
from cardshare.cli.campaign import format_status

GB = 10**9


def at(text: str) -> float:
    """A UTC moment "YYYY-MM-DD HH:MM"."""
    day, time_of_day = text.split()
    y, m, d = (int(x) for x in day.split("-"))
    hh, mm = (int(x) for x in time_of_day.split(":"))
    return float(calendar.timegm((y, m, d, hh, mm, 0)))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replaced(store: Store, clock: Clock, when: str, name: str, size: int, new_size: int) -> None:
    clock.now = at(when)
    path = f"/media/Films/{name}.mkv"
    store.seen(path, FileState.QUEUED, "picked", size, 1)
    store.start(path, f"/media/Films/.cardshare-encoding.{name}.mkv")
    store.set_held(path, f"/media/.held/{name}.mkv")
    store.done(path, path, new_size, 2, f"/media/.held/{name}.mkv", 600.0)


@pytest.fixture
def database(tmp_path: Path) -> Path:
    """November and December 2026 of a campaign; the service's own store wrote it."""
    clock = Clock()
    store = Store(tmp_path / "campaign.sqlite3", clock=clock)
    # the last minute of November (UTC) and the first of December: one month each
    replaced(store, clock, "2026-11-30 23:59", "November", 40 * GB, 15 * GB)
    replaced(store, clock, "2026-12-01 00:00", "One", 50 * GB, 20 * GB)
    replaced(store, clock, "2026-12-20 12:00", "Two", 30 * GB, 12 * GB)
    clock.now = at("2026-12-21 08:00")
    store.purged("/media/Films/November.mkv")  # its holding period over: no longer held
    store.seen("/media/Films/Bad.mkv", FileState.QUEUED, "picked", 9 * GB, 1)
    store.fail("/media/Films/Bad.mkv", "the result failed the decode pass; the original is kept")
    store.seen("/media/Films/Next.mkv", FileState.QUEUED, "picked", 8 * GB, 1)
    store.seen(
        "/media/Films/Small.mkv", FileState.SKIPPED, "1920x1080 is narrower than 3840", GB, 1
    )
    store.close()
    return tmp_path / "campaign.sqlite3"


def test_a_month_counts_what_was_replaced_in_it_and_what_failed(database: Path) -> None:
    assert read_campaign_month(database, "2026-12") == CampaignMonth(
        month="2026-12",
        done=2,
        saved_bytes=(50 - 20 + 30 - 12) * GB,
        encode_seconds=1200.0,
        failed=1,
        queued_now=1,
        held_bytes_now=(50 + 30) * GB,  # November's original was purged
    )
    november = read_campaign_month(database, "2026-11")
    assert november is not None
    assert (november.done, november.saved_bytes, november.failed) == (1, 25 * GB, 0)
    assert read_campaign_month(database, "2027-01") == CampaignMonth(
        "2027-01", 0, 0, 0.0, 0, 1, 80 * GB
    )


def test_no_database_is_no_campaign(tmp_path: Path) -> None:
    assert read_campaign_month(tmp_path / "campaign.sqlite3", "2026-12") is None


def test_a_damaged_database_is_an_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "campaign.sqlite3"
    bad.write_bytes(b"not a database, " * 512)
    with pytest.raises(CampaignSummaryError, match=r"campaign\.sqlite3: file is not a database"):
        read_campaign_month(bad, "2026-12")


def test_the_database_is_read_while_the_service_writes_it(database: Path) -> None:
    clock = Clock()
    store = Store(database, clock=clock)  # the service running: its connection open, in WAL
    try:
        replaced(store, clock, "2026-12-22 10:00", "Three", 20 * GB, 10 * GB)
        files = sorted(p.name for p in database.parent.iterdir())
        before = database.read_bytes()
        summary = read_campaign_month(database, "2026-12")
        # the last encode is still in the WAL file: a reader sees it, and writes nothing
        assert summary is not None and (summary.done, summary.saved_bytes) == (3, 58 * GB)
        assert database.read_bytes() == before
        assert sorted(p.name for p in database.parent.iterdir()) == files
    finally:
        store.close()


def test_the_line_says_what_was_won_and_what_failed() -> None:
    line = format_campaign_line(CampaignMonth("2026-12", 2, 48 * GB, 1200.0, 1, 3, 80 * GB))
    assert line == (
        "re-encode campaign: 2 file(s) replaced, 48.0 GB won back in 20.0 min of encoding; "
        "1 failed (originals kept; `cardshare campaign status` says why); "
        "now 3 queued, 80.0 GB of originals held"
    )
    assert "failed" not in format_campaign_line(CampaignMonth("2026-12", 0, 0, 0.0, 0, 0, 0))


def history(tmp_path: Path) -> list[str]:
    """A recorder's December: one scan with the campaign's encoder on the card's video engine."""
    line = {
        "timestamp": "2026-12-20T12:00:00Z",
        "timestamp_unix": at("2026-12-20 12:00"),
        "interval_seconds": 60,
        "cards": {
            "0000:03:00.0": {
                "clients": [
                    {
                        "name": "campaign/encoder",
                        "kind": "container",
                        "vram_bytes": GB,
                        "engines": {"vcs": 0.5},
                    }
                ]
            }
        },
    }
    (tmp_path / "recorder" / "history").mkdir(parents=True)
    (tmp_path / "recorder" / "history" / "2026-12.jsonl").write_text(json.dumps(line) + "\n")
    return ["report", "--month", "2026-12", "--data-dir", str(tmp_path / "recorder")]


def test_the_report_has_the_campaigns_line(
    database: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = history(tmp_path)
    assert main([*args, "--campaign-db", str(database)]) == 0
    text = capsys.readouterr().out
    assert (
        text.splitlines()[0]
        == "month 2026-12: 1 scans from 2026-12-20T12:00:00Z to 2026-12-20T12:00:00Z"
    )
    # the encoder's minute on the card, then what the campaign won in the month
    assert text.splitlines()[2].startswith("campaign/encoder  container  0000:03:00.0  1.0 ")
    assert text.splitlines()[3:] == [
        "re-encode campaign: 2 file(s) replaced, 48.0 GB won back in 20.0 min of encoding; "
        "1 failed (originals kept; `cardshare campaign status` says why); "
        "now 1 queued, 80.0 GB of originals held",
    ]
    assert main([*args, "--campaign-db", str(database), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["campaign"] == {
        "month": "2026-12",
        "done": 2,
        "saved_bytes": 48 * GB,
        "encode_seconds": 1200.0,
        "failed": 1,
        "queued_now": 1,
        "held_bytes_now": 80 * GB,
    }


def test_the_report_without_a_campaign_has_no_line_and_a_damaged_one_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = history(tmp_path)
    assert main([*args, "--campaign-db", str(tmp_path / "none.sqlite3")]) == 0
    assert "re-encode campaign" not in capsys.readouterr().out
    assert main([*args, "--campaign-db", str(tmp_path / "none.sqlite3"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["campaign"] is None
    bad = tmp_path / "bad.sqlite3"
    bad.write_bytes(b"garbage" * 1000)
    assert main([*args, "--campaign-db", str(bad)]) == 0  # the card's report still stands
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"re-encode campaign: its database cannot be read ({bad}: file is not a database)"
    )


def test_the_status_gives_a_small_saving_in_mb_and_a_large_one_in_gb() -> None:
    doc = {"phase": "idle", "encoder": {"name": "libx265", "software": True}, "counts": {"done": 1}}
    small = format_status(doc | {"saved_bytes": 23_987_053, "held_bytes": 25_277_292}, "u")
    assert "won back:   24 MB; originals held 25 MB" in small
    large = format_status(doc | {"saved_bytes": 48 * GB, "held_bytes": 80 * GB}, "u")
    assert "won back:   48.0 GB; originals held 80.0 GB" in large
