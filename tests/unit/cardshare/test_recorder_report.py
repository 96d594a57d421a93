"""Tests of the monthly report."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cardshare.recorder.report import build_report, format_report, parse_lines

GIB = 1024**3


def snap(t: float, interval: float | None, clients: list[dict[str, Any]]) -> str:
    return json.dumps(
        {
            "timestamp": f"t{t:g}",
            "timestamp_unix": t,
            "interval_seconds": interval,
            "cards": {"0000:03:00.0": {"clients": clients}},
        }
    )


def plex(vcs: float | None, vram: int) -> dict[str, Any]:
    return {"name": "plex", "vram_bytes": vram, "engines": {"vcs": vcs, "vecs": 0.0}}


def test_report_minutes_and_vram() -> None:
    lines = [
        snap(1000, None, [plex(None, 2 * GIB)]),  # first scan: no interval known
        snap(1060, 60, [plex(0.5, 4 * GIB)]),
        snap(1120, None, [plex(0.0, 0)]),  # interval from the previous line
        snap(5000, 3880, [plex(1.0, 2 * GIB)]),  # host was down: capped at 120 s
        "not json",
        json.dumps({"timestamp_unix": "x", "cards": {}}),
        "",
    ]
    snapshots, bad = parse_lines(lines)
    report = build_report("2026-09", snapshots, bad, max_interval=120)
    doc = report.as_dict()
    assert doc == {
        "month": "2026-09",
        "scans": 4,
        "skipped_lines": 2,
        "first": "t1000",
        "last": "t5000",
        "clients": [
            {
                "name": "plex",
                "kind": "process",
                "card": "0000:03:00.0",
                "scans": 4,
                "minutes_present": 4.0,  # 0 + 60 + 60 + 120 s
                "minutes_active": {"vcs": 3.0, "vecs": 0.0},
                "busy_minutes": {"vcs": 2.5, "vecs": 0.0},
                "vram_peak_bytes": 4 * GIB,
                "vram_mean_bytes": 2 * GIB,
            }
        ],
    }


def test_report_sorts_lines_by_time() -> None:
    snapshots, _ = parse_lines([snap(200, None, []), snap(100, None, [])])
    assert [s["timestamp_unix"] for s in snapshots] == [100, 200]


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ([], "month 2026-09: 0 scans\nno clients recorded\n"),
        (
            [snap(1, None, []), "junk"],
            "month 2026-09: 1 scans from t1 to t1, 1 unreadable lines skipped\n"
            "no clients recorded\n",
        ),
        (
            [snap(0, None, [plex(0.0, 0)]), snap(60, 60, [plex(0.25, GIB)])],
            "month 2026-09: 2 scans from t0 to t60\n"
            "CLIENT  KIND     CARD          PRESENT MIN  ACTIVE MIN PER ENGINE  VRAM PEAK"
            "  VRAM MEAN\n"
            "plex    process  0000:03:00.0  1.0          vcs=1.0 vecs=0.0       1.00 GiB "
            "  0.50 GiB\n",
        ),
    ],
)
def test_format_report(lines: list[str], expected: str) -> None:
    snapshots, bad = parse_lines(lines)
    assert format_report(build_report("2026-09", snapshots, bad)) == expected


def test_report_ignores_odd_clients() -> None:
    doc = {
        "timestamp_unix": 1,
        "cards": {"a": {"clients": [1, {"name": 2}, {"name": "x", "vram_bytes": "big"}]}},
    }
    report = build_report("m", [doc])
    assert report.as_dict()["clients"] == [
        {
            "name": "x",
            "kind": "process",
            "card": "a",
            "scans": 1,
            "minutes_present": 0.0,
            "minutes_active": {},
            "busy_minutes": {},
            "vram_peak_bytes": 0,
            "vram_mean_bytes": 0,
        }
    ]


def test_a_container_and_a_host_process_of_one_name_are_two_rows() -> None:
    """Issue 30: the month's report keeps apart what the snapshot keeps apart (kind)."""
    doc = {
        "timestamp_unix": 1,
        "cards": {
            "c": {
                "clients": [
                    {"name": "plex", "kind": "container", "vram_bytes": 1},
                    {"name": "plex", "kind": "process", "vram_bytes": 3},
                ]
            }
        },
    }
    report = build_report("2026-09", [doc])
    assert sorted((k, c.vram_peak) for k, c in report.clients.items()) == [
        (("plex", "c", "container"), 1),
        (("plex", "c", "process"), 3),
    ]
