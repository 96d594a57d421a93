"""Tests of the recorder's outputs: atomic files, whole history lines, textfile, retention."""

from __future__ import annotations

import errno
import json
import os
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
    append_line,
    atomic_write,
    expired_history,
    prometheus_text,
    prune_history,
)

S = 1_000_000_000
SEPT = 1_790_424_000 * S  # 2026-09-26T12:00:00Z


def enospc_write(fd: int, data: bytes) -> int:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def half_write(fd: int, data: bytes) -> int:
    return os.write(fd, data[: len(data) // 2])


def erofs_mkstemp(directory: str, prefix: str) -> tuple[int, str]:
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))


def test_atomic_write_replaces(tmp_path: Path) -> None:
    path = tmp_path / "current.json"
    atomic_write(path, b"one")
    atomic_write(path, b"two")
    assert path.read_bytes() == b"two"
    assert os.listdir(tmp_path) == ["current.json"]
    assert path.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        (FileOps(write=enospc_write), "No space left on device"),
        (FileOps(mkstemp=erofs_mkstemp), "Read-only file system"),
    ],
)
def test_atomic_write_failure_keeps_previous(tmp_path: Path, ops: FileOps, message: str) -> None:
    path = tmp_path / "current.json"
    path.write_bytes(b"previous")
    with pytest.raises(OutputError) as info:
        atomic_write(path, b"new", ops)
    assert str(info.value) == f"cannot write {path}: {message}"
    assert path.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["current.json"]


def test_atomic_write_in_read_only_directory(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions; the EROFS case above covers it")
    path = tmp_path / "current.json"
    path.write_bytes(b"previous")
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(OutputError) as info:
            atomic_write(path, b"new")
    finally:
        tmp_path.chmod(0o755)
    assert str(info.value) == f"cannot write {path}: Permission denied"
    assert path.read_bytes() == b"previous"


def test_append_line(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    append_line(path, b'{"a":1}\n')
    append_line(path, b'{"a":2}\n')
    assert path.read_bytes() == b'{"a":1}\n{"a":2}\n'


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (enospc_write, "No space left on device"),
        (half_write, "short write (4 of 8 bytes)"),
    ],
)
def test_append_line_never_leaves_a_partial_line(
    tmp_path: Path, write: Callable[[int, bytes], int], message: str
) -> None:
    path = tmp_path / "h.jsonl"
    path.write_bytes(b'{"a":1}\n')
    with pytest.raises(OutputError) as info:
        append_line(path, b'{"a":2}\n', FileOps(write=write))
    assert str(info.value) == f"cannot append to {path}: {message}"
    assert path.read_bytes() == b'{"a":1}\n'


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (b'{"a":1}\n{"a', b'{"a":1}\n{"b":1}\n'),
        (b'{"a', b'{"b":1}\n'),
        (b"", b'{"b":1}\n'),
    ],
)
def test_append_line_cuts_a_torn_tail(tmp_path: Path, before: bytes, after: bytes) -> None:
    path = tmp_path / "h.jsonl"
    path.write_bytes(before)
    append_line(path, b'{"b":1}\n')
    assert path.read_bytes() == after


@pytest.mark.parametrize("line", [b"no newline", b"two\nlines\n"])
def test_append_line_needs_one_line(tmp_path: Path, line: bytes) -> None:
    with pytest.raises(ValueError) as info:
        append_line(tmp_path / "h", line)
    assert str(info.value) == "append_line needs exactly one line ending with a newline"


@pytest.mark.parametrize(
    ("keep", "expected"),
    [
        (1, ["2025-09.jsonl", "2026-01.jsonl", "2026-08.jsonl"]),
        (2, ["2025-09.jsonl", "2026-01.jsonl"]),
        (12, ["2025-09.jsonl"]),
        (13, []),
        (0, []),
    ],
)
def test_expired_history(keep: int, expected: list[str]) -> None:
    names = ["2025-09.jsonl", "2026-01.jsonl", "2026-08.jsonl", "2026-09.jsonl", "notes.txt"]
    assert expired_history(names, 2026, 9, keep) == expected


def test_prune_history(tmp_path: Path) -> None:
    for name in ("2026-07.jsonl", "2026-08.jsonl", "2026-09.jsonl"):
        (tmp_path / name).write_text("")
    removed = prune_history(tmp_path, 2026, 9, 2)
    assert removed == [tmp_path / "2026-07.jsonl"]
    assert sorted(os.listdir(tmp_path)) == ["2026-08.jsonl", "2026-09.jsonl"]
    assert prune_history(tmp_path / "absent", 2026, 9, 2) == []


