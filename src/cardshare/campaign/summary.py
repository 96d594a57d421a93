"""The re-encode campaign's month, for the recorder's report (``cardshare report``).

Read from the campaign's own database, opened read-only (the service keeps writing it): files
replaced in the month and the bytes they won back, the encoding time they took, files that
failed in the month (their originals kept), and what is queued now. Months are UTC, as the
recorder's history files are. Standard library only: it ships in the recorder's zipapp.
"""

from __future__ import annotations

import calendar
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cardshare.sqlitestore import open_readonly

__all__ = [
    "CampaignMonth",
    "CampaignSummaryError",
    "format_campaign_line",
    "human_bytes",
    "read_campaign_month",
]

# the service's database under its state directory (CampaignConfig.db_path)
DATABASE = "campaign.sqlite3"


class CampaignSummaryError(Exception):
    """The campaign's database exists but cannot be read."""


@dataclass(frozen=True, slots=True)
class CampaignMonth:
    month: str
    done: int
    saved_bytes: int
    encode_seconds: float
    failed: int
    queued_now: int
    held_bytes_now: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "month": self.month,
            "done": self.done,
            "saved_bytes": self.saved_bytes,
            "encode_seconds": round(self.encode_seconds, 1),
            "failed": self.failed,
            "queued_now": self.queued_now,
            "held_bytes_now": self.held_bytes_now,
        }


def _bounds(month: str) -> tuple[float, float]:
    year, mon = (int(x) for x in month.split("-"))
    start = calendar.timegm((year, mon, 1, 0, 0, 0))
    end = calendar.timegm((year + mon // 12, mon % 12 + 1, 1, 0, 0, 0))
    return float(start), float(end)


def read_campaign_month(database: Path, month: str) -> CampaignMonth | None:
    """The month ``YYYY-MM`` of the campaign at ``database``; None when there is no database
    (no campaign on this host). Raises :class:`CampaignSummaryError` when it cannot be read."""
    if not database.exists():
        return None
    start, end = _bounds(month)
    try:
        conn = open_readonly(database)
        try:
            done, saved, seconds = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(size - new_size), 0),"
                " COALESCE(SUM(encode_seconds), 0)"
                " FROM files WHERE state = 'done' AND done_at >= ? AND done_at < ?",
                (start, end),
            ).fetchone()
            (failed,) = conn.execute(
                "SELECT COUNT(*) FROM files"
                " WHERE state = 'failed' AND updated >= ? AND updated < ?",
                (start, end),
            ).fetchone()
            queued, held = conn.execute(
                "SELECT COALESCE(SUM(state IN ('queued', 'encoding')), 0),"
                " COALESCE(SUM(CASE WHEN state = 'done' AND held_path IS NOT NULL AND purged = 0"
                " THEN size ELSE 0 END), 0) FROM files"
            ).fetchone()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise CampaignSummaryError(f"{database}: {exc}") from exc
    return CampaignMonth(month, done, saved, float(seconds), failed, queued, held)


def human_bytes(n: float) -> str:
    """Bytes as a user reads a library: GB, or MB below one GB (a first short file's saving
    would read 0.0 GB). The campaign's status and the report's line both use it."""
    return f"{n / 1e9:.1f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.0f} MB"


def format_campaign_line(summary: CampaignMonth) -> str:
    """One line for the report's text form."""
    saved, held = human_bytes(summary.saved_bytes), human_bytes(summary.held_bytes_now)
    line = (
        f"re-encode campaign: {summary.done} file(s) replaced, {saved} won back"
        f" in {summary.encode_seconds / 60:.1f} min of encoding"
    )
    if summary.failed:
        line += f"; {summary.failed} failed (originals kept; `cardshare campaign status` says why)"
    line += f"; now {summary.queued_now} queued, {held} of originals held"
    return line
