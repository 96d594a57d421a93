"""Tests of the recorder's pure computations: busy shares and the snapshot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from cardshare.fdinfo import parse_fdinfo
from cardshare.naming import DEFAULT_RULES, ContainerRef
from cardshare.recorder import read_cards, sample
from cardshare.recorder.compute import (
    CardInfo,
    advance_counters,
    build_snapshot,
    busy_ratio,
    client_busy,
    iso_utc,
    usable_previous,
)
from cardshare.recorder.output import prometheus_text
from cardshare.recorder.results import ProcessInfo
from cardshare.recorder.scan import scan_proc

S = 1_000_000_000  # ns per second


@pytest.mark.parametrize(
    ("delta", "span", "capacity", "expected"),
    [
        (50, 100, 1, 0.5),
        (50, 100, 2, 0.25),
        (400, 100, 4, 1.0),
        (500, 100, 4, 1.0),  # clamped
        (0, 100, 1, 0.0),
        (-5, 100, 1, 0.0),
        (5, 0, 1, None),
        (5, -10, 1, None),
        (1, 3, 1, 0.3333),
    ],
)
def test_busy_ratio(delta: int, span: int, capacity: int, expected: float | None) -> None:
    assert busy_ratio(delta, span, capacity) == expected


@pytest.mark.parametrize(
    ("prev", "cur", "expected"),
    [
        ({"rcs": 10}, {"rcs": 15}, {"rcs": 15}),
        ({"rcs": 10}, {"rcs": 5}, {"rcs": 10}),  # went backwards: keep the larger
        ({}, {"rcs": 5}, {"rcs": 5}),
        ({"old": 1}, {"rcs": 5}, {"rcs": 5}),
    ],
)
def test_advance_counters(
    prev: dict[str, int], cur: dict[str, int], expected: dict[str, int]
) -> None:
    assert advance_counters(prev, cur) == expected


def xe(cycles: int, total: int, cls: str = "ccs", capacity: int = 1) -> str:
    text = f"drm-driver: xe\ndrm-client-id: 1\ndrm-cycles-{cls}: {cycles}\n"
    text += f"drm-total-cycles-{cls}: {total}\n"
    if capacity > 1:
        text += f"drm-engine-capacity-{cls}: {capacity}\n"
    return text


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        (xe(0, 1000), xe(500, 2000), 0.5),
        (xe(0, 1000, capacity=4), xe(2000, 2000, capacity=4), 0.5),
        (xe(100, 1000), xe(100, 2000), 0.0),
        (xe(500, 1000), xe(200, 2000), 0.0),  # cycles backwards
        (xe(0, 1000), xe(500, 1000), None),  # no total-cycles progress
        (xe(0, 5000), xe(10, 2000), None),  # total-cycles backwards: held, no span
    ],
)
def test_client_busy_xe(first: str, second: str, expected: float | None) -> None:
    _, state = client_busy(None, parse_fdinfo(first), None)
    ratios, _ = client_busy(state, parse_fdinfo(second), 60 * S)
    assert ratios == {"ccs": expected}


def test_backwards_counter_keeps_larger_previous_value() -> None:
    _, s1 = client_busy(None, parse_fdinfo(xe(500, 1000)), None)
    _, s2 = client_busy(s1, parse_fdinfo(xe(200, 2000)), S)
    assert s2["cycles"] == {"ccs": 500}
    ratios, _ = client_busy(s2, parse_fdinfo(xe(800, 3000)), S)
    assert ratios == {"ccs": 0.3}


def test_client_busy_first_sample_is_unknown() -> None:
    ratios, state = client_busy(None, parse_fdinfo(xe(5, 10)), None)
    assert ratios == {"ccs": None}
    assert state == {"cycles": {"ccs": 5}, "total_cycles": {"ccs": 10}, "busy_ns": {}}


def i915(ns: int, capacity: int = 1) -> str:
    text = f"drm-driver: i915\ndrm-client-id: 1\ndrm-engine-video: {ns} ns\n"
    if capacity > 1:
        text += f"drm-engine-capacity-video: {capacity}\n"
    return text


@pytest.mark.parametrize(
    ("first", "second", "wall", "expected"),
    [
        (i915(0), i915(30 * S), 60 * S, 0.5),
        (i915(0, 2), i915(30 * S, 2), 60 * S, 0.25),
        (i915(10 * S), i915(5 * S), 60 * S, 0.0),
        (i915(0), i915(30 * S), None, None),
        (i915(0), i915(30 * S), 0, None),
    ],
)
def test_client_busy_i915(
    first: str, second: str, wall: int | None, expected: float | None
) -> None:
    _, state = client_busy(None, parse_fdinfo(first), None)
    ratios, _ = client_busy(state, parse_fdinfo(second), wall)
    assert ratios == {"video": expected}


def test_engine_without_counters_is_left_out() -> None:
    ratios, _ = client_busy(None, parse_fdinfo("drm-engine-capacity-vcs: 2\n"), None)
    assert ratios == {}


@pytest.mark.parametrize(
    ("state", "now", "boot", "usable"),
    [
        ({"version": 1, "timestamp_ns": 5, "boot_id": "a", "clients": {}}, 10, "a", True),
        ({"version": 1, "timestamp_ns": 5, "boot_id": "a", "clients": {}}, 10, "b", False),
        ({"version": 1, "timestamp_ns": 5, "boot_id": None, "clients": {}}, 10, "b", True),
        ({"version": 1, "timestamp_ns": 5, "boot_id": "a", "clients": {}}, 10, None, True),
        ({"version": 1, "timestamp_ns": 10, "boot_id": "a", "clients": {}}, 10, "a", False),
        ({"version": 2, "timestamp_ns": 5, "boot_id": "a", "clients": {}}, 10, "a", False),
        ({"version": 1, "timestamp_ns": "5", "clients": {}}, 10, "a", False),
        ({"version": 1, "timestamp_ns": 5, "clients": []}, 10, "a", False),
        (None, 10, "a", False),
    ],
)
def test_usable_previous(
    state: dict[str, Any] | None, now: int, boot: str | None, usable: bool
) -> None:
    assert (usable_previous(state, now, boot) is not None) is usable


def test_iso_utc() -> None:
    assert iso_utc(1_790_424_000 * S + 123) == "2026-09-26T12:00:00Z"


def _two_scans(tree: Any, make: Callable[..., str]) -> tuple[dict[str, Any], dict[str, Any]]:
    t = tree
    t.card("0000:03:00.0")
    t.card("0000:05:00.0", vram=None)  # a second, idle card without a known size
    t.boot_id("boot-1")
    t.process(100, comm="python3")
    t.process(101, comm="python3")
    t.process(102, comm="Plex Transcoder")
    t.drm_fd(100, 3, make(1, vram="1 MiB", cycles={"ccs": (0, 1000)}, capacity={"ccs": 4}))
    t.drm_fd(101, 3, make(2, vram="3 MiB", cycles={"ccs": (0, 1000)}, capacity={"ccs": 4}))
    t.drm_fd(102, 3, make(5, cycles={"vcs": (0, 1000)}))
    rules_and_names = {100: "llm", 101: "llm", 102: "plex"}
    scan1 = scan_proc(str(t.root), t.is_drm)
    snap1, state1 = build_snapshot(
        scan1, rules_and_names, read_cards(str(t.root)), None, 10 * S, "h", "boot-1"
    )
    # counters advance
    (t.root / "proc/100/fdinfo/3").write_text(
        make(1, vram="1 MiB", cycles={"ccs": (1000, 2000)}, capacity={"ccs": 4})
    )
    (t.root / "proc/101/fdinfo/3").write_text(
        make(2, vram="3 MiB", cycles={"ccs": (3000, 2000)}, capacity={"ccs": 4})
    )
    (t.root / "proc/102/fdinfo/3").write_text(make(5, cycles={"vcs": (250, 2000)}))
    scan2 = scan_proc(str(t.root), t.is_drm)
    snap2, state2 = build_snapshot(
        scan2, rules_and_names, read_cards(str(t.root)), state1, 70 * S, "h", "boot-1"
    )
    assert state2["clients"]["0000:03:00.0/1"]["cycles"] == {"ccs": 1000}
    return snap1, snap2


def test_snapshot_aggregates_by_name(rec_tree: Any, rec_make_fdinfo: Callable[..., str]) -> None:
    snap1, snap2 = _two_scans(rec_tree, rec_make_fdinfo)
    assert snap1["interval_seconds"] is None
    card1 = snap1["cards"]["0000:03:00.0"]
    assert [c["engines"] for c in card1["clients"]] == [{"ccs": None}, {"vcs": None}]

    assert snap2["interval_seconds"] == 60.0
    assert snap2["timestamp"] == "1970-01-01T00:01:10Z"
    card = snap2["cards"]["0000:03:00.0"]
    assert card["driver"] == "xe"
    assert card["vram_total_bytes"] == 0x800000000
    assert card["vram_used_bytes"] == 4 * 1024**2
    llm, plex = card["clients"]
    assert llm == {
        "name": "llm",
        "kind": "process",
        "vram_bytes": 4 * 1024**2,
        "system_bytes": 0,
        "gtt_bytes": 2 * 192 * 1024,
        "vram_shared_bytes": 0,
        "engines": {"ccs": 1.0},  # 0.25 + 0.75
        "pids": [100, 101],
        "containers": [],
        "commands": ["python3"],
        "drm_client_ids": [1, 2],
    }
    assert plex["name"] == "plex"
    assert plex["engines"] == {"vcs": 0.25}
    assert snap2["cards"]["0000:05:00.0"] == {
        "driver": "xe",
        "vram_total_bytes": None,
        "vram_used_bytes": 0,
        "vram_shared_bytes": 0,
        "clients": [],
    }


def test_empty_snapshot(rec_tree: Any) -> None:
    rec_tree.process(1)
    snapshot, state = sample(str(rec_tree.root), (), None, None, 5 * S, rec_tree.is_drm)
    assert snapshot["cards"] == {}
    assert state["clients"] == {}
    assert snapshot["stats"]["processes"] == 1


def test_card_driver_from_fdinfo_when_sysfs_is_silent(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    rec_tree.process(1)
    rec_tree.drm_fd(1, 3, rec_make_fdinfo(1, pdev="0000:09:00.0"))
    snapshot, _ = sample(str(rec_tree.root), (), None, None, 5 * S, rec_tree.is_drm)
    assert snapshot["cards"]["0000:09:00.0"]["driver"] == "xe"
    assert snapshot["cards"]["0000:09:00.0"]["vram_total_bytes"] is None


def test_process_names_fall_back(rec_tree: Any, rec_make_fdinfo: Callable[..., str]) -> None:
    rec_tree.process(1, comm="Plex Transcoder")
    rec_tree.drm_fd(1, 3, rec_make_fdinfo(1))
    from cardshare.naming import DEFAULT_RULES

    snapshot, _ = sample(str(rec_tree.root), DEFAULT_RULES, None, None, 5 * S, rec_tree.is_drm)
    assert [c["name"] for c in snapshot["cards"]["0000:03:00.0"]["clients"]] == ["plex"]


def test_read_cards_accepts_decimal_and_hex(rec_tree: Any) -> None:
    rec_tree.card("0000:03:00.0", vram="34359738368")
    rec_tree.card("0000:04:00.0", driver="i915", vram="0x10")
    assert read_cards(str(rec_tree.root)) == {
        "0000:03:00.0": CardInfo("xe", 34359738368),
        "0000:04:00.0": CardInfo("i915", 16),
    }


def test_unknown_client_name(rec_tree: Any, rec_make_fdinfo: Callable[..., str]) -> None:
    rec_tree.process(1)
    rec_tree.drm_fd(1, 3, rec_make_fdinfo(1))
    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm)
    scan.processes[1] = ProcessInfo(1, "", "", None)
    snapshot, _ = build_snapshot(scan, {}, {}, None, S, "h")
    assert snapshot["cards"]["0000:03:00.0"]["clients"][0]["name"] == "unknown"


def test_a_broker_holding_the_descriptor_does_not_name_the_client(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """systemd-logind (the lower pid) holds the DRM file of a session's compositor: the client
    is the compositor's, by name and by command; the broker's pid stays among the holders."""
    rec_tree.process(812)
    rec_tree.process(2301)
    rec_tree.drm_fd(812, 3, rec_make_fdinfo(7))
    rec_tree.drm_fd(2301, 9, rec_make_fdinfo(7))
    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm, every_holder=True)
    scan.processes[812] = ProcessInfo(
        812, "systemd-logind", "", None, cgroup="/system.slice/systemd-logind.service"
    )
    scan.processes[2301] = ProcessInfo(
        2301, "gnome-shell", "", None, cgroup="/user.slice/user-1000.slice/session-2.scope"
    )
    names = {812: "systemd-logind", 2301: "gnome-shell"}
    snapshot, _ = build_snapshot(scan, names, {}, None, S, "h")
    (client,) = snapshot["cards"]["0000:03:00.0"]["clients"]
    assert (client["name"], client["commands"], client["pids"]) == (
        "gnome-shell",
        ["gnome-shell"],
        [812, 2301],
    )


def test_a_container_and_a_host_process_of_one_name_stay_two_clients(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """Issue 30: Plex in a container named ``plex`` and a host program whose comm is ``plex``
    were one client (their memory summed, their pids mixed): clients are keyed by kind and
    name, and the textfile keeps them two series (label ``kind``)."""
    t = rec_tree
    t.card("0000:03:00.0")
    box = "0::/system.slice/docker-" + "cd" * 32 + ".scope\n"
    t.process(100, comm="Plex Transcoder", cgroup=box)
    t.drm_fd(100, 3, rec_make_fdinfo(1, vram="1 MiB"))
    t.process(200, comm="plex")
    t.drm_fd(200, 3, rec_make_fdinfo(2, vram="3 MiB"))

    def resolver(ref: ContainerRef) -> str | None:
        return "plex" if ref.id == "cd" * 32 else None

    snapshot, _ = sample(str(t.root), DEFAULT_RULES, resolver, None, 10 * S, is_drm=t.is_drm)
    clients = snapshot["cards"]["0000:03:00.0"]["clients"]
    assert [(c["name"], c["kind"], c["pids"], c["vram_bytes"]) for c in clients] == [
        ("plex", "container", [100], 1024**2),
        ("plex", "process", [200], 3 * 1024**2),
    ]
    text = prometheus_text(snapshot)
    assert (
        'cardshare_client_vram_bytes{client="plex",kind="container",card="0000:03:00.0"} 1048576'
        in text
    )
    assert (
        'cardshare_client_vram_bytes{client="plex",kind="process",card="0000:03:00.0"} 3145728'
        in text
    )
