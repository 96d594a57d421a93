"""Issue 9: one scan at a time (flock), closed months gzipped and read back transparently."""

from __future__ import annotations

import errno
import fcntl
import gzip
import json
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cardshare.naming import DEFAULT_RULES
from cardshare.recorder import ScanConfig, run_scan
from cardshare.recorder.output import (
    FileOps,
    OutputError,
    compress_closed_months,
    expired_history,
    prune_history,
    scan_lock,
)
from cardshare.recorder.report import build_report, read_month

S = 1_000_000_000
SEPT = 1_790_424_000 * S  # 2026-09-26T12:00:00Z
OCT = 1_790_856_000 * S  # 2026-10-01T12:00:00Z


def _config(rec_tree: Any, make: Callable[..., str], data: Path, **kw: Any) -> ScanConfig:
    rec_tree.card("0000:03:00.0")
    rec_tree.boot_id("b1")
    rec_tree.process(100, comm="Plex Transcoder")
    rec_tree.drm_fd(100, 3, make(8, vram="2 MiB", cycles={"vcs": (0, 1000)}))
    return ScanConfig(
        root=str(rec_tree.root), data_dir=data, rules=DEFAULT_RULES, is_drm=rec_tree.is_drm, **kw
    )


# -- the lock ------------------------------------------------------------------------------


