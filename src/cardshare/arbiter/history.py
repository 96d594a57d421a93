"""The recorder's history as the status page charts it: a day and a month, kept up to date.

The recorder appends one snapshot per scan to ``history/YYYY-MM.jsonl`` and compresses a
closed month to ``YYYY-MM.jsonl.gz`` (:mod:`cardshare.recorder.output`).  A month of scans
once a minute is tens of megabytes, so this reads each file once and then only what was
appended (whole lines; a line still being written waits for the next refresh), and keeps
aggregates, never the snapshots:

* the last day in 5-minute buckets and the last 30 days in hourly buckets, each with every
  client's peak VRAM in the bucket and the card's mean busy share of the render/compute
  engines and of the video engines (a client's share in a group is its busiest class there;
  the card's is the clients' sum, capped at 1);
* per UTC day, the hours during which a transcoding client (Plex) kept a video engine busy.

With the arbiter's card named (``pdev``), only that card's clients count: an iGPU's desktop
or a second card's work is not this card's.

Each snapshot weighs its interval (``interval_seconds``, else the gap to the previous line,
capped as the recorder's report caps it).  A snapshot in both a month's archive and its plain
file (a scan that died between the two) counts once: snapshots are unique by timestamp.  A
file that shrank or was replaced is read again from the start, with everything else.
"""

from __future__ import annotations

import gzip
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cardshare.recorder.report import interval_of, snapshot_of

__all__ = ["ENGINE_GROUPS", "HistoryView", "engine_group"]

# Engine classes by group: xe's and i915's names (see cardshare.recorder).
ENGINE_GROUPS: dict[str, frozenset[str]] = {
    "render": frozenset({"rcs", "ccs", "render", "compute"}),
    "video": frozenset({"vcs", "vecs", "video", "video-enhance"}),
}
_GROUP_OF = {cls: group for group, classes in ENGINE_GROUPS.items() for cls in classes}

DAY_STEP = 300
MONTH_STEP = 3600
DAY_SECONDS = 86400
MONTH_DAYS = 30
MAX_INTERVAL = 120.0
_FILE_RE = re.compile(r"^([0-9]{4})-([0-9]{2})\.jsonl(\.gz)?$")


def engine_group(cls: str) -> str | None:
    """``render``, ``video`` or None (copy engines and unknown classes)."""
    return _GROUP_OF.get(cls)


@dataclass(slots=True)
class _Bucket:
    vram: dict[str, int] = field(default_factory=dict)  # peak per client
    seconds: float = 0.0
    busy: dict[str, float] = field(default_factory=dict)  # group -> share x seconds


@dataclass(slots=True)
class _FileMark:
    key: tuple[int, int]  # (device, inode)
    offset: int  # bytes read (plain files), or the size read (archives)
    mtime_ns: int


