"""The one way the project opens an SQLite database (the arbiter's and the campaign's stores,
the report's read-only look at the campaign's). Standard library only: the zipapp packs it.

Autocommit (``isolation_level=None``) with explicit ``BEGIN IMMEDIATE`` transactions; a busy
timeout of :data:`BUSY_TIMEOUT_SECONDS`; ``PRAGMA quick_check`` at open, so a damaged file is
refused before anything is written into it; WAL (readers never block the writer) and
``synchronous=FULL`` (a committed state survives a power cut, not only a crash).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

__all__ = ["BUSY_TIMEOUT_SECONDS", "open_readonly", "open_store", "transaction"]

BUSY_TIMEOUT_SECONDS = 5.0


def open_store(
    path: Path,
    schema: str,
    added_columns: Iterable[tuple[str, str, str]] = (),
    check_same_thread: bool = True,
) -> sqlite3.Connection:
    """Open (or create) ``path``, check it, apply ``schema`` (``CREATE ... IF NOT EXISTS``) and
    add the ``(table, column, definition)`` columns an older database lacks. Raises
    :class:`sqlite3.DatabaseError` for a damaged file."""
    conn = sqlite3.connect(
        str(path),
        timeout=BUSY_TIMEOUT_SECONDS,
        isolation_level=None,
        check_same_thread=check_same_thread,
    )
    try:
        result = conn.execute("PRAGMA quick_check").fetchone()
        if not result or result[0] != "ok":
            raise sqlite3.DatabaseError(f"quick_check says {result[0] if result else 'nothing'}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.executescript(schema)
        for table, name, definition in added_columns:
            have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
            if name not in have:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {definition}")
    except BaseException:
        conn.close()
        raise
    return conn


def open_readonly(path: Path) -> sqlite3.Connection:
    """An existing database, read-only (another process writes it): never created nor written."""
    return sqlite3.connect(
        f"file:{quote(str(path))}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_SECONDS
    )


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction: committed when the block ends, rolled back when it raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
