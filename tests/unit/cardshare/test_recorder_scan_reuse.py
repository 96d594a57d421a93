"""Issue 30: a descriptor number reused mid-scan never lends one client's answer to another.

Real processes on the real ``/proc``: process A holds open file X at descriptor N and is
scanned; then A puts open file Y (received from C over a unix socket, ``SCM_RIGHTS``) on N
with ``dup2()``; then the scan reaches C, which holds Y.  Compared with ``kcmp(C, m, A, N)``,
C's descriptor is "the same file" as the representative read for X: C was counted as client
X and client Y was never read.  The representatives are now the scan's own references to the
files it read, which nothing outside the scan can change.

Simulation at the fdinfo edge only: X and Y are ordinary files standing in for DRM nodes, and
their fdinfo (whose ``ino:`` line names the file) is translated into the text a DRM file
prints, with the stand-in's own client id (:func:`standin_opener`).  Processes, descriptors,
``dup2``, ``SCM_RIGHTS`` and ``kcmp`` are the kernel's.
"""

from __future__ import annotations

import errno
import os
import select
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import pytest

from cardshare.recorder import scan as scan_module
from cardshare.recorder.openfiles import DedupeUnavailable
from cardshare.recorder.procfs import Opener
from cardshare.recorder.scan import scan_proc

PDEV = "0000:03:00.0"


