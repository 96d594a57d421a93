"""Pure computations of the recorder: busy shares between samples, the snapshot document.

Nothing here touches the filesystem; :mod:`cardshare.recorder` feeds it a scan, names, card
facts and the previous state, and writes what it returns.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cardshare.fdinfo import FdInfo
from cardshare.naming import naming_pid
from cardshare.recorder.results import DrmClient, ProcessInfo, ProcScan

__all__ = [
    "SCHEMA_VERSION",
    "STATE_VERSION",
    "CardInfo",
    "advance_counters",
    "build_snapshot",
    "busy_ratio",
    "client_busy",
    "counters_of",
    "interval_ns",
    "iso_utc",
    "usable_previous",
]

SCHEMA_VERSION = 1
STATE_VERSION = 1
_KINDS = ("cycles", "total_cycles", "busy_ns")

Counters = dict[str, dict[str, int]]  # kind -> engine class -> value
JsonDict = dict[str, Any]


@dataclass(frozen=True, slots=True)
class CardInfo:
    """What sysfs says about a DRM card (either may be unknown)."""

    driver: str | None = None
    vram_total: int | None = None


def iso_utc(ns: int) -> str:
    """``2026-09-26T12:00:00Z`` for a time in nanoseconds since the epoch."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns // 1_000_000_000))


def counters_of(info: FdInfo) -> Counters:
    """The engine counters of a client, by kind then class."""
    out: Counters = {kind: {} for kind in _KINDS}
    for cls, usage in info.engines.items():
        for kind in _KINDS:
            value = getattr(usage, kind)
            if value is not None:
                out[kind][cls] = value
    return out


def advance_counters(prev: Mapping[str, int], cur: Mapping[str, int]) -> dict[str, int]:
    """Current counters, where one that went backwards keeps the larger previous value."""
    return {cls: max(value, prev.get(cls, value)) for cls, value in cur.items()}


def busy_ratio(delta: int, span: int, capacity: int) -> float | None:
    """``delta / (span * capacity)`` clamped to [0, 1]; ``None`` when no time passed."""
    if span <= 0 or capacity <= 0:
        return None
    ratio = delta / (span * capacity)
    return round(min(1.0, max(0.0, ratio)), 4)


def client_busy(
    prev: Counters | None, info: FdInfo, wall_ns: int | None
) -> tuple[dict[str, float | None], Counters]:
    """Busy share per engine class since ``prev`` and the counters to keep for next time.

    xe: Δcycles / (Δtotal-cycles * capacity).  i915, amdgpu (nanoseconds): Δbusy / (Δt * capacity)
    where ``wall_ns`` (Δt) is measured on the boot-time clock by :func:`build_snapshot`.
    A class without a previous value (new client, first scan) has ``None``.
    """
    cur = counters_of(info)
    held: Counters = {
        kind: advance_counters(prev.get(kind, {}) if prev else {}, cur[kind]) for kind in _KINDS
    }
    ratios: dict[str, float | None] = {}
    for cls, usage in sorted(info.engines.items()):
        if usage.cycles is None and usage.busy_ns is None:
            continue
        ratio: float | None = None
        if prev is not None:
            p_cyc, p_tot = prev.get("cycles", {}), prev.get("total_cycles", {})
            p_ns = prev.get("busy_ns", {})
            if cls in held["cycles"] and cls in held["total_cycles"]:
                if cls in p_cyc and cls in p_tot:
                    ratio = busy_ratio(
                        held["cycles"][cls] - p_cyc[cls],
                        held["total_cycles"][cls] - p_tot[cls],
                        usage.capacity,
                    )
            elif cls in held["busy_ns"] and cls in p_ns and wall_ns is not None:
                ratio = busy_ratio(held["busy_ns"][cls] - p_ns[cls], wall_ns, usage.capacity)
        ratios[cls] = ratio
    return ratios, held


def _name_of_client(
    client: DrmClient, names: Mapping[int, str], processes: Mapping[int, ProcessInfo]
) -> tuple[str, int]:
    """The client's name and the pid that names it: not a broker such as logind that holds
    the descriptor for a session (naming.naming_pid), else the lowest pid with a name."""
    pid = naming_pid(client.pids, processes)
    if pid in names:
        return names[pid], pid
    for other in sorted(client.pids):
        if other in names:
            return names[other], other
    return "unknown", pid


