"""Issue 9: intervals on the boot-time clock, reboots, shared buffers counted once per card."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cardshare.naming import DEFAULT_RULES
from cardshare.recorder import ScanConfig, run_scan, sample
from cardshare.recorder.compute import build_snapshot, interval_ns, usable_previous
from cardshare.recorder.scan import scan_proc

S = 1_000_000_000
MIB = 1024**2
SEPT = 1_790_424_000 * S  # 2026-09-26T12:00:00Z


def i915(busy_ns: int, client_id: int = 7) -> str:
    """An i915 client (nanosecond engine time), region names as i915 prints them."""
    return (
        "drm-driver:\ti915\n"
        f"drm-client-id:\t{client_id}\n"
        "drm-pdev:\t0000:03:00.0\n"
        "drm-resident-local0:\t512 MiB\n"
        "drm-resident-system0:\t8 MiB\n"
        f"drm-engine-video:\t{busy_ns} ns\n"
    )


class Clocks:
    """Injected wall and boot-time clocks, set by the test between scans."""

    def __init__(self, wall: int, boot: int | None) -> None:
        self.wall = wall
        self.boot = boot

    def wall_clock(self) -> int:
        return self.wall

    def boot_clock(self) -> int | None:
        return self.boot


@pytest.fixture
def scanner(rec_tree: Any, tmp_path: Path) -> Iterator[tuple[Any, Clocks, ScanConfig]]:
    rec_tree.card("0000:03:00.0", driver="i915", vram=None)
    rec_tree.boot_id("boot-1")
    rec_tree.process(100, comm="Plex Transcoder")
    rec_tree.drm_fd(100, 3, i915(0))
    clocks = Clocks(SEPT, 1000 * S)
    config = ScanConfig(
        root=str(rec_tree.root),
        data_dir=tmp_path / "data",
        rules=DEFAULT_RULES,
        is_drm=rec_tree.is_drm,
        wall_clock=clocks.wall_clock,
        boot_clock=clocks.boot_clock,
    )
    yield rec_tree, clocks, config


def _busy(snapshot: dict[str, Any]) -> float | None:
    client = snapshot["cards"]["0000:03:00.0"]["clients"][0]
    value: float | None = client["engines"]["video"]
    return value


def _advance(tree: Any, busy_ns: int) -> None:
    (tree.root / "proc" / "100" / "fdinfo" / "3").write_text(i915(busy_ns))


@pytest.mark.parametrize("step", [-3600 * S, -30 * S, 3600 * S, 0])
def test_ntp_step_changes_nothing(scanner: tuple[Any, Clocks, ScanConfig], step: int) -> None:
    """60 s on the boot-time clock, 30 s busy: 0.5 whatever the wall clock did."""
    tree, clocks, config = scanner
    first = run_scan(config)
    assert first["interval_seconds"] is None
    _advance(tree, 30 * S)
    clocks.wall += 60 * S + step
    clocks.boot = (clocks.boot or 0) + 60 * S
    second = run_scan(config)
    assert second["interval_seconds"] == 60.0
    assert _busy(second) == 0.5
    assert second["timestamp_unix"] == (SEPT + 60 * S + step) / 1e9  # wall time, as it is


def test_reboot_by_boot_id_discards_the_interval(scanner: tuple[Any, Clocks, ScanConfig]) -> None:
    tree, clocks, config = scanner
    run_scan(config)
    tree.boot_id("boot-2")
    _advance(tree, 30 * S)
    clocks.wall += 60 * S
    clocks.boot = (clocks.boot or 0) + 60 * S  # even a boot-time clock that moved on
    snapshot = run_scan(config)
    assert (snapshot["interval_seconds"], _busy(snapshot)) == (None, None)


def test_reboot_by_boottime_going_backwards(
    scanner: tuple[Any, Clocks, ScanConfig],
) -> None:
    """Same (or unreadable) boot id, but the boot-time clock restarted: a reboot."""
    tree, clocks, config = scanner
    run_scan(config)
    (tree.root / "proc" / "sys" / "kernel" / "random" / "boot_id").unlink()
    _advance(tree, 30 * S)
    clocks.wall += 600 * S
    clocks.boot = 20 * S
    snapshot = run_scan(config)
    assert (snapshot["interval_seconds"], _busy(snapshot)) == (None, None)
    # and the next interval is measured from the rebooted clock
    _advance(tree, 45 * S)
    clocks.wall += 60 * S
    clocks.boot = 110 * S
    snapshot = run_scan(config)
    assert (snapshot["interval_seconds"], _busy(snapshot)) == (90.0, 0.1667)


def test_state_keeps_both_clocks(scanner: tuple[Any, Clocks, ScanConfig]) -> None:
    config = scanner[2]
    run_scan(config)
    state = json.loads((config.data_dir / "state.json").read_text())
    assert (state["timestamp_ns"], state["boottime_ns"], state["boot_id"]) == (
        SEPT,
        1000 * S,
        "boot-1",
    )


@pytest.mark.parametrize(
    ("state", "now", "boot_id", "boot", "usable", "span"),
    [
        # boot-time clock on both sides: the wall clock is not consulted
        ({"timestamp_ns": 100 * S, "boottime_ns": 10 * S}, 50 * S, "a", 70 * S, True, 60 * S),
        ({"timestamp_ns": 100 * S, "boottime_ns": 10 * S}, 900 * S, "a", 70 * S, True, 60 * S),
        ({"timestamp_ns": 100 * S, "boottime_ns": 80 * S}, 160 * S, "a", 70 * S, False, None),
        ({"timestamp_ns": 100 * S, "boottime_ns": 70 * S}, 160 * S, "a", 70 * S, False, None),
        ({"timestamp_ns": 100 * S, "boottime_ns": 10 * S}, 160 * S, "b", 70 * S, False, None),
        # an older state without the boot-time clock: wall time, as before
        ({"timestamp_ns": 100 * S}, 160 * S, "a", 70 * S, True, 60 * S),
        ({"timestamp_ns": 100 * S, "boottime_ns": None}, 90 * S, "a", 70 * S, False, None),
        # no boot-time clock now (not Linux, injected wall time): wall time
        ({"timestamp_ns": 100 * S, "boottime_ns": 10 * S}, 130 * S, "a", None, True, 30 * S),
    ],
)
def test_usable_previous_and_interval(
    state: dict[str, Any],
    now: int,
    boot_id: str,
    boot: int | None,
    usable: bool,
    span: int | None,
) -> None:
    full = {"version": 1, "boot_id": "a", "clients": {}, **state}
    prev = usable_previous(full, now, boot_id, boot)
    assert (prev is not None) is usable
    if prev is not None:
        assert interval_ns(prev, now, boot) == span


def test_sample_reads_the_boot_time_clock_when_not_injected(rec_tree: Any) -> None:
    rec_tree.process(1)
    _, state = sample(str(rec_tree.root), (), None, None)
    assert isinstance(state["boottime_ns"], int) and state["boottime_ns"] > 0


# -- shared buffers: the card total counts them once -----------------------------------------


def xe_shared(client_id: int, resident: str, shared: str) -> str:
    return (
        "drm-driver:\txe\n"
        f"drm-client-id:\t{client_id}\n"
        "drm-pdev:\t0000:03:00.0\n"
        f"drm-total-vram0:\t{resident}\n"
        f"drm-shared-vram0:\t{shared}\n"
        f"drm-resident-vram0:\t{resident}\n"
    )


@pytest.mark.parametrize(
    ("clients", "used", "shared", "per_client"),
    [
        # one 4 MiB buffer shared by two clients: 6 + 6 private, 4 shared once
        ([(1, "10 MiB", "4 MiB"), (2, "10 MiB", "4 MiB")], 16 * MIB, 4 * MIB, [10, 10]),
        # nothing shared: the plain sum
        ([(1, "10 MiB", "0"), (2, "3 MiB", "0")], 13 * MIB, 0, [10, 3]),
        # shared but not resident (drm-shared counts the buffer, resident does not)
        ([(1, "1 MiB", "4 MiB"), (2, "10 MiB", "0")], 11 * MIB, MIB, [1, 10]),
        # different amounts shared: the largest is counted once
        ([(1, "8 MiB", "2 MiB"), (2, "8 MiB", "6 MiB")], 14 * MIB, 6 * MIB, [8, 8]),
    ],
)
def test_card_total_counts_shared_buffers_once(
    rec_tree: Any,
    clients: list[tuple[int, str, str]],
    used: int,
    shared: int,
    per_client: list[int],
) -> None:
    rec_tree.card("0000:03:00.0")
    names = {}
    for pid, (client_id, resident, shared_text) in enumerate(clients, start=100):
        rec_tree.process(pid)
        rec_tree.drm_fd(pid, 3, xe_shared(client_id, resident, shared_text))
        names[pid] = f"app{pid}"
    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm)
    snapshot, _ = build_snapshot(scan, names, {}, None, SEPT, "h")
    card = snapshot["cards"]["0000:03:00.0"]
    assert (card["vram_used_bytes"], card["vram_shared_bytes"]) == (used, shared)
    assert [c["vram_bytes"] // MIB for c in card["clients"]] == per_client
    assert card["vram_used_bytes"] <= sum(c["vram_bytes"] for c in card["clients"])


def test_i915_and_amdgpu_system_memory_reach_the_snapshot(
    rec_tree: Any, rec_fixtures: Path, rec_make_fdinfo: Callable[..., str]
) -> None:
    rec_tree.process(100)
    rec_tree.drm_fd(100, 3, (rec_fixtures / "fdinfo" / "i915-dg2-regions.txt").read_text())
    rec_tree.process(101)
    rec_tree.drm_fd(101, 3, (rec_fixtures / "fdinfo" / "amdgpu-format.txt").read_text())
    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm)
    snapshot, _ = build_snapshot(scan, {100: "i915app", 101: "amdapp"}, {}, None, SEPT, "h")
    i915_client = snapshot["cards"]["0000:03:00.0"]["clients"][0]
    amd_client = snapshot["cards"]["0000:0b:00.0"]["clients"][0]
    assert (i915_client["system_bytes"], i915_client["vram_shared_bytes"]) == (
        8396 * 1024,
        64 * MIB,
    )
    assert (amd_client["system_bytes"], amd_client["gtt_bytes"], amd_client["vram_bytes"]) == (
        4 * MIB,
        18 * MIB,
        1612 * MIB,
    )