def standin_opener(
    texts: Mapping[int, str], on_open: Callable[[str], None] | None = None
) -> Opener:
    """``os.open`` that answers the fdinfo of a stand-in file (known by the inode on its
    ``ino:`` line, which the kernel prints for every open file) with ``texts[inode]``, the
    DRM fdinfo the stand-in plays; ``on_open(path)`` is called before each open."""

    def opener(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if on_open is not None:
            on_open(path)
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
        if "fdinfo/" not in path:
            return fd
        data = os.read(fd, 65536)
        inode = next(
            (int(line[4:]) for line in data.splitlines() if line.startswith(b"ino:")), None
        )
        if inode is None or inode not in texts:
            os.lseek(fd, 0, os.SEEK_SET)
            return fd
        os.close(fd)
        text = os.memfd_create("standin-fdinfo")
        os.write(text, texts[inode].encode())
        os.lseek(text, 0, os.SEEK_SET)
        return text

    return opener


class Swap(NamedTuple):
    a: int  # holds X at fd n; puts Y there when told
    c: int  # holds Y
    n: int
    x_ino: int
    y_ino: int
    is_standin: Callable[[os.stat_result], bool]
    swap: Callable[[], None]


def _child(body: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, never back into pytest
        try:
            body()
        finally:
            os._exit(0)
    return pid


@pytest.fixture
def swapping_processes(tmp_path: Path) -> Iterator[Swap]:
    x_path, y_path = tmp_path / "standin-x", tmp_path / "standin-y"
    x_path.write_text("DRM node stand-in X\n")
    y_path.write_text("DRM node stand-in Y\n")
    a_sock, c_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()  # tells C to send Y to A
    done_r, done_w = os.pipe()  # A has put Y on n
    hold_r, hold_w = os.pipe()  # closed by the test: the children exit

    def a_body() -> None:
        for end in (ready_r, go_r, go_w, done_r, hold_w):
            os.close(end)
        c_sock.close()
        n = os.open(x_path, os.O_RDONLY)
        os.write(ready_w, f"{n}\n".encode())
        _, fds, _, _ = socket.recv_fds(a_sock, 1, 1)
        os.dup2(fds[0], n)
        os.close(fds[0])
        os.write(done_w, b".")
        os.read(hold_r, 1)

    def c_body() -> None:
        for end in (ready_r, go_w, done_r, done_w, hold_w):
            os.close(end)
        a_sock.close()
        y = os.open(y_path, os.O_RDONLY)
        os.write(ready_w, b"c\n")
        os.read(go_r, 1)
        socket.send_fds(c_sock, [b"y"], [y])
        os.read(hold_r, 1)

    a = _child(a_body)
    c = _child(c_body)
    for end in (ready_w, go_r, done_w, hold_r):
        os.close(end)
    a_sock.close()
    c_sock.close()
    try:
        lines = b""
        while lines.count(b"\n") < 2:
            lines += os.read(ready_r, 100)
        n = int(next(line for line in lines.split() if line != b"c"))
        if a > c:
            pytest.skip("pids wrapped between the two forks: A must be scanned before C")
        x, y = x_path.stat(), y_path.stat()
        ids = {(x.st_dev, x.st_ino), (y.st_dev, y.st_ino)}

        def swap() -> None:
            os.write(go_w, b".")
            readable, _, _ = select.select([done_r], [], [], 10)
            assert readable, "process A never put Y on its descriptor"
            os.read(done_r, 1)

        yield Swap(a, c, n, x.st_ino, y.st_ino, lambda st: (st.st_dev, st.st_ino) in ids, swap)
    finally:
        for end in (hold_w, go_w, done_r, ready_r):
            os.close(end)
        os.waitpid(a, 0)
        os.waitpid(c, 0)


def test_a_descriptor_reused_after_its_file_was_read_does_not_answer_for_another_file(
    swapping_processes: Swap, rec_make_fdinfo: Callable[..., str]
) -> None:
    s = swapping_processes
    texts = {s.x_ino: rec_make_fdinfo(1, PDEV), s.y_ino: rec_make_fdinfo(2, PDEV)}
    swapped: list[bool] = []

    def on_open(path: str) -> None:
        if path == str(s.c) and not swapped:  # A is read; the scan turns to C
            s.swap()
            swapped.append(True)

    scan = scan_proc("/", s.is_standin, opener=standin_opener(texts, on_open))
    if scan.dedupe != "kcmp":
        pytest.skip(f"kcmp is refused here (dedupe {scan.dedupe})")
    assert swapped
    assert {key: client.pids for key, client in scan.clients.items()} == {
        (PDEV, 1): {s.a},  # what A held when it was read
        (PDEV, 2): {s.c},  # C's own file, read: it shares nothing read before
    }
    assert (scan.stats.fdinfo_reads, scan.stats.fdinfo_reads_saved) == (2, 0)


def test_without_a_swap_the_shared_file_is_read_once(
    swapping_processes: Swap, rec_make_fdinfo: Callable[..., str]
) -> None:
    """The control: with Y put on A's descriptor before the scan, C shares A's open file and
    takes its answer without a read (the dedupe still saves it)."""
    s = swapping_processes
    s.swap()
    texts = {s.x_ino: rec_make_fdinfo(1, PDEV), s.y_ino: rec_make_fdinfo(2, PDEV)}
    scan = scan_proc("/", s.is_standin, opener=standin_opener(texts))
    if scan.dedupe != "kcmp":
        pytest.skip(f"kcmp is refused here (dedupe {scan.dedupe})")
    assert {key: client.pids for key, client in scan.clients.items()} == {(PDEV, 2): {s.a, s.c}}
    assert (scan.stats.fdinfo_reads, scan.stats.fdinfo_reads_saved) == (1, 1)


def test_files_held_by_the_scan_are_not_in_its_process_fd_directory(
    swapping_processes: Swap, rec_make_fdinfo: Callable[..., str]
) -> None:
    """Another scanner (the arbiter's, the recorder's timer) walking this process's ``fd/``
    while the scan holds X must not find X there: it would count this process as a holder
    of the client, and name the client after it if its pid were the lowest."""
    s = swapping_processes
    texts = {s.x_ino: rec_make_fdinfo(1, PDEV), s.y_ino: rec_make_fdinfo(2, PDEV)}
    seen: list[list[str]] = []

    def on_open(path: str) -> None:
        if path == str(s.c) and not seen:  # X is held by now
            me = f"/proc/{os.getpid()}/fd"
            seen.append([os.readlink(f"{me}/{fd}") for fd in os.listdir(me)])

    scan = scan_proc("/", s.is_standin, opener=standin_opener(texts, on_open))
    if scan.dedupe != "kcmp":
        pytest.skip(f"kcmp is refused here (dedupe {scan.dedupe})")
    assert seen
    assert not [target for target in seen[0] if "standin-" in target]
    assert scan.clients[(PDEV, 1)].pids == {s.a}


def test_holding_refused_reads_every_descriptor(
    swapping_processes: Swap, rec_make_fdinfo: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pidfd_getfd`` refused (no ptrace attach right, Yama's scope 3, seccomp): no open
    file can be held, so none is compared; every DRM fdinfo is read and the clients are
    merged by their ids, the answer the scan gives where kcmp is refused."""
    s = swapping_processes
    s.swap()

    def refused() -> Callable[[int, int], int]:
        def take(pidfd: int, fd: int) -> int:
            raise DedupeUnavailable("Operation not permitted")

        return take

    monkeypatch.setattr(scan_module, "pidfd_take_file", refused)
    texts = {s.x_ino: rec_make_fdinfo(1, PDEV), s.y_ino: rec_make_fdinfo(2, PDEV)}
    scan = scan_proc("/", s.is_standin, opener=standin_opener(texts))
    assert scan.dedupe == "client-id"
    assert {key: client.pids for key, client in scan.clients.items()} == {(PDEV, 2): {s.a, s.c}}
    assert (scan.stats.fdinfo_reads, scan.stats.fdinfo_reads_saved) == (2, 0)


def test_no_pidfd_reads_every_descriptor(
    swapping_processes: Swap, rec_make_fdinfo: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel before 5.3 (``ENOSYS``) or a filter refusing ``pidfd_open``: as above."""
    s = swapping_processes
    s.swap()

    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    texts = {s.x_ino: rec_make_fdinfo(1, PDEV), s.y_ino: rec_make_fdinfo(2, PDEV)}
    scan = scan_proc("/", s.is_standin, opener=standin_opener(texts))
    assert scan.dedupe == "client-id"
    assert {key: client.pids for key, client in scan.clients.items()} == {(PDEV, 2): {s.a, s.c}}
    assert (scan.stats.fdinfo_reads, scan.stats.fdinfo_reads_saved) == (2, 0)


def test_processes_holding_the_last_file_read_and_others_are_counted_whole(
    tmp_path: Path, rec_make_fdinfo: Callable[..., str]
) -> None:
    """A process whose DRM descriptors all hold the open file last read is counted with one
    comparison each and nothing read; one that holds it and a file not read yet (in either
    order) is sorted out descriptor by descriptor: every client, holder and descriptor is
    counted, and each open file is read once."""
    x_path, y_path = tmp_path / "standin-x", tmp_path / "standin-y"
    x_path.write_text("DRM node stand-in X\n")
    y_path.write_text("DRM node stand-in Y\n")
    x = os.open(x_path, os.O_RDONLY)
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()

    def holder(order: str) -> Callable[[], None]:
        def body() -> None:
            os.close(hold_w)
            keep = os.dup(x)  # X, above the lowest free descriptor (x's, closed now)
            os.close(x)
            for name in order:  # x: the parent's open file X again; y: a Y of its own
                if name == "x":
                    os.dup(keep)
                else:
                    os.open(y_path, os.O_RDONLY)
            os.write(ready_w, b".")
            os.read(hold_r, 1)

        return body

    # in descriptor order: P1 X X; P2 X X Y; P3 Y X (its own Y first); P4 X
    plans = ("x", "xy", "y", "")
    children = [_child(holder(plan)) for plan in plans]
    os.close(x)
    try:
        for _ in children:
            os.read(ready_r, 1)
        x_st, y_st = x_path.stat(), y_path.stat()
        ids = {(x_st.st_dev, x_st.st_ino), (y_st.st_dev, y_st.st_ino)}
        texts = {x_st.st_ino: rec_make_fdinfo(1, PDEV), y_st.st_ino: rec_make_fdinfo(2, PDEV)}
        scan = scan_proc(
            "/",
            lambda st: (st.st_dev, st.st_ino) in ids,
            opener=standin_opener(texts),
        )
        if scan.dedupe != "kcmp":
            pytest.skip(f"kcmp is refused here (dedupe {scan.dedupe})")
        p1, p2, p3, p4 = children
        counted = {key: (c.pids, c.descriptors) for key, c in scan.clients.items()}
        # each Y is an open file of its own (two of client 2 in this stand-in's text)
        assert counted == {(PDEV, 1): ({p1, p2, p3, p4}, 6), (PDEV, 2): ({p2, p3}, 2)}
        assert scan.stats.drm_descriptors == 8
        assert (scan.stats.fdinfo_reads, scan.stats.fdinfo_reads_saved) == (3, 5)
    finally:
        os.close(hold_w)
        for fd in (ready_r, ready_w, hold_r):
            os.close(fd)
        for pid in children:
            os.waitpid(pid, 0)


def test_a_client_whose_first_holder_vanished_is_kept_for_the_next(
    tmp_path: Path, rec_make_fdinfo: Callable[..., str]
) -> None:
    """P1 and P2 share open file X; P1 is read first (X held, its fdinfo read) and exits while
    its record is read, so its reads are dropped.  P2, whose descriptor holds X, takes X's
    answer without a read: the client is counted with P2 as its holder (the scan used to fail
    with a KeyError there, the client's fdinfo having gone with P1's reads)."""
    x_path = tmp_path / "standin-x"
    x_path.write_text("DRM node stand-in X\n")
    x = os.open(x_path, os.O_RDONLY)
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()

    def body() -> None:
        os.close(hold_w)
        os.write(ready_w, b".")
        os.read(hold_r, 1)

    children = [_child(body), _child(body)]
    os.close(x)
    try:
        for _ in children:
            os.read(ready_r, 1)
        p1, p2 = children
        if p1 > p2:
            pytest.skip("pids wrapped between the two forks: P1 must be scanned first")
        st = x_path.stat()
        texts = {st.st_ino: rec_make_fdinfo(1, PDEV)}
        real = standin_opener(texts)

        def opener(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            if (
                path == "cgroup"
                and dir_fd is not None
                and os.readlink(f"/proc/thread-self/fd/{dir_fd}") == f"/proc/{p1}"
            ):  # P1 exits while its record is read (procfs answers ENOENT then)
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
            return real(path, flags, mode, dir_fd=dir_fd)

        scan = scan_proc(
            "/", lambda s: (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino), opener=opener
        )
        if scan.dedupe != "kcmp":
            pytest.skip(f"kcmp is refused here (dedupe {scan.dedupe})")
        assert {key: c.pids for key, c in scan.clients.items()} == {(PDEV, 1): {p2}}
        assert p1 not in scan.processes and p2 in scan.processes
        assert (scan.stats.fdinfo_reads, scan.stats.fdinfo_reads_saved) == (1, 1)
    finally:
        os.close(hold_w)
        for fd in (ready_r, ready_w, hold_r):
            os.close(fd)
        for pid in children:
            os.waitpid(pid, 0)
