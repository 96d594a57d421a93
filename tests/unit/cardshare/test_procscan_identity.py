"""Issue 9, item 1: a reused pid never gets the client (procscan reads via a dir fd)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cardshare.naming import naming_pid
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


LOGIND_CG = "0::/system.slice/systemd-logind.service\n"
SESSION_CG = "0::/user.slice/user-1000.slice/session-2.scope\n"


def test_holders_that_name_nothing_keep_a_short_record(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """Every holder is recorded (comm, start time) for naming_pid; only the naming process's
    cgroup and command line are read."""
    for pid, comm in ((100, "python3"), (101, "worker")):
        _with_stat(rec_tree, pid, comm, 5000 + pid, VLLM_BOX)
        rec_tree.drm_fd(pid, 3, rec_make_fdinfo(3))
    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm, every_holder=True)
    named, short = scan.processes[100], scan.processes[101]
    assert (named.cmdline, named.container is not None) == ("python3", True)
    assert (short.comm, short.start_time, short.cmdline, short.container, short.cgroup) == (
        "worker",
        5101,
        None,
        None,
        "",
    )


def test_a_broker_by_its_unit_found_when_its_short_record_is_completed(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """pid 812 (a logind helper by comm ``sd-helper``) is a broker only by its unit; pid 900
    shares that unit with an ordinary comm, so its short record looks like a candidate until
    it is completed; the session's shell (pid 2301) names the client, as with full records."""
    _with_stat(rec_tree, 812, "sd-helper", 100, LOGIND_CG)
    _with_stat(rec_tree, 900, "sd-worker", 200, LOGIND_CG)
    _with_stat(rec_tree, 2301, "gnome-shell", 300, SESSION_CG)
    for pid in (812, 900, 2301):
        rec_tree.drm_fd(pid, 5, rec_make_fdinfo(7))
    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm, every_holder=True)
    assert naming_pid(scan.clients[("0000:03:00.0", 7)].pids, scan.processes) == 2301
    assert scan.processes[2301].cmdline == "gnome-shell"
    assert scan.processes[2301].cgroup == "/user.slice/user-1000.slice/session-2.scope"
    assert scan.processes[900].cgroup == "/system.slice/systemd-logind.service"  # completed
    assert scan.stats.vanished == 0


def test_a_naming_process_replaced_before_its_record_is_completed_is_dropped(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """systemd-logind (pid 812) and a shell (pid 2301) hold one client; the shell names it,
    but its pid is reused before its record is completed: the newcomer's command line is not
    taken, the record is dropped (counted as vanished), and logind's is the one left."""
    _with_stat(rec_tree, 812, "systemd-logind", 100, LOGIND_CG)
    shell = _with_stat(rec_tree, 2301, "gnome-shell", 300, SESSION_CG)
    for pid in (812, 2301):
        rec_tree.drm_fd(pid, 5, rec_make_fdinfo(7))

    def opener(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if dir_fd is None and path == str(shell):  # the pid opened again to complete it
            (shell / "stat").write_text(_stat_line(2301, "sshd", 9000))
            (shell / "cmdline").write_bytes(b"sshd: root\0")
        return os.open(path, flags, mode, dir_fd=dir_fd)

    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm, opener=opener, every_holder=True)
    client = scan.clients[("0000:03:00.0", 7)]
    assert sorted(client.pids) == [812, 2301]
    assert sorted(scan.processes) == [812]
    assert scan.stats.vanished == 1
    assert naming_pid(client.pids, scan.processes) == 812