def _sum_busy(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return round(min(1.0, sum(known)), 4)


def usable_previous(
    state: Mapping[str, Any] | None,
    now_ns: int,
    boot_id: str | None,
    boot_ns: int | None = None,
) -> Mapping[str, Any] | None:
    """The previous state when its counters can be compared with now: same boot, earlier.

    A different boot id, or a boot-time clock that went backwards, is a reboot: the counters
    restarted and the interval is discarded.  With the boot-time clock on both sides the wall
    clock is not consulted, so an NTP step (forwards or backwards) changes nothing; a state
    written before the boot-time clock was recorded falls back to the wall clock.
    """
    if not state or state.get("version") != STATE_VERSION:
        return None
    if not isinstance(state.get("clients"), dict):
        return None
    ts = state.get("timestamp_ns")
    if not isinstance(ts, int):
        return None
    if boot_id is not None and state.get("boot_id") not in (None, boot_id):
        return None
    prev_boot = state.get("boottime_ns")
    if boot_ns is not None and isinstance(prev_boot, int):
        return state if prev_boot < boot_ns else None
    return state if ts < now_ns else None


def interval_ns(prev: Mapping[str, Any], now_ns: int, boot_ns: int | None = None) -> int:
    """Time since a usable previous state: on the boot-time clock when both sides have it."""
    prev_boot = prev.get("boottime_ns")
    if boot_ns is not None and isinstance(prev_boot, int):
        return boot_ns - prev_boot
    return now_ns - int(prev["timestamp_ns"])


def build_snapshot(
    scan: ProcScan,
    names: Mapping[int, str],
    cards: Mapping[str, CardInfo],
    prev_state: Mapping[str, Any] | None,
    now_ns: int,
    host: str,
    boot_id: str | None = None,
    boot_ns: int | None = None,
) -> tuple[JsonDict, JsonDict]:
    """Return ``(snapshot, state)`` for one scan (see :mod:`cardshare.recorder` for schemas).

    ``now_ns`` is wall-clock time (the snapshot's timestamp); ``boot_ns`` the boot-time clock
    (``CLOCK_BOOTTIME``), which measures the interval when known on both sides.
    """
    prev = usable_previous(prev_state, now_ns, boot_id, boot_ns)
    span_ns = interval_ns(prev, now_ns, boot_ns) if prev is not None else None
    prev_clients: Mapping[str, Any] = prev["clients"] if prev is not None else {}
    processes: Mapping[int, ProcessInfo] = scan.processes

    state_clients: dict[str, Counters] = {}
    # card -> (name, kind) -> aggregate
    groups: dict[str, dict[tuple[str, str], JsonDict]] = {}
    # card -> VRAM of all its DRM clients: private bytes summed, shared bytes counted once
    card_memory: dict[str, dict[str, int]] = {}
    for (pdev, client_id), client in sorted(scan.clients.items()):
        key = client.key
        prev_counters = prev_clients.get(key)
        ratios, held = client_busy(
            prev_counters if isinstance(prev_counters, dict) else None, client.fdinfo, span_ns
        )
        # Engine capacity (>1 only) kept with the counters for the Prometheus textfile.
        capacity = {
            c: u.capacity for c, u in sorted(client.fdinfo.engines.items()) if u.capacity > 1
        }
        state_clients[key] = {**held, "capacity": capacity} if capacity else held
        name, named_by = _name_of_client(client, names, processes)
        proc = processes.get(named_by)  # a broker's comm and container are not the client's
        # a container and a host process of one name are two clients
        kind = "container" if proc is not None and proc.container is not None else "process"
        group = groups.setdefault(pdev, {}).setdefault(
            (name, kind),
            {
                "name": name,
                "kind": kind,
                "vram_bytes": 0,
                "system_bytes": 0,
                "gtt_bytes": 0,
                "vram_shared_bytes": 0,
                "_engines": {},
                "pids": set(),
                "containers": set(),
                "commands": set(),
                "drm_client_ids": [],
            },
        )
        info = client.fdinfo
        vram, vram_shared = info.vram_bytes, info.vram_shared_bytes
        group["vram_bytes"] += vram
        group["system_bytes"] += info.system_bytes
        group["gtt_bytes"] += info.gtt_bytes
        group["vram_shared_bytes"] += vram_shared
        card_vram = card_memory.setdefault(pdev, {"private": 0, "shared": 0})
        card_vram["private"] += vram - vram_shared
        card_vram["shared"] = max(card_vram["shared"], vram_shared)
        for cls, ratio in ratios.items():
            group["_engines"].setdefault(cls, []).append(ratio)
        group["drm_client_ids"].append(client_id)
        group["pids"].update(client.pids)
        if proc is not None:
            if proc.container is not None:
                group["containers"].add(proc.container.id)
            if proc.comm:
                group["commands"].add(proc.comm)

    drivers = {c.pdev: c.fdinfo.driver for c in scan.clients.values()}
    cards_out: JsonDict = {}
    for pdev in sorted(set(cards) | set(groups)):
        card = cards.get(pdev, CardInfo())
        used = card_memory.get(pdev, {"private": 0, "shared": 0})
        clients_out = []
        for group_key in sorted(groups.get(pdev, {})):
            g = groups[pdev][group_key]
            clients_out.append(
                {
                    "name": g["name"],
                    "kind": g["kind"],
                    "vram_bytes": g["vram_bytes"],
                    "system_bytes": g["system_bytes"],
                    "gtt_bytes": g["gtt_bytes"],
                    "vram_shared_bytes": g["vram_shared_bytes"],
                    "engines": {cls: _sum_busy(v) for cls, v in sorted(g["_engines"].items())},
                    "pids": sorted(g["pids"]),
                    "containers": sorted(g["containers"]),
                    "commands": sorted(g["commands"]),
                    "drm_client_ids": sorted(g["drm_client_ids"]),
                }
            )
        cards_out[pdev] = {
            "driver": card.driver or drivers.get(pdev),
            "vram_total_bytes": card.vram_total,
            "vram_used_bytes": used["private"] + used["shared"],
            "vram_shared_bytes": used["shared"],
            "clients": clients_out,
        }

    snapshot: JsonDict = {
        "schema": SCHEMA_VERSION,
        "timestamp": iso_utc(now_ns),
        "timestamp_unix": round(now_ns / 1e9, 3),
        "interval_seconds": round(span_ns / 1e9, 3) if span_ns is not None else None,
        "host": host,
        "cards": cards_out,
        "stats": scan.stats.as_dict(),
    }
    state: JsonDict = {
        "version": STATE_VERSION,
        "timestamp_ns": now_ns,
        "boottime_ns": boot_ns,
        "boot_id": boot_id,
        "clients": state_clients,
    }
    return snapshot, state