def test_prometheus_text() -> None:
    snapshot = {
        "timestamp_unix": 1790424000.0,
        "stats": {
            "processes": 3,
            "vanished": 1,
            "unreadable": 0,
            "not_clients": 0,
            "unreadable_processes": 2,
            "reused": 1,
            "fdinfo_reads": 2,
            "fdinfo_reads_saved": 3,
        },
        "cards": {
            "0000:03:00.0": {
                "driver": "xe",
                "vram_total_bytes": 100,
                "vram_used_bytes": 40,
                "clients": [
                    {
                        "name": 'odd"name',
                        "kind": "container",
                        "vram_bytes": 40,
                        "system_bytes": 1,
                        "gtt_bytes": 2,
                        "engines": {"ccs": 0.5, "rcs": None},
                        "drm_client_ids": [1, 2],
                    }
                ],
            }
        },
    }
    c = 'client="odd\\"name",kind="container",card="0000:03:00.0"'
    card = 'card="0000:03:00.0",driver="xe"'
    assert prometheus_text(snapshot).splitlines() == [
        "# HELP cardshare_scan_timestamp_seconds Time of the last recorder scan (Unix seconds).",
        "# TYPE cardshare_scan_timestamp_seconds gauge",
        "cardshare_scan_timestamp_seconds 1790424000.0",
        "# HELP cardshare_scan_processes Processes seen by the last scan.",
        "# TYPE cardshare_scan_processes gauge",
        "cardshare_scan_processes 3",
        "# HELP cardshare_scan_fdinfo_reads DRM fdinfo files the last scan read (each read wakes"
        " an xe card).",
        "# TYPE cardshare_scan_fdinfo_reads gauge",
        "cardshare_scan_fdinfo_reads 2",
        "# HELP cardshare_scan_fdinfo_reads_saved DRM descriptors the last scan did not read: they"
        " share an open file already read.",
        "# TYPE cardshare_scan_fdinfo_reads_saved gauge",
        "cardshare_scan_fdinfo_reads_saved 3",
        "# HELP cardshare_scan_skipped Processes, descriptors or files skipped by the last scan.",
        "# TYPE cardshare_scan_skipped gauge",
        'cardshare_scan_skipped{reason="vanished"} 1',
        'cardshare_scan_skipped{reason="unreadable"} 0',
        'cardshare_scan_skipped{reason="not_clients"} 0',
        'cardshare_scan_skipped{reason="unreadable_processes"} 2',
        'cardshare_scan_skipped{reason="reused"} 1',
        "# HELP cardshare_scan_fdinfo_malformed_lines Lines of the DRM fdinfo files the last scan"
        " read that were not key: value (ignored).",
        "# TYPE cardshare_scan_fdinfo_malformed_lines gauge",
        "cardshare_scan_fdinfo_malformed_lines 0",
        "# HELP cardshare_card_vram_total_bytes Device memory of the card (sysfs).",
        "# TYPE cardshare_card_vram_total_bytes gauge",
        f"cardshare_card_vram_total_bytes{{{card}}} 100",
        "# HELP cardshare_card_vram_used_bytes Resident device memory of all clients of the card, "
        "shared buffers counted once.",
        "# TYPE cardshare_card_vram_used_bytes gauge",
        f"cardshare_card_vram_used_bytes{{{card}}} 40",
        "# HELP cardshare_card_vram_shared_bytes Part of the card's used device memory in buffers "
        "shared between DRM files.",
        "# TYPE cardshare_card_vram_shared_bytes gauge",
        f"cardshare_card_vram_shared_bytes{{{card}}} 0",
        "# HELP cardshare_card_clients Named clients on the card.",
        "# TYPE cardshare_card_clients gauge",
        f"cardshare_card_clients{{{card}}} 1",
        "# HELP cardshare_client_vram_bytes Resident device memory of a named client.",
        "# TYPE cardshare_client_vram_bytes gauge",
        f"cardshare_client_vram_bytes{{{c}}} 40",
        "# HELP cardshare_client_vram_shared_bytes Part of a named client's device memory in "
        "buffers shared with another DRM file.",
        "# TYPE cardshare_client_vram_shared_bytes gauge",
        f"cardshare_client_vram_shared_bytes{{{c}}} 0",
        "# HELP cardshare_client_system_bytes Resident system memory of a named client.",
        "# TYPE cardshare_client_system_bytes gauge",
        f"cardshare_client_system_bytes{{{c}}} 1",
        "# HELP cardshare_client_gtt_bytes Resident GTT memory of a named client.",
        "# TYPE cardshare_client_gtt_bytes gauge",
        f"cardshare_client_gtt_bytes{{{c}}} 2",
        "# HELP cardshare_client_drm_clients DRM clients (open DRM files) of a named client.",
        "# TYPE cardshare_client_drm_clients gauge",
        f"cardshare_client_drm_clients{{{c}}} 2",
        "# HELP cardshare_client_engine_busy_ratio Busy share of an engine class since the "
        "last scan.",
        "# TYPE cardshare_client_engine_busy_ratio gauge",
        f'cardshare_client_engine_busy_ratio{{{c},engine="ccs"}} 0.5',
        *_COUNTER_HEADERS,
    ]


