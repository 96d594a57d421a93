"""Issue 9, item 1: a reused pid never gets the client (procscan reads via a dir fd)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cardshare.procscan import parse_stat, scan_proc

VLLM_BOX = "0::/system.slice/docker-" + "ab" * 32 + ".scope\n"
SSHD_CG = "0::/system.slice/sshd.service\n"


def _stat_line(pid: int, comm: str, start: int) -> str:
    """A stat line shaped like tests/fixtures/proc/stat-cat.txt, start time in field 22."""
    return (
        f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194304 263 0 0 0 0 0 0 0 20 0 1 0 {start} "
        "3133440 382 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0\n"
    )


def _with_stat(t: Any, pid: int, comm: str, start: int, cgroup: str) -> Path:
    base: Path = t.process(pid, comm=comm, cmdline=(comm,), cgroup=cgroup)
    (base / "stat").write_text(_stat_line(pid, comm, start))
    return base


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ((Path(__file__).parents[2] / "fixtures/proc/stat-cat.txt").read_bytes(), ("cat", 399022)),
        (b"7 (a) b) c) S 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 42 0 0\n", ("a) b) c", 42)),
        (
            b"7 (Plex Transcoder) R 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 9 0\n",
            ("Plex Transcoder", 9),
        ),
        (b"7 (x) S 1 7\n", None),  # truncated
        (b"7 x S 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 9 0\n", None),  # no parentheses
        (b"7 (x) S 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 -9 0\n", None),  # not a count
        (b"", None),
    ],
)
def test_parse_stat(text: bytes, expected: tuple[str, int] | None) -> None:
    assert parse_stat(text) == expected


def test_start_time_change_mid_scan_drops_the_record(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """pid 100 exits and is reused by sshd while its fdinfo is being read: the stat start
    time differs at the end, so nothing read from pid 100 is kept (not named sshd)."""
    t = rec_tree
    victim = _with_stat(t, 100, "python3", 5000, VLLM_BOX)
    t.drm_fd(100, 3, rec_make_fdinfo(3))
    _with_stat(t, 200, "plex", 6000, SSHD_CG)
    t.drm_fd(200, 3, rec_make_fdinfo(4))

    def opener(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
        where = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else ""
        if path == "fdinfo/3" and where == str(victim):  # the hook between two reads
            (victim / "stat").write_text(_stat_line(100, "sshd", 7777))
            (victim / "comm").write_text("sshd\n")
            (victim / "cgroup").write_text(SSHD_CG)
        return fd

    scan = scan_proc(str(t.root), t.is_drm, opener=opener)

    assert sorted(scan.clients) == [("0000:03:00.0", 4)]
    assert sorted(scan.processes) == [200]
    assert scan.processes[200].start_time == 6000
    assert (scan.stats.reused, scan.stats.drm_descriptors) == (1, 2)


def test_start_time_kept_with_the_record(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    _with_stat(rec_tree, 100, "python3", 5000, VLLM_BOX)
    rec_tree.drm_fd(100, 3, rec_make_fdinfo(3))
    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm)
    proc = scan.processes[100]
    assert (proc.comm, proc.start_time, proc.container is not None) == ("python3", 5000, True)
    assert scan.stats.reused == 0


def test_pid_replaced_after_reading_is_not_named_after_the_newcomer(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """The issue's case: the client's process exits and its pid goes to sshd before naming.

    The scan reads pid 100 (a container's python3), then, while it walks pid 200, pid 100 is
    replaced.  Names read by path after the scan said ``sshd``; read through the directory
    opened for pid 100, they are the container's.
    """
    t = rec_tree
    _with_stat(t, 100, "python3", 5000, VLLM_BOX)
    t.drm_fd(100, 3, rec_make_fdinfo(3))
    _with_stat(t, 200, "plex", 6000, SSHD_CG)
    by_path = t.root / "dev" / "dri" / "by-path"
    by_path.mkdir()
    (by_path / "pci-0000:03:00.0-render").symlink_to("../renderD128")
    (t.root / "proc" / "200" / "fd" / "3").symlink_to(by_path / "pci-0000:03:00.0-render")
    (t.root / "proc" / "200" / "fdinfo" / "3").write_text(rec_make_fdinfo(4))
    proc = t.root / "proc"

    def is_drm(st: os.stat_result) -> bool:
        if (proc / "200").exists() and not (proc / "100.old").exists():
            # first stat of pid 200's link: pid 100 exits, sshd gets its pid
            (proc / "100").rename(proc / "100.old")
            _with_stat(t, 100, "sshd", 9000, SSHD_CG)
        answer: bool = t.is_drm(st)
        return answer

    scan = scan_proc(str(t.root), is_drm)

    assert scan.processes[100].comm == "python3"
    assert scan.processes[100].container is not None
    assert sorted(scan.clients) == [("0000:03:00.0", 3), ("0000:03:00.0", 4)]


def test_every_holder_reads_each_holding_process(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    for pid, comm in ((100, "python3"), (101, "worker")):
        _with_stat(rec_tree, pid, comm, 5000 + pid, VLLM_BOX)
        rec_tree.drm_fd(pid, 3, rec_make_fdinfo(3))
    lowest = scan_proc(str(rec_tree.root), rec_tree.is_drm)
    every = scan_proc(str(rec_tree.root), rec_tree.is_drm, every_holder=True)
    assert sorted(lowest.processes) == [100]
    assert {p.pid: (p.comm, p.start_time) for p in every.processes.values()} == {
        100: ("python3", 5100),
        101: ("worker", 5101),
    }
