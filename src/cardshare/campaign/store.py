"""The campaign's queue (SQLite): every file seen, its state, sizes and the reason.

States of a file::

    queued ──start──> encoding ──verified, replaced──> done
       ^                 │
       │                 ├──the result failed a check──> failed (original kept, reason)
       └─────────────────┴──interrupted, paused too long, changed, disk full, encoder error
                            (the original untouched; retried, an encoder error at most
                            ``max_attempts`` times, then failed)
    skipped: not selected (reason); examined again when its size or mtime changes
    unreadable: ffprobe could not read it (reason); likewise

The temporary output's path is written before the encoder starts, and the holding path
before the original is linked there, so a campaign killed at any moment finds, at its next
start, what to remove (:meth:`Store.interrupted`).
"""

from __future__ import annotations

import sqlite3
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from cardshare.sqlitestore import open_store, transaction

__all__ = ["FileRow", "FileState", "Store"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    path TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    new_path TEXT,
    new_size INTEGER,
    new_mtime_ns INTEGER,
    temp_path TEXT,
    held_path TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    retry_after REAL NOT NULL DEFAULT 0,
    encode_seconds REAL,
    updated REAL NOT NULL,
    done_at REAL,
    purged INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS files_state ON files (state);
"""


class FileState(StrEnum):
    QUEUED = "queued"
    ENCODING = "encoding"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"
    UNREADABLE = "unreadable"


@dataclass(frozen=True, slots=True)
class FileRow:
    path: str
    state: FileState
    reason: str
    size: int
    mtime_ns: int
    new_path: str | None
    new_size: int | None
    new_mtime_ns: int | None
    temp_path: str | None
    held_path: str | None
    attempts: int
    retry_after: float
    encode_seconds: float | None
    updated: float
    done_at: float | None
    purged: bool


_COLUMNS = (
    "path, state, reason, size, mtime_ns, new_path, new_size, new_mtime_ns, temp_path, "
    "held_path, attempts, retry_after, encode_seconds, updated, done_at, purged"
)


def _row(raw: tuple[Any, ...]) -> FileRow:
    values = list(raw)
    values[1] = FileState(values[1])
    values[15] = bool(values[15])
    return FileRow(*values)


class Store:
    def __init__(self, path: Path, clock: Any = time.time) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.conn = open_store(path, SCHEMA, check_same_thread=False)

    def close(self) -> None:
        self.conn.close()

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        return transaction(self.conn)

    def get(self, path: str) -> FileRow | None:
        raw = self.conn.execute(f"SELECT {_COLUMNS} FROM files WHERE path = ?", (path,)).fetchone()
        return None if raw is None else _row(raw)

    def by_result(self, new_path: str) -> FileRow | None:
        raw = self.conn.execute(
            f"SELECT {_COLUMNS} FROM files WHERE new_path = ? AND state = ?",
            (new_path, FileState.DONE.value),
        ).fetchone()
        return None if raw is None else _row(raw)

    def rows(self, state: FileState | None = None) -> list[FileRow]:
        if state is None:
            raws = self.conn.execute(f"SELECT {_COLUMNS} FROM files ORDER BY path").fetchall()
        else:
            raws = self.conn.execute(
                f"SELECT {_COLUMNS} FROM files WHERE state = ? ORDER BY path", (state.value,)
            ).fetchall()
        return [_row(r) for r in raws]

    def seen(self, path: str, state: FileState, reason: str, size: int, mtime_ns: int) -> None:
        """A file examined by a scan (new, or changed since it was last examined)."""
        with self._tx() as c:
            c.execute(
                "INSERT INTO files (path, state, reason, size, mtime_ns, updated) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(path) DO UPDATE SET state = excluded.state,"
                " reason = excluded.reason, size = excluded.size, mtime_ns = excluded.mtime_ns,"
                " attempts = 0, retry_after = 0, updated = excluded.updated",
                (path, state.value, reason, size, mtime_ns, self.clock()),
            )

    def next_queued(self, now: float) -> FileRow | None:
        raw = self.conn.execute(
            f"SELECT {_COLUMNS} FROM files WHERE state = ? AND retry_after <= ?"
            " ORDER BY size DESC, path LIMIT 1",
            (FileState.QUEUED.value, now),
        ).fetchone()
        return None if raw is None else _row(raw)

    def start(self, path: str, temp_path: str) -> None:
        self._set(path, state=FileState.ENCODING.value, temp_path=temp_path, reason="encoding")

    def set_held(self, path: str, held_path: str) -> None:
        self._set(path, held_path=held_path)

    def requeue(
        self, path: str, reason: str, retry_after: float = 0.0, attempt: bool = False
    ) -> None:
        with self._tx() as c:
            c.execute(
                "UPDATE files SET state = ?, reason = ?, retry_after = ?, temp_path = NULL,"
                " attempts = attempts + ?, updated = ? WHERE path = ?",
                (FileState.QUEUED.value, reason, retry_after, int(attempt), self.clock(), path),
            )

    def fail(self, path: str, reason: str) -> None:
        self._set(path, state=FileState.FAILED.value, reason=reason, temp_path=None, held_path=None)

    def done(
        self,
        path: str,
        new_path: str,
        new_size: int,
        new_mtime_ns: int,
        held: str | None,
        seconds: float,
    ) -> None:
        self._set(
            path,
            state=FileState.DONE.value,
            reason="replaced",
            new_path=new_path,
            new_size=new_size,
            new_mtime_ns=new_mtime_ns,
            held_path=held,
            temp_path=None,
            encode_seconds=seconds,
            done_at=self.clock(),
        )

    def purged(self, path: str) -> None:
        self._set(path, purged=1)

    def interrupted(self) -> list[FileRow]:
        """Files a killed campaign left in ``encoding``."""
        return self.rows(FileState.ENCODING)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in FileState}
        for state, n in self.conn.execute("SELECT state, COUNT(*) FROM files GROUP BY state"):
            out[str(state)] = int(n)
        return out

    def totals(self) -> dict[str, float]:
        row = self.conn.execute(
            "SELECT COALESCE(SUM(size - new_size), 0), COALESCE(SUM(size), 0),"
            " COALESCE(SUM(CASE WHEN purged = 0 AND held_path IS NOT NULL THEN size END), 0)"
            " FROM files WHERE state = ?",
            (FileState.DONE.value,),
        ).fetchone()
        queued = self.conn.execute(
            "SELECT COALESCE(SUM(size), 0) FROM files WHERE state IN (?, ?)",
            (FileState.QUEUED.value, FileState.ENCODING.value),
        ).fetchone()
        return {
            "saved_bytes": float(row[0]),
            "done_source_bytes": float(row[1]),
            "held_bytes": float(row[2]),
            "queued_bytes": float(queued[0]),
        }

    def recent_rate(self, since: float) -> float | None:
        """Source bytes re-encoded per second of encoding, over files done since ``since``."""
        row = self.conn.execute(
            "SELECT SUM(size), SUM(encode_seconds) FROM files WHERE state = ? AND done_at >= ?"
            " AND encode_seconds > 0",
            (FileState.DONE.value, since),
        ).fetchone()
        return None if not row[1] else float(row[0]) / float(row[1])

    def _set(self, path: str, **values: Any) -> None:
        values["updated"] = self.clock()
        assigns = ", ".join(f"{k} = ?" for k in values)
        with self._tx() as c:
            c.execute(f"UPDATE files SET {assigns} WHERE path = ?", (*values.values(), path))