# The counter families, empty when no state is given.
_COUNTER_HEADERS = [
    "# HELP cardshare_drm_client_engine_cycles_total GPU cycles a DRM client's work ran on an "
    "engine class (xe drm-cycles).",
    "# TYPE cardshare_drm_client_engine_cycles_total counter",
    "# HELP cardshare_drm_client_engine_total_cycles_total GPU cycles elapsed on an engine "
    "class, busy or not (xe drm-total-cycles).",
    "# TYPE cardshare_drm_client_engine_total_cycles_total counter",
    "# HELP cardshare_drm_client_engine_busy_seconds_total Time a DRM client's work ran on an "
    "engine class (i915, amdgpu drm-engine, ns / 1e9).",
    "# TYPE cardshare_drm_client_engine_busy_seconds_total counter",
    "# HELP cardshare_drm_client_engine_capacity Engines of the class a DRM client may use "
    "(drm-engine-capacity, 1 when not printed).",
    "# TYPE cardshare_drm_client_engine_capacity gauge",
]


def _tree(tree: Any, make: Callable[..., str], busy: int, total: int) -> None:
    base = tree.root / "proc" / "100"
    if not base.exists():
        tree.card("0000:03:00.0")
        tree.boot_id("b1")
        tree.process(100, comm="Plex Transcoder")
        tree.drm_fd(100, 3, "")
    (base / "fdinfo" / "3").write_text(make(8, vram="2 MiB", cycles={"vcs": (busy, total)}))


def test_run_scan_twice(rec_tree: Any, rec_make_fdinfo: Callable[..., str], tmp_path: Path) -> None:
    data = tmp_path / "data"
    textfile = tmp_path / "cardshare.prom"
    config = ScanConfig(
        root=str(rec_tree.root),
        data_dir=data,
        textfile=textfile,
        retention_months=2,
        rules=DEFAULT_RULES,
        is_drm=rec_tree.is_drm,
    )
    (data / "history").mkdir(parents=True)
    (data / "history" / "2026-07.jsonl").write_text("{}\n")
    _tree(rec_tree, rec_make_fdinfo, 0, 1000)
    run_scan(config, SEPT)
    _tree(rec_tree, rec_make_fdinfo, 100, 2000)
    snapshot = run_scan(config, SEPT + 60 * S)

    current = json.loads((data / "current.json").read_text())
    assert current == snapshot
    client = current["cards"]["0000:03:00.0"]["clients"][0]
    assert (client["name"], client["engines"], client["vram_bytes"]) == (
        "plex",
        {"vcs": 0.1},
        2 * 1024**2,
    )
    lines = (data / "history" / "2026-09.jsonl").read_text().splitlines()
    assert [json.loads(line)["timestamp"] for line in lines] == [
        "2026-09-26T12:00:00Z",
        "2026-09-26T12:01:00Z",
    ]
    assert sorted(os.listdir(data / "history")) == ["2026-09.jsonl"]
    assert sorted(os.listdir(data)) == ["current.json", "history", "scan.lock", "state.json"]
    assert (
        'cardshare_client_engine_busy_ratio{client="plex",kind="process",card="0000:03:00.0",'
        'engine="vcs"} 0.1' in (textfile.read_text())
    )


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_run_scan_full_disk_keeps_previous_current(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], tmp_path: Path, fail_at: int
) -> None:
    data = tmp_path / "data"
    config = ScanConfig(root=str(rec_tree.root), data_dir=data, is_drm=rec_tree.is_drm)
    _tree(rec_tree, rec_make_fdinfo, 0, 1000)
    run_scan(config, SEPT)
    before = (data / "current.json").read_bytes()
    history_before = (data / "history" / "2026-09.jsonl").read_bytes()
    calls = {"n": 0}

    def flaky_write(fd: int, payload: bytes) -> int:
        calls["n"] += 1
        if calls["n"] >= fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, payload)

    _tree(rec_tree, rec_make_fdinfo, 500, 2000)
    with pytest.raises(OutputError) as info:
        run_scan(replace(config, ops=FileOps(write=flaky_write)), SEPT + 60 * S)
    assert str(info.value).endswith(": No space left on device")
    assert str(data) in str(info.value)
    history_after = (data / "history" / "2026-09.jsonl").read_bytes()
    if fail_at == 1:  # current.json failed: nothing changed
        assert (data / "current.json").read_bytes() == before
        assert history_after == history_before
    else:  # current.json written, history line whole or absent
        assert all(json.loads(line) for line in history_after.splitlines())
    assert [p for p in os.listdir(data) if p.endswith(".tmp")] == []


def test_run_scan_data_dir_is_a_file(tmp_path: Path, rec_tree: Any) -> None:
    blocker = tmp_path / "data"
    blocker.write_text("")
    config = ScanConfig(root=str(rec_tree.root), data_dir=blocker, is_drm=rec_tree.is_drm)
    with pytest.raises(OutputError) as info:
        run_scan(config, SEPT)
    assert str(info.value) == f"cannot create directory {blocker}: File exists"