def test_second_scan_gives_up_with_a_clear_message(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    config = _config(rec_tree, rec_make_fdinfo, data, lock_timeout=0.2)
    with open(data / "scan.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(OutputError) as info:
            run_scan(config, SEPT)
    assert str(info.value) == f"another scan holds {data / 'scan.lock'}; gave up after 0.2 s"
    assert not (data / "current.json").exists()  # it wrote nothing
    run_scan(config, SEPT)  # released: the next scan runs
    assert (data / "current.json").exists()


def test_second_scan_waits_for_the_first(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    config = _config(rec_tree, rec_make_fdinfo, data, lock_timeout=10.0)
    held = open(data / "scan.lock", "w")  # noqa: SIM115 - closed by the timer thread
    fcntl.flock(held, fcntl.LOCK_EX)
    timer = threading.Timer(0.3, held.close)
    timer.start()
    try:
        snapshot = run_scan(config, SEPT)
    finally:
        timer.join()
    assert snapshot["timestamp"] == "2026-09-26T12:00:00Z"


def test_scan_lock_is_released_by_an_error(tmp_path: Path) -> None:
    path = tmp_path / "scan.lock"
    with pytest.raises(RuntimeError), scan_lock(path, 0.0):
        raise RuntimeError("scan failed")
    with scan_lock(path, 0.0):
        pass


def test_scan_lock_on_an_unwritable_place(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "scan.lock"
    with pytest.raises(OutputError) as info, scan_lock(path, 0.0):
        pass
    assert str(info.value) == f"cannot open lock file {path}: No such file or directory"


# -- closed months are gzipped ---------------------------------------------------------------


def test_first_scan_of_a_month_compresses_the_previous(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    config = _config(rec_tree, rec_make_fdinfo, data)
    run_scan(config, SEPT)
    run_scan(config, SEPT + 60 * S)
    september = (data / "history" / "2026-09.jsonl").read_bytes()
    run_scan(config, OCT)
    history = data / "history"
    assert sorted(os.listdir(history)) == ["2026-09.jsonl.gz", "2026-10.jsonl"]
    assert gzip.decompress((history / "2026-09.jsonl.gz").read_bytes()) == september
    snapshots, bad = read_month(history, "2026-09")
    assert ([s["timestamp"] for s in snapshots], bad) == (
        ["2026-09-26T12:00:00Z", "2026-09-26T12:01:00Z"],
        0,
    )
    report = build_report("2026-09", snapshots, bad)
    assert [c["name"] for c in report.as_dict()["clients"]] == ["plex"]
    assert [s["timestamp"] for s in read_month(history, "2026-10")[0]] == ["2026-10-01T12:00:00Z"]


def test_compression_is_reproducible_and_merges_late_lines(tmp_path: Path) -> None:
    line = json.dumps({"timestamp_unix": 1.0, "timestamp": "a", "cards": {}}) + "\n"
    late = json.dumps({"timestamp_unix": 2.0, "timestamp": "b", "cards": {}}) + "\n"
    (tmp_path / "2026-08.jsonl").write_text(line)
    (tmp_path / "2026-09.jsonl").write_text(line)
    (tmp_path / "2026-10.jsonl").write_text(line)  # the current month stays plain
    (tmp_path / "notes.txt").write_text("x")
    assert compress_closed_months(tmp_path, 2026, 10) == [
        tmp_path / "2026-08.jsonl.gz",
        tmp_path / "2026-09.jsonl.gz",
    ]
    first = (tmp_path / "2026-09.jsonl.gz").read_bytes()
    assert first == (tmp_path / "2026-08.jsonl.gz").read_bytes()  # no name, no mtime inside
    # a line appended to a closed month (the clock stepped back) joins its archive
    (tmp_path / "2026-09.jsonl").write_text(late)
    compress_closed_months(tmp_path, 2026, 10)
    assert gzip.decompress((tmp_path / "2026-09.jsonl.gz").read_bytes()) == (line + late).encode()
    assert sorted(os.listdir(tmp_path)) == [
        "2026-08.jsonl.gz",
        "2026-09.jsonl.gz",
        "2026-10.jsonl",
        "notes.txt",
    ]


def test_read_month_reads_both_files_once(tmp_path: Path) -> None:
    a = json.dumps({"timestamp_unix": 1.0, "timestamp": "a", "cards": {}}) + "\n"
    b = json.dumps({"timestamp_unix": 2.0, "timestamp": "b", "cards": {}}) + "\n"
    (tmp_path / "2026-09.jsonl.gz").write_bytes(gzip.compress((a + b).encode()))
    (tmp_path / "2026-09.jsonl").write_text(b + "torn{\n")  # died before removing the plain
    snapshots, bad = read_month(tmp_path, "2026-09")
    assert ([s["timestamp"] for s in snapshots], bad) == (["a", "b"], 1)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "no history for 2026-09: {dir}/2026-09.jsonl does not exist"),
        (
            {"2026-09.jsonl.gz": b"not gzip"},
            "cannot read {dir}/2026-09.jsonl.gz: Not a gzipped file (b'no')",
        ),
        (
            {"2026-09.jsonl.gz": gzip.compress(b'{"a": 1}\n' * 100)[:-12]},
            "cannot read {dir}/2026-09.jsonl.gz: Compressed file ended before the "
            "end-of-stream marker was reached",
        ),
    ],
)
def test_read_month_failures(tmp_path: Path, files: dict[str, bytes], message: str) -> None:
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with pytest.raises(OutputError) as info:
        read_month(tmp_path, "2026-09")
    assert str(info.value) == message.format(dir=tmp_path)


def test_compression_on_a_full_disk_keeps_the_plain_month(tmp_path: Path) -> None:
    (tmp_path / "2026-08.jsonl").write_text('{"x": 1}\n' * 1000)

    def full(fd: int, payload: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OutputError) as info:
        compress_closed_months(tmp_path, 2026, 9, FileOps(write=full))
    assert str(info.value) == f"cannot write {tmp_path}/2026-08.jsonl.gz: No space left on device"
    assert sorted(os.listdir(tmp_path)) == ["2026-08.jsonl"]


def test_a_damaged_archive_stops_the_merge(tmp_path: Path) -> None:
    (tmp_path / "2026-08.jsonl.gz").write_bytes(b"garbage")
    (tmp_path / "2026-08.jsonl").write_text("{}\n")
    with pytest.raises(OutputError) as info:
        compress_closed_months(tmp_path, 2026, 9)
    assert str(info.value) == (
        f"cannot read {tmp_path}/2026-08.jsonl.gz: Not a gzipped file (b'ga')"
    )
    assert sorted(os.listdir(tmp_path)) == ["2026-08.jsonl", "2026-08.jsonl.gz"]


def test_retention_removes_archives_too(tmp_path: Path) -> None:
    names = ["2026-06.jsonl.gz", "2026-07.jsonl.gz", "2026-07.jsonl", "2026-08.jsonl.gz"]
    assert expired_history(names, 2026, 9, 2) == [
        "2026-06.jsonl.gz",
        "2026-07.jsonl",
        "2026-07.jsonl.gz",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    prune_history(tmp_path, 2026, 9, 2)
    assert sorted(os.listdir(tmp_path)) == ["2026-08.jsonl.gz"]


def test_full_disk_during_compression_keeps_current(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], tmp_path: Path
) -> None:
    """The scan's own outputs are written before the compression; it fails loudly after."""
    data = tmp_path / "data"
    config = _config(rec_tree, rec_make_fdinfo, data)
    run_scan(config, SEPT)
    calls = {"n": 0}

    def fail_after_three(fd: int, payload: bytes) -> int:
        calls["n"] += 1
        if calls["n"] > 3:  # current.json, history line, state.json
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, payload)

    with pytest.raises(OutputError):
        run_scan(replace(config, ops=FileOps(write=fail_after_three)), OCT)
    assert json.loads((data / "current.json").read_text())["timestamp"] == "2026-10-01T12:00:00Z"
    assert sorted(os.listdir(data / "history")) == ["2026-09.jsonl", "2026-10.jsonl"]
    run_scan(config, OCT + 60 * S)  # the next scan finishes the job
    assert sorted(os.listdir(data / "history")) == ["2026-09.jsonl.gz", "2026-10.jsonl"]
