"""Issue 9, item 1: a reused pid never gets the client (the scan reads via a dir fd)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cardshare.naming import naming_pid
from cardshare.recorder.procfs import parse_stat
from cardshare.recorder.scan import _Scanner, scan_proc

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


def _exiting_opener(victim: Path) -> Callable[..., int]:
    """An opener under which the process at ``victim`` exits once its fdinfo/3 is open: on the
    real ``/proc`` every later read through its directory fails (see the two real-process
    tests below), which removing its files models (ENOENT)."""

    def opener(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
        where = os.readlink(f"/proc/thread-self/fd/{dir_fd}") if dir_fd is not None else ""
        if path == "fdinfo/3" and where == str(victim):
            for name in ("cmdline", "cgroup"):
                (victim / name).unlink()
        return fd

    return opener


def test_a_process_gone_mid_read_is_dropped_not_kept_partial(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """pid 100 (a container's python3) exits after its fdinfo is read, before its cgroup and
    command line are: kept, its record would have no container and be named by comm.  It
    is dropped and counted as vanished; pid 200 is unaffected."""
    t = rec_tree
    victim = _with_stat(t, 100, "python3", 5000, VLLM_BOX)
    t.drm_fd(100, 3, rec_make_fdinfo(3))
    _with_stat(t, 200, "plex", 6000, SSHD_CG)
    t.drm_fd(200, 3, rec_make_fdinfo(4))

    scan = scan_proc(str(t.root), t.is_drm, opener=_exiting_opener(victim))

    assert sorted(scan.clients) == [("0000:03:00.0", 4)]
    assert sorted(scan.processes) == [200]
    assert (scan.stats.vanished, scan.stats.reused, scan.stats.drm_descriptors) == (1, 0, 2)


def test_a_tree_without_stat_reads_a_missing_file_as_empty(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """The lab's simulated /proc has no stat: a missing file there is absent, not a sign the
    process is gone (no start time to tell), so the record is kept with what was there."""
    t = rec_tree
    victim = t.process(100, comm="python3", cmdline=("python3",), cgroup=VLLM_BOX)
    t.drm_fd(100, 3, rec_make_fdinfo(3))

    scan = scan_proc(str(t.root), t.is_drm, opener=_exiting_opener(victim))

    assert sorted(scan.clients) == [("0000:03:00.0", 3)]
    proc = scan.processes[100]
    assert (proc.comm, proc.cmdline, proc.container, proc.start_time) == ("python3", "", None, None)
    assert scan.stats.vanished == 0


@pytest.fixture
def waiting_child() -> Iterator[tuple[int, Callable[[], None]]]:
    """A real child process and a function that ends and reaps it."""
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(hold_w)
        os.read(hold_r, 1)
        os._exit(0)
    os.close(hold_r)
    done = []

    def end() -> None:
        if not done:
            os.close(hold_w)
            os.waitpid(pid, 0)
            done.append(True)

    try:
        yield pid, end
    finally:
        end()


def test_reads_through_a_process_directory_fail_once_it_is_gone(
    waiting_child: tuple[int, Callable[[], None]],
) -> None:
    """What the scan relies on, on the real /proc: the directory opened for a process answers
    for that process only.  Once it has exited and been reaped, a lookup through the
    directory fails (ESRCH from its permission check on the kernels tried, ENOENT from the
    lookup itself) and a file opened before fails with ESRCH, so a record cannot take
    another process's cgroup or command line."""
    pid, end = waiting_child
    pid_dfd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    try:
        stat_fd = os.open("stat", os.O_RDONLY, dir_fd=pid_dfd)
        try:
            before = parse_stat(os.pread(stat_fd, 4096, 0))
            assert before is not None
            assert os.pread(stat_fd, 4096, 0).startswith(f"{pid} (".encode())
            end()
            with pytest.raises(ProcessLookupError):
                os.pread(stat_fd, 4096, 0)
        finally:
            os.close(stat_fd)
        for name in ("stat", "comm", "cgroup", "cmdline"):
            with pytest.raises((ProcessLookupError, FileNotFoundError)):
                os.open(name, os.O_RDONLY, dir_fd=pid_dfd)
    finally:
        os.close(pid_dfd)


def test_a_reused_pid_is_not_reached_through_the_old_directory(
    waiting_child: tuple[int, Callable[[], None]],
) -> None:
    """The same with the pid really reused (root: ``ns_last_pid`` makes the next fork take
    it): by path, /proc/<pid> is the newcomer; through the directory opened before, nothing."""
    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    if os.geteuid() != 0 or not os.access(last_pid, os.W_OK):
        pytest.skip("forcing a pid needs root (ns_last_pid); CI runs as root")
    pid, end = waiting_child
    pid_dfd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    try:
        end()
        for _ in range(200):  # a fork elsewhere (CI runs scenarios beside) may take it: again
            try:
                last_pid.write_text(str(pid - 1))
            except OSError as exc:  # writable file, but no CAP_SYS_ADMIN/CHECKPOINT_RESTORE
                pytest.skip(f"cannot set ns_last_pid: {exc}")
            newcomer = os.fork()
            if newcomer == 0:  # pragma: no cover - runs in the child
                try:
                    os.execv("/bin/sleep", ["sleep", "30"])
                finally:
                    os._exit(127)  # never back into pytest from a forked child
            try:
                if newcomer != pid:
                    continue
                deadline = time.monotonic() + 10
                while b"sleep" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    assert time.monotonic() < deadline, "the newcomer never ran sleep"
                    time.sleep(0.01)
                with pytest.raises((ProcessLookupError, FileNotFoundError)):
                    os.open("cmdline", os.O_RDONLY, dir_fd=pid_dfd)
                return
            finally:
                os.kill(newcomer, 9)
                os.waitpid(newcomer, 0)
        pytest.skip("the pid was taken by another process each time")
    finally:
        os.close(pid_dfd)


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


def test_a_process_gone_before_its_descriptors_are_read_is_vanished_not_unreadable(
    waiting_child: tuple[int, Callable[[], None]],
) -> None:
    """On the real /proc a process that exits after its directory was opened answers ESRCH,
    not ENOENT, to the opening of its ``fd/`` and ``fdinfo/<n>``: that is an exit (vanished),
    not a refusal (unreadable, which the permission check weighs)."""
    pid, end = waiting_child
    scanner = _Scanner("/proc", lambda st: False, os.open, None)
    pid_dfd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    try:
        end()
        assert scanner.drm_descriptors(pid, pid_dfd) is None
        assert scanner.read_fdinfo(pid_dfd, "0", {}) == "skip"
    finally:
        os.close(pid_dfd)
    s = scanner.stats
    assert (s.vanished, s.unreadable, s.unreadable_processes) == (2, 0, 0)


def test_a_shared_file_whose_holder_was_replaced_drops_the_reads_it_answered(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """pid 101 shares pid 100's open file, so its descriptor is not read: pid 100's result
    answers for it (kcmp).  When pid 100 is no longer the process read (its start time by
    path differs: exited, pid reused), that answer is not kept for 101 (counted as reused);
    pid 100's own record stays, read before it went."""
    t = rec_tree
    _with_stat(t, 100, "python3", 5000, VLLM_BOX)
    t.drm_fd(100, 3, rec_make_fdinfo(3))
    _with_stat(t, 101, "worker", 5001, VLLM_BOX)
    t.drm_fd(101, 3, rec_make_fdinfo(3))

    def order(pid1: int, fd1: int, pid2: int, fd2: int) -> int:
        if pid1 == 101:  # while 101 is compared, pid 100 exits and sshd takes its pid
            (t.root / "proc" / "100" / "stat").write_text(_stat_line(100, "sshd", 9000))
        return 0  # one open file

    scan = scan_proc(str(t.root), t.is_drm, compare=order)

    assert scan.stats.reused == 1
    assert scan.stats.fdinfo_reads_saved == 1
    assert [(key, client.pids) for key, client in scan.clients.items()] == [
        (("0000:03:00.0", 3), {100})
    ]
