"""The recorder: who is on each DRM card, by container or command, scan after scan.

One scan (:func:`run_scan`, what ``cardshare scan`` and the systemd timer run) reads
``<root>/proc`` (:mod:`cardshare.recorder.scan`), names each client (:mod:`cardshare.naming`),
computes memory and per-engine busy shares since the previous scan
(:mod:`cardshare.recorder.compute`) and writes, under the data directory:

``current.json``
    the latest snapshot, replaced atomically (temp file, fsync, rename);
``history/YYYY-MM.jsonl``
    one snapshot per line (same schema, compact), appended in one write; the month is the
    scan's UTC month; a closed month (any month before the scan's) is gzipped to
    ``history/YYYY-MM.jsonl.gz`` by the next scan (measured on a synthetic month of one scan
    a minute, four clients on one card, random busy shares: 43,200 lines of about 1.7 KB,
    75 MB plain, 7.0 MB gzipped, 3.3 s to compress on one core);
    months older than the retention are removed, plain or gzipped;
``state.json``
    the raw engine counters of the previous scan (``{"version", "timestamp_ns",
    "boottime_ns", "boot_id", "clients": {"<pdev>/<client-id>": {"cycles": {...},
    "total_cycles": {...}, "busy_ns": {...}, "capacity": {...}}}}``; ``capacity`` only when
    some class has more than one engine), replaced atomically;
``scan.lock``
    held with ``flock`` for the whole scan: a second scan waits up to
    :attr:`ScanConfig.lock_timeout` seconds, then fails naming the lock;

and optionally a Prometheus textfile (``cardshare_client_vram_bytes{client,card}``,
``cardshare_client_engine_busy_ratio{client,card,engine}``, the raw engine counters as
counters ``cardshare_drm_client_engine_{cycles,total_cycles,busy_seconds}_total
{card,client,drm_client_id,engine}``, ``cardshare_scan_timestamp_seconds`` and more, see
:func:`output.prometheus_text`).

Time: the snapshot's timestamp is wall-clock time; the interval between two scans (busy
shares of drivers reporting nanoseconds, ``interval_seconds``) is measured on the boot-time
clock (``CLOCK_BOOTTIME``, which does not jump with NTP and counts suspend).  A different
boot id (``<root>/proc/sys/kernel/random/boot_id``) or a boot-time clock that went backwards
means a reboot in between: the interval and its busy shares are discarded (null).

Snapshot schema (``schema`` 1)::

    {
      "schema": 1,
      "timestamp": "2026-09-26T12:00:00Z",      # scan time, UTC
      "timestamp_unix": 1790424000.0,
      "interval_seconds": 60.0,                 # since the previous scan (boot-time clock);
                                                # null on the first and after a reboot
      "host": "devastator",
      "cards": {
        "0000:03:00.0": {                       # drm-pdev (PCI address)
          "driver": "xe",
          "vram_total_bytes": 34359738368,      # from sysfs; null when unknown
          "vram_used_bytes": 30000000000,       # all DRM clients: private bytes summed,
                                                # shared buffers counted once (see below)
          "vram_shared_bytes": 16777216,        # the shared part counted in vram_used_bytes
          "clients": [                          # one entry per name and kind, sorted so
            {
              "name": "llm/vllm",               # compose project/service, container, rule, comm
              "kind": "container",              # named by a process in a container, else
                                                # "process" (a host process): two clients
                                                # of one name and different kinds stay two
              "vram_bytes": 29000000000,        # resident VRAM regions (xe vram*, i915 local*,
                                                # amdgpu vram), shared buffers included
              "vram_shared_bytes": 16777216,    # part of it shared with another DRM file
              "system_bytes": 0,                # resident host RAM regions (xe system, i915
                                                # system0, amdgpu cpu, generic memory)
              "gtt_bytes": 196608,              # resident GTT regions (xe, amdgpu gtt)
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
                "unreadable": 0, "not_clients": 0, "malformed_lines": 0,
                "unreadable_processes": 0, "reused": 0, "fdinfo_reads": 2,
                "fdinfo_reads_saved": 1}
    }

A card bound to a DRM driver appears (with an empty client list) even when nobody uses it;
no client at all is a valid, empty snapshot.  Busy shares of several DRM clients of one name
are summed (capped at 1).  Region classes per driver: :data:`cardshare.fdinfo.REGION_TABLE`.

Shared buffers: ``drm-resident-<r>`` of a DRM file includes the buffers it shares with other
DRM files (``drm-shared-<r>``, capped at the resident figure here), so the clients' figures
add a shared buffer once per client holding it.  A client's ``vram_bytes`` keeps it (the
client does hold that memory); the card's ``vram_used_bytes`` is the private VRAM of every DRM
client plus the largest shared amount of any one DRM client, which counts each shared buffer
once when the clients share the same buffers, and is a lower bound otherwise (fdinfo does not
say which buffers are shared with whom): the true figure lies between it and the sum of the
clients' ``vram_bytes``.  Engine classes: xe ``rcs bcs vcs vecs ccs``; i915 ``render copy
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
from cardshare.recorder.compute import CardInfo, JsonDict, build_snapshot
from cardshare.recorder.output import (
    DEFAULT_OPS,
    FileOps,
    OutputError,
    append_line,
    atomic_write,
    compress_closed_months,
    ensure_dir,
    history_path,
    prometheus_text,
    prune_history,
    scan_lock,
)
from cardshare.recorder.procfs import IsDrm, is_drm_char_device
from cardshare.recorder.results import ProcScan
from cardshare.recorder.scan import scan_proc

__all__ = [
    "CURRENT",
    "HISTORY",
    "LOCK",
    "STATE",
    "CardInfo",
    "OutputError",
    "ScanConfig",
    "boottime_ns",
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
LOCK = "scan.lock"


def boottime_ns() -> int | None:
    """``CLOCK_BOOTTIME`` in nanoseconds: monotonic, counts suspend, never set by NTP."""
    try:
        return time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):  # not Linux
        return None


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
    lock_timeout: float = 30.0
    wall_clock: Callable[[], int] = field(default=time.time_ns)
    boot_clock: Callable[[], int | None] = field(default=boottime_ns)


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
    """The display name of every process that may name a DRM client (those whose command
    line the scan read: it reads it for each client's naming process)."""
    return {
        pid: client_name(proc.container, proc.comm, proc.cmdline, rules, resolver)
        for pid, proc in scan.processes.items()
        if proc.cmdline is not None
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
    boot_ns: int | None = None,
) -> tuple[JsonDict, JsonDict]:
    """Scan once and return ``(snapshot, state)``; writes nothing.

    Without ``now_ns`` both clocks are read here; with an injected ``now_ns`` the boot-time
    clock is only what ``boot_ns`` says (``None``: the interval falls back to wall time).
    """
    if now_ns is None:
        now_ns = time.time_ns()
        boot_ns = boottime_ns() if boot_ns is None else boot_ns
    try:
        # every holder's details: a broker (logind) holding a session's descriptor must not
        # name the client (naming.naming_pid)
        scan = scan_proc(root, is_drm, every_holder=True)
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
        now_ns,
        _host_name(root),
        boot_id,
        boot_ns,
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

    The whole scan holds ``scan.lock`` (a concurrent scan waits, then fails).  Order:
    ``current.json`` first (what the arbiter reads), then the history line, the state, the
    textfile, the retention and the compression of closed months.  A failure leaves the
    previous ``current.json`` intact.  Clocks come from ``config`` unless ``now_ns`` is
    given (then the interval is on wall time, as :func:`sample` says).
    """
    data_dir = config.data_dir
    history_dir = data_dir / HISTORY
    ensure_dir(data_dir)
    with scan_lock(data_dir / LOCK, config.lock_timeout):
        ensure_dir(history_dir)
        prev = load_state(data_dir / STATE)
        boot_ns = None
        if now_ns is None:
            now_ns = config.wall_clock()
            boot_ns = config.boot_clock()
        snapshot, state = sample(
            config.root,
            config.rules,
            config.resolver_factory(),
            prev,
            now_ns,
            config.is_drm,
            boot_ns,
        )
        atomic_write(data_dir / CURRENT, _dumps(snapshot, pretty=True), config.ops)
        year, month = (int(x) for x in snapshot["timestamp"][:7].split("-"))
        append_line(history_path(history_dir, year, month), _dumps(snapshot, False), config.ops)
        atomic_write(data_dir / STATE, _dumps(state, pretty=False), config.ops)
        if config.textfile is not None:
            atomic_write(config.textfile, prometheus_text(snapshot, state).encode(), config.ops)
        prune_history(history_dir, year, month, config.retention_months)
        compress_closed_months(history_dir, year, month, config.ops)
    return snapshot
