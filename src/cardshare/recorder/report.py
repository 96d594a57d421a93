"""A month of history, per client: minutes active per engine class, peak and mean VRAM.

Each history line (a snapshot) stands for the interval since the previous scan: its
``interval_seconds`` when recorded, else the gap to the previous line; capped at
``max_interval`` so a host that was down does not count as busy.  A client is *active* on an
engine class in a scan when its busy share there is above 0.  ``busy_minutes`` weighs the
interval by the share.  VRAM mean is over the scans where the client was present.

A month's history is ``history/YYYY-MM.jsonl`` while open and ``history/YYYY-MM.jsonl.gz``
once closed (the scan compresses it); :func:`read_month` reads either or both, transparently.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cardshare.recorder.output import OutputError

__all__ = [
    "ClientMonth",
    "MonthReport",
    "build_report",
    "format_report",
    "interval_of",
    "parse_lines",
    "read_month",
    "snapshot_of",
]


@dataclass(slots=True)
class ClientMonth:
    """One client on one card over a month."""

    name: str
    card: str
    kind: str = "process"  # "container" or "process" (a host process); lines before: process
    scans: int = 0
    present_seconds: float = 0.0
    active_seconds: dict[str, float] = field(default_factory=dict)
    busy_seconds: dict[str, float] = field(default_factory=dict)
    vram_peak: int = 0
    vram_sum: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "card": self.card,
            "scans": self.scans,
            "minutes_present": round(self.present_seconds / 60, 2),
            "minutes_active": {k: round(v / 60, 2) for k, v in sorted(self.active_seconds.items())},
            "busy_minutes": {k: round(v / 60, 2) for k, v in sorted(self.busy_seconds.items())},
            "vram_peak_bytes": self.vram_peak,
            "vram_mean_bytes": self.vram_sum // self.scans if self.scans else 0,
        }


@dataclass(slots=True)
class MonthReport:
    """The report of one month."""

    month: str
    scans: int = 0
    skipped_lines: int = 0
    first: str | None = None
    last: str | None = None
    clients: dict[tuple[str, str, str], ClientMonth] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "month": self.month,
            "scans": self.scans,
            "skipped_lines": self.skipped_lines,
            "first": self.first,
            "last": self.last,
            "clients": [self.clients[k].as_dict() for k in sorted(self.clients)],
        }


def snapshot_of(line: str | bytes) -> dict[str, Any] | None:
    """The snapshot a history line holds (a time and its cards), else None."""
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("cards"), dict):
        return None
    stamp = doc.get("timestamp_unix")
    if isinstance(stamp, bool) or not isinstance(stamp, int | float):
        return None
    return doc


def parse_lines(lines: Iterable[str]) -> tuple[list[dict[str, Any]], int]:
    """Snapshots from history lines, sorted by time, and the count of unusable lines."""
    snapshots: list[dict[str, Any]] = []
    bad = 0
    for line in lines:
        if not line.strip():
            continue
        doc = snapshot_of(line)
        if doc is None:
            bad += 1
            continue
        snapshots.append(doc)
    snapshots.sort(key=lambda d: float(d["timestamp_unix"]))
    return snapshots, bad


def _file_lines(path: Path) -> list[str]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as packed:
            return packed.readlines()
    with open(path, encoding="utf-8", errors="replace") as plain:
        return plain.readlines()


def read_month(history_dir: Path, month: str) -> tuple[list[dict[str, Any]], int]:
    """Snapshots of a month (``YYYY-MM``) from ``YYYY-MM.jsonl.gz`` and/or ``YYYY-MM.jsonl``.

    Both files are read when both exist (a line appended after the month was closed); a line
    in both (a scan died between writing the archive and removing the plain file) counts once:
    snapshot lines are unique by their timestamp, so exact repeats are dropped.

    Raises ``OutputError``: ``no history for 2026-08: <dir>/2026-08.jsonl does not exist``
    when neither file exists, ``cannot read <path>: <reason>`` when one cannot be read (a
    damaged archive included).
    """
    plain = history_dir / f"{month}.jsonl"
    archive = history_dir / f"{month}.jsonl.gz"
    paths = [p for p in (archive, plain) if p.exists()]
    if not paths:
        raise OutputError(f"no history for {month}: {plain} does not exist")
    lines: dict[str, None] = {}
    for path in paths:
        try:
            lines.update(dict.fromkeys(_file_lines(path)))
        except (OSError, EOFError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise OutputError(f"cannot read {path}: {reason}") from None
    return parse_lines(lines)


def interval_of(doc: dict[str, Any], previous: float | None, max_interval: float) -> float:
    recorded = doc.get("interval_seconds")
    if isinstance(recorded, int | float) and recorded > 0:
        seconds = float(recorded)
    elif previous is not None:
        seconds = float(doc["timestamp_unix"]) - previous
    else:
        seconds = 0.0
    return max(0.0, min(seconds, max_interval))


def build_report(
    month: str, snapshots: list[dict[str, Any]], skipped: int = 0, max_interval: float = 120.0
) -> MonthReport:
    """Aggregate sorted snapshots of a month."""
    report = MonthReport(month=month, skipped_lines=skipped)
    previous: float | None = None
    for doc in snapshots:
        seconds = interval_of(doc, previous, max_interval)
        previous = float(doc["timestamp_unix"])
        report.scans += 1
        report.first = report.first or str(doc.get("timestamp"))
        report.last = str(doc.get("timestamp"))
        for card, card_doc in doc["cards"].items():
            clients = card_doc.get("clients") if isinstance(card_doc, dict) else None
            for client in clients if isinstance(clients, list) else []:
                if not isinstance(client, dict) or not isinstance(client.get("name"), str):
                    continue
                # a container and a host process of one name are two clients
                kind = client.get("kind")
                kind = kind if kind in ("container", "process") else "process"
                entry = report.clients.setdefault(
                    (client["name"], card, kind), ClientMonth(client["name"], card, kind)
                )
                vram = client.get("vram_bytes")
                vram = vram if isinstance(vram, int) else 0
                entry.scans += 1
                entry.present_seconds += seconds
                entry.vram_peak = max(entry.vram_peak, vram)
                entry.vram_sum += vram
                engines = client.get("engines")
                for cls, ratio in (engines if isinstance(engines, dict) else {}).items():
                    entry.active_seconds.setdefault(cls, 0.0)
                    entry.busy_seconds.setdefault(cls, 0.0)
                    if isinstance(ratio, int | float) and ratio > 0:
                        entry.active_seconds[cls] += seconds
                        entry.busy_seconds[cls] += seconds * float(ratio)
    return report


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def format_report(report: MonthReport) -> str:
    """A plain-text table of the report."""
    lines = [
        f"month {report.month}: {report.scans} scans"
        + (f" from {report.first} to {report.last}" if report.first else "")
        + (f", {report.skipped_lines} unreadable lines skipped" if report.skipped_lines else "")
    ]
    if not report.clients:
        lines.append("no clients recorded")
        return "\n".join(lines) + "\n"
    header = (
        "CLIENT",
        "KIND",
        "CARD",
        "PRESENT MIN",
        "ACTIVE MIN PER ENGINE",
        "VRAM PEAK",
        "VRAM MEAN",
    )
    rows = [header]
    for key in sorted(report.clients):
        c = report.clients[key]
        active = " ".join(f"{k}={v / 60:.1f}" for k, v in sorted(c.active_seconds.items()))
        mean = c.vram_sum // c.scans if c.scans else 0
        rows.append(
            (
                c.name,
                c.kind,
                c.card,
                f"{c.present_seconds / 60:.1f}",
                active or "-",
                _gib(c.vram_peak),
                _gib(mean),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines.extend(
        "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
    return "\n".join(lines) + "\n"
