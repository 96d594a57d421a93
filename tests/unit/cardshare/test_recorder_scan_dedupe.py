"""Issue 9, item 5: each open file read once (kcmp KCMP_FILE, or an injected comparator)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cardshare.recorder.openfiles import DedupeUnavailable, FileOrder, kcmp_file_order
from cardshare.recorder.scan import scan_proc

# --- the dedupe logic, fed by a comparator over a synthetic tree ------------------------------


def _order_by(files: dict[tuple[int, int], int], log: list[tuple[int, int, int, int]]) -> FileOrder:
    """Compare descriptors by the open file each stands for (as kcmp does in the kernel)."""

    def order(pid1: int, fd1: int, pid2: int, fd2: int) -> int:
        log.append((pid1, fd1, pid2, fd2))
        for pid, fd in ((pid1, fd1), (pid2, fd2)):
            if (pid, fd) not in files:
                raise ProcessLookupError(errno.ESRCH, "No such process")
        a, b = files[(pid1, fd1)], files[(pid2, fd2)]
        return (a > b) - (a < b)

    return order


def _shared_tree(t: Any, make: Callable[..., str]) -> dict[tuple[int, int], int]:
    """pid 100 holds open file 1 twice (dup); its child 101 inherits it and opens file 2;
    pid 102 opens file 3 (same client id, other card) and file 4 (not a DRM client)."""
    t.process(100, comm="vllm")
    t.drm_fd(100, 5, make(3))
    t.drm_fd(100, 6, make(3))
    t.process(101, comm="worker")
    t.drm_fd(101, 5, make(3))
    t.drm_fd(101, 9, make(4))
    t.process(102, comm="other")
    t.drm_fd(102, 3, make(3, pdev="0000:04:00.0"))
    t.drm_fd(102, 4, "drm-pdev:\t0000:04:00.0\n")
    t.drm_fd(102, 7, "drm-pdev:\t0000:04:00.0\n")  # dup of 4
    return {
        (100, 5): 1,
        (100, 6): 1,
        (101, 5): 1,
        (101, 9): 2,
        (102, 3): 3,
        (102, 4): 4,
        (102, 7): 4,
    }


def _counting_opener(opened: list[str]) -> Callable[..., int]:
    def opener(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        opened.append(path)
        return os.open(path, flags, mode, dir_fd=dir_fd)

    return opener


def test_shared_open_files_are_read_once(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    files = _shared_tree(rec_tree, rec_make_fdinfo)
    log: list[tuple[int, int, int, int]] = []
    opened: list[str] = []
    scan = scan_proc(
        str(rec_tree.root),
        rec_tree.is_drm,
        opener=_counting_opener(opened),
        compare=_order_by(files, log),
    )
    assert scan.dedupe == "compare"
    # one read per open file: 100 reads fd 5 or 6, 101 only fd 9, 102 fd 3 and fd 4 or 7
    reads = sorted(p for p in opened if p.startswith("fdinfo/"))
    assert len(reads) == 4
    assert {"fdinfo/3", "fdinfo/9"} <= set(reads)
    assert len({"fdinfo/4", "fdinfo/7"} & set(reads)) == 1
    s = scan.stats
    assert (s.drm_descriptors, s.fdinfo_reads, s.fdinfo_reads_saved) == (7, 4, 3)
    assert s.not_clients == 2  # fd 4 read, fd 7 known to be the same open file
    assert {k: (c.pids, c.descriptors) for k, c in scan.clients.items()} == {
        ("0000:03:00.0", 3): ({100, 101}, 3),
        ("0000:03:00.0", 4): ({101}, 1),
        ("0000:04:00.0", 3): ({102}, 1),
    }
    assert sorted(scan.processes) == [100, 101, 102]
    assert all(pid1 != pid2 or fd1 != fd2 for pid1, fd1, pid2, fd2 in log)


def test_same_result_without_dedupe(rec_tree: Any, rec_make_fdinfo: Callable[..., str]) -> None:
    files = _shared_tree(rec_tree, rec_make_fdinfo)
    with_kcmp = scan_proc(str(rec_tree.root), rec_tree.is_drm, compare=_order_by(files, []))
    without = scan_proc(str(rec_tree.root), rec_tree.is_drm, compare="off")
    assert without.stats.fdinfo_reads_saved == 0
    assert without.stats.fdinfo_reads == 7
    assert {k: (c.pids, c.descriptors) for k, c in with_kcmp.clients.items()} == {
        k: (c.pids, c.descriptors) for k, c in without.clients.items()
    }


def test_refused_comparison_falls_back_to_reading(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    _shared_tree(rec_tree, rec_make_fdinfo)

    def refused(pid1: int, fd1: int, pid2: int, fd2: int) -> int:
        raise DedupeUnavailable("Operation not permitted")

    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm, compare=refused)
    assert scan.dedupe == "client-id"
    assert (scan.stats.fdinfo_reads, scan.stats.fdinfo_reads_saved) == (7, 0)
    assert len(scan.clients) == 3


def test_a_gone_representative_is_forgotten(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """pid 100 closes fd 5 after it was read: 101's inherited copy is read, not lost."""
    files = _shared_tree(rec_tree, rec_make_fdinfo)
    log: list[tuple[int, int, int, int]] = []
    order = _order_by(files, log)

    def closing(pid1: int, fd1: int, pid2: int, fd2: int) -> int:
        if pid1 == 101:
            files.pop((100, 5), None)
            files.pop((100, 6), None)
        return order(pid1, fd1, pid2, fd2)

    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm, compare=closing)
    assert (scan.stats.fdinfo_reads, scan.stats.fdinfo_reads_saved) == (5, 2)
    assert scan.clients[("0000:03:00.0", 3)].pids == {100, 101}


