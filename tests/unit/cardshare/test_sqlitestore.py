"""The project's one way to open an SQLite database (``cardshare.sqlitestore``): the settings
each store gets, the check at open, the columns added to an older database, the write
transaction, and the read-only open."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from cardshare.arbiter.store import Store as ArbiterStore
from cardshare.arbiter.store import StoreError
from cardshare.campaign.store import Store as CampaignStore
from cardshare.sqlitestore import open_readonly, open_store, transaction

SCHEMA = "CREATE TABLE IF NOT EXISTS items (name TEXT PRIMARY KEY, size INTEGER NOT NULL);"


def damage(path: Path) -> None:
    """A database whose file opens and answers a count, but one of its b-tree pages carries
    garbage (what a torn write or a bad disk leaves)."""
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE filler (text TEXT)")
    conn.executemany("INSERT INTO filler VALUES (?)", [("x" * 100 + str(i),) for i in range(2000)])
    conn.commit()
    conn.close()
    with path.open("r+b") as fh:
        fh.seek(4096 * 5 + 100)
        fh.write(b"\xff" * 200)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT COUNT(*) FROM filler").fetchone() == (2000,)
    conn.close()


def test_a_new_database_gets_the_projects_settings_and_the_schema(tmp_path: Path) -> None:
    conn = open_store(tmp_path / "a.sqlite3", SCHEMA)
    assert conn.isolation_level is None
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert conn.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
    assert conn.execute("PRAGMA busy_timeout").fetchone() == (5000,)
    assert [r[1] for r in conn.execute("PRAGMA table_info(items)")] == ["name", "size"]
    conn.close()


def test_columns_added_since_a_tables_first_release_are_added_once(tmp_path: Path) -> None:
    path = tmp_path / "a.sqlite3"
    old = open_store(path, SCHEMA)
    old.execute("INSERT INTO items VALUES ('one', 1)")
    old.close()
    added = (("items", "tries", "INTEGER NOT NULL DEFAULT 0"), ("items", "note", "TEXT"))
    for _ in range(2):  # the second open finds them there
        conn = open_store(path, SCHEMA, added)
        assert [r[1] for r in conn.execute("PRAGMA table_info(items)")] == [
            "name",
            "size",
            "tries",
            "note",
        ]
        assert conn.execute("SELECT * FROM items").fetchall() == [("one", 1, 0, None)]
        conn.close()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (damage, r"^quick_check says \*\*\* in database main \*\*\*"),
        (lambda p: p.write_bytes(b"not a database, " * 64), r"^file is not a database$"),
    ],
    ids=["damaged page", "not a database"],
)
def test_a_damaged_database_is_refused_at_open_and_left_as_it_is(
    tmp_path: Path, make: object, message: str
) -> None:
    path = tmp_path / "a.sqlite3"
    make(path)  # type: ignore[operator]
    before = path.read_bytes()
    with pytest.raises(sqlite3.DatabaseError, match=message):
        open_store(path, SCHEMA)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.sqlite3"]  # no WAL left behind


def test_both_stores_refuse_a_damaged_database_at_open(tmp_path: Path) -> None:
    """The campaign's store is checked as the arbiter's is: before, it opened a damaged file and
    met the damage at some later read or write."""
    damage(tmp_path / "campaign.sqlite3")
    with pytest.raises(sqlite3.DatabaseError, match=r"^quick_check says \*\*\* in database main"):
        CampaignStore(tmp_path / "campaign.sqlite3")
    damage(tmp_path / "arbiter.sqlite3")
    with pytest.raises(StoreError, match=r"is damaged \(quick_check says \*\*\* in database main"):
        ArbiterStore(tmp_path / "arbiter.sqlite3")


def test_a_transaction_commits_at_its_end_and_rolls_back_on_an_error(tmp_path: Path) -> None:
    path = tmp_path / "a.sqlite3"
    conn = open_store(path, SCHEMA)
    other = open_readonly(path)
    with transaction(conn) as c:
        c.execute("INSERT INTO items VALUES ('one', 1)")
        assert other.execute("SELECT COUNT(*) FROM items").fetchone() == (0,)  # not yet
    assert other.execute("SELECT COUNT(*) FROM items").fetchone() == (1,)
    with pytest.raises(RuntimeError, match="midway"), transaction(conn) as c:
        c.execute("INSERT INTO items VALUES ('two', 2)")
        raise RuntimeError("midway")
    assert not conn.in_transaction
    assert conn.execute("SELECT name FROM items").fetchall() == [("one",)]
    other.close()
    conn.close()


def test_a_store_opened_for_threads_is_usable_from_another_thread(tmp_path: Path) -> None:
    conn = open_store(tmp_path / "a.sqlite3", SCHEMA, check_same_thread=False)
    found: list[object] = []
    thread = threading.Thread(
        target=lambda: found.append(conn.execute("SELECT COUNT(*) FROM items").fetchone())
    )
    thread.start()
    thread.join()
    assert found == [(0,)]
    conn.close()


def test_the_read_only_open_never_writes_nor_creates(tmp_path: Path) -> None:
    path = tmp_path / "a b%.sqlite3"  # quoted into the URI
    open_store(path, SCHEMA).close()
    conn = open_readonly(path)
    assert conn.execute("PRAGMA busy_timeout").fetchone() == (5000,)
    with pytest.raises(sqlite3.OperationalError, match="attempt to write a readonly database"):
        conn.execute("INSERT INTO items VALUES ('one', 1)")
    conn.close()
    with pytest.raises(sqlite3.OperationalError, match="unable to open database file"):
        open_readonly(tmp_path / "missing.sqlite3")
    assert not (tmp_path / "missing.sqlite3").exists()