class HistoryView:
    """Aggregates of the recorder's history directory (see the module's text)."""

    def __init__(
        self,
        history_dir: Path,
        transcode_names: Sequence[str] = (),
        clock: Any = time.time,
        max_interval: float = MAX_INTERVAL,
        pdev: str | None = None,
    ) -> None:
        self.history_dir = history_dir
        self.pdev = pdev  # the arbiter's card (config card_pdev); None: every card
        self.transcode_names = frozenset(transcode_names)
        self.clock = clock
        self.max_interval = max_interval
        self.error: str | None = None
        self._reset()

    def _reset(self) -> None:
        self._marks: dict[str, _FileMark] = {}
        self._seen: set[float] = set()
        self._previous: float | None = None
        self._day: dict[int, _Bucket] = {}
        self._month: dict[int, _Bucket] = {}
        self._transcode: dict[str, float] = {}
        self.scans = 0
        self.skipped = 0
        self.last_scan: float | None = None

    # --- reading -------------------------------------------------------------------------

    def _names(self, now: float) -> list[str]:
        """The history files that may hold the last 30 days, oldest month first."""
        try:
            names = os.listdir(self.history_dir)
        except OSError as exc:
            raise OSError(
                f"cannot list {self.history_dir}: {exc.strerror or type(exc).__name__}"
            ) from None
        oldest = time.gmtime(now - (MONTH_DAYS + 1) * DAY_SECONDS)
        first = oldest.tm_year * 12 + oldest.tm_mon
        keep = []
        for name in names:
            m = _FILE_RE.match(name)
            if m and int(m.group(1)) * 12 + int(m.group(2)) >= first:
                # the archive before the plain file of the same month (its older lines)
                keep.append((m.group(1), m.group(2), 0 if m.group(3) else 1, name))
        return [k[3] for k in sorted(keep)]

    def refresh(self) -> None:
        """Read what was appended since the last call; never raises (``error`` says why)."""
        now = float(self.clock())
        try:
            names = self._names(now)
            changed = False
            for name in names:
                path = self.history_dir / name
                st = path.stat()
                mark = self._marks.get(name)
                key = (st.st_dev, st.st_ino)
                if mark is not None and mark.key == key:
                    if name.endswith(".gz"):
                        changed = changed or (st.st_size, st.st_mtime_ns) != (
                            mark.offset,
                            mark.mtime_ns,
                        )
                    elif st.st_size < mark.offset:
                        changed = True
                elif mark is not None:
                    changed = True
            if changed or set(self._marks) - set(names):
                self._reset()
            for name in names:
                self._read(name)
            self._prune(now)
            self.error = None
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            self.error = str(exc) or type(exc).__name__

    def _read(self, name: str) -> None:
        path = self.history_dir / name
        st = path.stat()
        mark = self._marks.get(name)
        if name.endswith(".gz"):
            if mark is not None:
                return
            try:
                with gzip.open(path, "rb") as packed:
                    data = packed.read()
            except (OSError, EOFError) as exc:
                raise OSError(f"cannot read {path}: {exc}") from None
            self._lines(data.splitlines())
            self._marks[name] = _FileMark((st.st_dev, st.st_ino), st.st_size, st.st_mtime_ns)
            return
        offset = mark.offset if mark is not None else 0
        if offset >= st.st_size:
            return
        with open(path, "rb") as plain:
            plain.seek(offset)
            data = plain.read(st.st_size - offset)
        end = data.rfind(b"\n") + 1  # whole lines only: the rest is still being written
        self._lines(data[:end].splitlines())
        self._marks[name] = _FileMark((st.st_dev, st.st_ino), offset + end, st.st_mtime_ns)

    def _lines(self, lines: Iterable[bytes]) -> None:
        for line in lines:
            if not line.strip():
                continue
            doc = snapshot_of(line)
            if doc is None:
                self.skipped += 1
                continue
            stamp = float(doc["timestamp_unix"])
            if stamp in self._seen:
                continue
            self._seen.add(stamp)
            self._add(doc, stamp)

    # --- aggregating ---------------------------------------------------------------------

    def _add(self, doc: dict[str, Any], stamp: float) -> None:
        previous = self._previous if self._previous is not None and self._previous < stamp else None
        seconds = interval_of(doc, previous, self.max_interval)
        self._previous = stamp if self._previous is None else max(self._previous, stamp)
        self.scans += 1
        self.last_scan = stamp if self.last_scan is None else max(self.last_scan, stamp)
        vram: dict[str, int] = {}
        busy = {group: 0.0 for group in ENGINE_GROUPS}
        transcoding = False
        cards = doc["cards"]
        for card in cards.values() if self.pdev is None else (cards.get(self.pdev),):
            clients = card.get("clients") if isinstance(card, dict) else None
            for client in clients if isinstance(clients, list) else []:
                if not isinstance(client, dict) or not isinstance(client.get("name"), str):
                    continue
                name = client["name"]
                amount = client.get("vram_bytes")
                if isinstance(amount, int) and not isinstance(amount, bool) and amount >= 0:
                    vram[name] = vram.get(name, 0) + amount
                engines = client.get("engines")
                mine: dict[str, float] = {}
                for cls, share in (engines if isinstance(engines, dict) else {}).items():
                    group = engine_group(cls)
                    if group is None or isinstance(share, bool):
                        continue
                    if isinstance(share, int | float) and share > 0:
                        mine[group] = max(mine.get(group, 0.0), min(float(share), 1.0))
                for group, share in mine.items():
                    busy[group] += share
                if name in self.transcode_names and mine.get("video", 0.0) > 0:
                    transcoding = True
        for buckets, step in ((self._day, DAY_STEP), (self._month, MONTH_STEP)):
            bucket = buckets.setdefault(int(stamp // step) * step, _Bucket())
            for name, amount in vram.items():
                bucket.vram[name] = max(bucket.vram.get(name, 0), amount)
            bucket.seconds += seconds
            for group, share in busy.items():
                bucket.busy[group] = bucket.busy.get(group, 0.0) + min(share, 1.0) * seconds
        if transcoding:
            day = time.strftime("%Y-%m-%d", time.gmtime(stamp))
            self._transcode[day] = self._transcode.get(day, 0.0) + seconds

    def _prune(self, now: float) -> None:
        for buckets, span in ((self._day, DAY_SECONDS), (self._month, MONTH_DAYS * DAY_SECONDS)):
            for start in [s for s in buckets if s < now - span]:
                del buckets[start]
        oldest = now - (MONTH_DAYS + 1) * DAY_SECONDS
        self._seen = {s for s in self._seen if s >= oldest}
        first_day = time.strftime("%Y-%m-%d", time.gmtime(now - (MONTH_DAYS - 1) * DAY_SECONDS))
        for day in [d for d in self._transcode if d < first_day]:
            del self._transcode[day]

    # --- the document ----------------------------------------------------------------------

    @staticmethod
    def _span(buckets: dict[int, _Bucket], step: int, start: float, end: float) -> dict[str, Any]:
        starts = sorted(s for s in buckets if s >= start - step)
        names = sorted({n for s in starts for n in buckets[s].vram})
        return {
            "step_seconds": step,
            "start": start,
            "end": end,
            "vram_bytes": {
                name: [[s, buckets[s].vram[name]] for s in starts if name in buckets[s].vram]
                for name in names
            },
            "busy_share": {
                group: [
                    [s, round(buckets[s].busy.get(group, 0.0) / buckets[s].seconds, 4)]
                    for s in starts
                    if buckets[s].seconds > 0
                ]
                for group in ENGINE_GROUPS
            },
        }

    def doc(self) -> dict[str, Any]:
        """The charts' data (times in unix seconds, UTC days)."""
        now = float(self.clock())
        days = [
            time.strftime("%Y-%m-%d", time.gmtime(now - back * DAY_SECONDS))
            for back in range(MONTH_DAYS - 1, -1, -1)
        ]
        return {
            "history_dir": str(self.history_dir),
            "error": self.error,
            "scans": self.scans,
            "skipped_lines": self.skipped,
            "last_scan": self.last_scan,
            "transcode_clients": sorted(self.transcode_names),
            "day": self._span(self._day, DAY_STEP, now - DAY_SECONDS, now),
            "month": self._span(self._month, MONTH_STEP, now - MONTH_DAYS * DAY_SECONDS, now),
            "transcode_hours_per_day": [
                [day, round(self._transcode.get(day, 0.0) / 3600, 3)] for day in days
            ],
        }