def test_synthetic_tree_never_uses_kcmp(rec_tree: Any, rec_make_fdinfo: Callable[..., str]) -> None:
    """The lab's /proc is files: its pids are not processes kcmp could ask about."""
    _shared_tree(rec_tree, rec_make_fdinfo)
    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm)
    assert (scan.dedupe, scan.stats.fdinfo_reads_saved) == ("client-id", 0)


# --- kcmp itself, with real processes and an ordinary file ------------------------------------


def _kcmp() -> FileOrder:
    order = kcmp_file_order()
    if order is None:
        pytest.skip("no kcmp syscall number for this ABI")
    fd = os.open("/", os.O_RDONLY)
    try:
        order(os.getpid(), fd, os.getpid(), fd)
    except DedupeUnavailable as exc:
        pytest.skip(f"kcmp refused here: {exc}")
    finally:
        os.close(fd)
    return order


def test_kcmp_file_order_on_own_descriptors(tmp_path: Path) -> None:
    order = _kcmp()
    path = tmp_path / "f"
    path.write_text("x")
    me = os.getpid()
    a = os.open(path, os.O_RDONLY)
    b = os.dup(a)
    c = os.open(path, os.O_RDONLY)
    try:
        assert order(me, a, me, b) == 0
        assert order(me, a, me, c) in (-1, 1)
        assert order(me, a, me, c) == -order(me, c, me, a)
        with pytest.raises(OSError) as caught:
            order(me, a, me, 987654)
        assert caught.value.errno == errno.EBADF
    finally:
        for fd in (a, b, c):
            os.close(fd)


@pytest.fixture
def sharing_processes(tmp_path: Path) -> Iterator[tuple[Path, list[int]]]:
    """A child holding an ordinary file open twice (fds a, dup(a)) plus a second open file
    of it (c), and a grandchild that inherited all three: 6 descriptors, 2 open files."""
    path = tmp_path / "shared"
    path.write_text("not a device\n")
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.close(ready_r)
            os.close(hold_w)
            a = os.open(path, os.O_RDONLY)
            os.dup(a)
            os.open(path, os.O_RDONLY)
            grandchild = os.fork()
            if grandchild == 0:
                os.read(hold_r, 1)
                os._exit(0)
            os.write(ready_w, f"{os.getpid()} {grandchild}\n".encode())
            os.read(hold_r, 1)
            os.waitpid(grandchild, 0)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(hold_r)
    pids = [int(p) for p in os.read(ready_r, 100).split()]
    os.close(ready_r)
    try:
        yield path, pids
    finally:
        os.close(hold_w)
        os.waitpid(child, 0)


def test_kcmp_finds_dup_and_fork_sharing(sharing_processes: tuple[Path, list[int]]) -> None:
    _kcmp()
    path, pids = sharing_processes
    target = path.stat()

    def is_it(st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino) and stat.S_ISREG(st.st_mode)

    scan = scan_proc("/", is_it)
    s = scan.stats
    assert scan.dedupe == "kcmp"
    # 6 descriptors, 2 open files: 2 reads, 4 saved; an ordinary file is not a DRM client
    assert (s.drm_descriptors, s.fdinfo_reads, s.fdinfo_reads_saved) == (6, 2, 4)
    assert (s.not_clients, scan.clients) == (6, {})
    assert len(pids) == 2
