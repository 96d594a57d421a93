"""The recorder: who is on each DRM card, by container or command, scan after scan.

One scan (:func:`run_scan`, what ``cardshare scan`` and the systemd timer run) reads
``<root>/proc`` (:mod:`cardshare.procscan`), names each client (:mod:`cardshare.naming`),
computes memory and per-engine busy shares since the previous scan
(:mod:`cardshare.recorder.compute`) and writes, under the data directory:

``current.json``
    the latest snapshot, replaced atomically (temp file, fsync, rename);
``history/YYYY-MM.jsonl``
    one snapshot per line (same schema, compact), appended in one write; the month is the
    scan's UTC month; months older than the retention are removed;
``state.json``
    the raw engine counters of the previous scan (``{"version", "timestamp_ns", "boot_id",
    "clients": {"<pdev>/<client-id>": {"cycles": {...}, "total_cycles": {...},
    "busy_ns": {...}}}}``), replaced atomically;

and optionally a Prometheus textfile (``cardshare_client_vram_bytes{client,card}``,
``cardshare_client_engine_busy_ratio{client,card,engine}``,
``cardshare_scan_timestamp_seconds`` and more, see :func:`output.prometheus_text`).

Snapshot schema (``schema`` 1)::

    {
      "schema": 1,
      "timestamp": "2026-09-26T12:00:00Z",      # scan time, UTC
      "timestamp_unix": 1790424000.0,
      "interval_seconds": 60.0,                 # since the previous scan; null on the first
      "host": "devastator",
      "cards": {
        "0000:03:00.0": {                       # drm-pdev (PCI address)
          "driver": "xe",
          "vram_total_bytes": 34359738368,      # from sysfs; null when unknown
          "vram_used_bytes": 30000000000,       # sum over the clients below
          "clients": [                          # one entry per name, sorted by name
            {
              "name": "llm/vllm",               # compose project/service, container, rule, comm
              "vram_bytes": 29000000000,        # resident vram* (xe) / local* (i915) regions
              "system_bytes": 0,                # resident "system" region
              "gtt_bytes": 196608,              # resident "gtt" region
              "engines": {"ccs": 0.42, "rcs": 0.0},  # busy share since the previous scan,
                                                # 0..1 of the class capacity; null = unknown
              "pids": [100001],                 # every process holding one of its clients
              "containers": ["<64 hex>"],       # of the naming process (lowest pid) of each
              "commands": ["python3"],          # DRM client, likewise
              "drm_client_ids": [3]
            }
          ]
        }
      },
      "stats": {"processes": 312, "descriptors": 4100, "drm_descriptors": 3, "vanished": 0,
                "unreadable": 0, "not_clients": 0, "malformed_lines": 0}
    }

A card bound to a DRM driver appears (with an empty client list) even when nobody uses it;
no client at all is a valid, empty snapshot.  Busy shares of several DRM clients of one name
are summed (capped at 1).  Engine classes: xe ``rcs bcs vcs vecs ccs``; i915 ``render copy
video video-enhance compute``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cardshare.naming import DEFAULT_RULES, CommandRule, Resolver, client_name
from cardshare.procscan import IsDrm, ProcScan, is_drm_char_device, scan_proc
from cardshare.recorder.compute import CardInfo, JsonDict, build_snapshot
from cardshare.recorder.output import (
    DEFAULT_OPS,
    FileOps,
    OutputError,
    append_line,
    atomic_write,
    ensure_dir,
    history_path,
    prometheus_text,
    prune_history,
)

__all__ = [
    "CURRENT",
    "HISTORY",
    "STATE",
    "CardInfo",
    "OutputError",
    "ScanConfig",
    "load_snapshot",
    "load_state",
    "name_processes",
    "read_cards",
    "run_scan",
    "sample",
]

CURRENT = "current.json"
STATE = "state.json"
HISTORY = "history"


@dataclass(frozen=True, slots=True)
class ScanConfig:
    """Everything one scan needs; the defaults are those of a real host."""

    root: str = "/"
    data_dir: Path = Path("/var/lib/cardshare")
    textfile: Path | None = None
    retention_months: int = 12
    rules: tuple[CommandRule, ...] = DEFAULT_RULES
    resolver_factory: Callable[[], Resolver | None] = field(default=lambda: None)
    is_drm: IsDrm = is_drm_char_device
    ops: FileOps = DEFAULT_OPS


def _read_first_line(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.readline().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _parse_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text, 0)
    except ValueError:
        return None


def read_cards(root: str) -> dict[str, CardInfo]:
    """PCI devices bound to a DRM driver, with the driver and (xe) the VRAM size from sysfs.

    Accepts the directory layout of the simulation and the symlinks of a real host.
    """
    devices = os.path.join(root, "sys", "bus", "pci", "devices")
    try:
        names = sorted(os.listdir(devices))
    except OSError:
        return {}
    cards: dict[str, CardInfo] = {}
    for name in names:
        base = os.path.join(devices, name)
        if not os.path.isdir(os.path.join(base, "drm")):
            continue
        try:
            driver: str | None = os.path.basename(os.readlink(os.path.join(base, "driver")))
        except OSError:
            driver = None
        total = 0
        found = False
        try:
            tiles = sorted(t for t in os.listdir(base) if t.startswith("tile"))
        except OSError:
            tiles = []
        for tile in tiles:
            size = _parse_int(
                _read_first_line(os.path.join(base, tile, "physical_vram_size_bytes"))
            )
            if size is not None:
                total += size
                found = True
        cards[name] = CardInfo(driver=driver, vram_total=total if found else None)
    return cards


def name_processes(
    scan: ProcScan, rules: tuple[CommandRule, ...], resolver: Resolver | None
) -> dict[int, str]:
    """The display name of every process holding a DRM client."""
    return {
        pid: client_name(proc.container, proc.comm, proc.cmdline, rules, resolver)
        for pid, proc in scan.processes.items()
    }


def _host_name(root: str) -> str:
    name = _read_first_line(os.path.join(root, "proc", "sys", "kernel", "hostname"))
    return name or socket.gethostname()


def sample(
    root: str,
    rules: tuple[CommandRule, ...],
    resolver: Resolver | None,
    prev_state: Mapping[str, Any] | None,
    now_ns: int | None = None,
    is_drm: IsDrm = is_drm_char_device,
) -> tuple[JsonDict, JsonDict]:
    """Scan once and return ``(snapshot, state)``; writes nothing."""
    try:
        scan = scan_proc(root, is_drm)
    except OSError as exc:
        path = os.path.join(root, "proc")
        raise OutputError(f"cannot scan {path}: {exc.strerror or exc}") from None
    names = name_processes(scan, rules, resolver)
    boot_id = _read_first_line(os.path.join(root, "proc", "sys", "kernel", "random", "boot_id"))
    return build_snapshot(
        scan,
        names,
        read_cards(root),
        prev_state,
        time.time_ns() if now_ns is None else now_ns,
        _host_name(root),
        boot_id,
    )


def load_state(path: Path) -> dict[str, Any] | None:
    """The previous scan's state, or ``None`` when missing or unreadable (a fresh start)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_snapshot(path: Path) -> dict[str, Any]:
    """Read a ``current.json``; ``OutputError`` names the path when it cannot be used."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise OutputError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise OutputError(f"cannot read {path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("cards"), dict):
        raise OutputError(f"cannot read {path}: not a cardshare snapshot")
    return data


def _dumps(doc: Mapping[str, Any], pretty: bool) -> bytes:
    if pretty:
        return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
    return (json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n").encode()


def run_scan(config: ScanConfig, now_ns: int | None = None) -> JsonDict:
    """One scan with all its outputs; raises ``OutputError`` naming the path on failure.

    Order: ``current.json`` first (what the arbiter reads), then the history line, the state,
    the textfile and the retention.  A failure leaves the previous ``current.json`` intact.
    """
    data_dir = config.data_dir
    history_dir = data_dir / HISTORY
    ensure_dir(data_dir)
    ensure_dir(history_dir)
    prev = load_state(data_dir / STATE)
    snapshot, state = sample(
        config.root, config.rules, config.resolver_factory(), prev, now_ns, config.is_drm
    )
    atomic_write(data_dir / CURRENT, _dumps(snapshot, pretty=True), config.ops)
    year, month = (int(x) for x in snapshot["timestamp"][:7].split("-"))
    append_line(history_path(history_dir, year, month), _dumps(snapshot, False), config.ops)
    atomic_write(data_dir / STATE, _dumps(state, pretty=False), config.ops)
    if config.textfile is not None:
        atomic_write(config.textfile, prometheus_text(snapshot).encode(), config.ops)
    prune_history(history_dir, year, month, config.retention_months)
    return snapshot
