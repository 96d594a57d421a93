"""Issue 9, item 7: no permission is an error, not an empty card."""

from __future__ import annotations

import ast
import ctypes
import errno
import os
from collections.abc import Callable
from typing import Any

import pytest

from cardshare.naming import DEFAULT_RULES
from cardshare.recorder import OutputError, sample
from cardshare.recorder.scan import ScanPermissionError, _Scanner, scan_proc


def _denying(root: str, pids: set[int]) -> Callable[..., int]:
    """An opener refusing ``fd/`` of ``pids`` as the kernel does for a user other than their
    owner (``fd/`` is mode 0500; tests run as root, where chmod stops nothing).  Root without
    CAP_SYS_PTRACE is refused later, at the links: the real-kernel test at the end."""
    denied = {f"{root}/proc/{pid}" for pid in pids}

    def opener(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if (
            path == "fd"
            and dir_fd is not None
            and os.readlink(f"/proc/thread-self/fd/{dir_fd}") in denied
        ):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return os.open(path, flags, mode, dir_fd=dir_fd)

    return opener


def _tree(t: Any, make: Callable[..., str], count: int) -> None:
    for pid in range(1, count + 1):
        t.process(pid, comm=f"p{pid}")
        t.drm_fd(pid, 3, make(pid))


@pytest.mark.parametrize(
    ("count", "denied", "clients"),
    [
        (10, 0, 10),
        (10, 5, 5),  # half is not most
        (6, 5, 1),  # most, but only a handful
        (1, 1, 0),
    ],
)
def test_unreadable_processes_are_counted(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], count: int, denied: int, clients: int
) -> None:
    _tree(rec_tree, rec_make_fdinfo, count)
    opener = _denying(str(rec_tree.root), set(range(1, denied + 1)))
    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm, opener=opener)
    assert (scan.stats.unreadable_processes, len(scan.clients)) == (denied, clients)


@pytest.mark.parametrize(("count", "denied"), [(7, 6), (119, 118), (12, 7)])
def test_most_processes_unreadable_is_an_error(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], count: int, denied: int
) -> None:
    _tree(rec_tree, rec_make_fdinfo, count)
    opener = _denying(str(rec_tree.root), set(range(1, denied + 1)))
    with pytest.raises(ScanPermissionError) as caught:
        scan_proc(str(rec_tree.root), rec_tree.is_drm, opener=opener)
    assert caught.value.strerror == (
        f"{denied} of {count} processes could not be read (permission denied on "
        "/proc/<pid>/fd): run the recorder as root or with CAP_SYS_PTRACE (and in the "
        "host's PID namespace when containerised)"
    )
    assert (caught.value.unreadable, caught.value.examined) == (denied, count)


def test_the_recorder_fails_loudly(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``sample``: an error naming the fix instead of an empty snapshot."""
    _tree(rec_tree, rec_make_fdinfo, 8)
    root = str(rec_tree.root)
    real = os.open
    deny = _denying(root, set(range(1, 9)))

    def opener(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if dir_fd is not None and path == "fd":
            return deny(path, flags, mode, dir_fd=dir_fd)
        return real(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", opener)
    with pytest.raises(OutputError, match=r"^cannot scan .*/proc: 8 of 8 processes could not"):
        sample(root, DEFAULT_RULES, None, None, is_drm=rec_tree.is_drm)


# --- the real kernel: root without CAP_SYS_PTRACE ---------------------------------------------

_CAP_SYS_PTRACE = 19  # include/uapi/linux/capability.h
_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _drop_sys_ptrace() -> None:
    """Drop CAP_SYS_PTRACE from this process (capget/capset through libc)."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    mask = ~(1 << _CAP_SYS_PTRACE) & 0xFFFFFFFF
    data[0].effective &= mask
    data[0].permitted &= mask
    data[0].inheritable &= mask
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def test_root_without_ptrace_rights_counts_the_process_not_its_descriptors() -> None:
    """Root without CAP_SYS_PTRACE opens and lists another user's ``fd/`` (a file-permission
    check root passes) and is refused each link (the ptrace check): the process is unreadable,
    which the permission check weighs, not a handful of unreadable descriptors that leave an
    empty card with exit 0."""
    if os.geteuid() != 0:
        pytest.skip("needs root, as CI runs; the non-root case is refused at fd/ (tests above)")
    hold_r, hold_w = os.pipe()
    target = os.fork()
    if target == 0:  # pragma: no cover - runs in the child: another user's process
        try:
            os.close(hold_w)
            os.setgid(65534)
            os.setuid(65534)
            os.read(hold_r, 1)
        finally:
            os._exit(0)  # never back into pytest from a forked child
    os.close(hold_r)
    result_r, result_w = os.pipe()
    checker = os.fork()
    if checker == 0:  # pragma: no cover - runs in the child, reported through the pipe
        code = 1
        try:
            _drop_sys_ptrace()
            pid_dfd = os.open(f"/proc/{target}", os.O_RDONLY | os.O_DIRECTORY)
            listed = os.listdir(os.open("fd", os.O_RDONLY | os.O_DIRECTORY, dir_fd=pid_dfd))
            scanner = _Scanner("/proc", lambda st: False, os.open, None)
            found = scanner.drm_descriptors(target, pid_dfd)
            s = scanner.stats
            report = (bool(listed), found, s.unreadable_processes, s.unreadable, s.descriptors)
            os.write(result_w, repr(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(result_w)
    try:
        report = os.read(result_r, 4096).decode()
        _, status = os.waitpid(checker, 0)
    finally:
        os.close(result_r)
        os.close(hold_w)
        os.waitpid(target, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    listed, found, processes, unreadable, descriptors = ast.literal_eval(report)
    assert listed, "fd/ was not listed: the case this test is about did not happen"
    assert (found, processes, unreadable) == (None, 1, 1)
    assert descriptors >= 3


def test_processes_without_descriptors_do_not_dilute_the_refusals(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """A real host has a hundred kernel threads or more, each with an empty ``fd/`` that any
    user may list.  They test no right: 8 refusing processes of 10 holding descriptors is
    most, whatever the 30 empty ones."""
    _tree(rec_tree, rec_make_fdinfo, 10)
    for pid in range(100, 130):
        rec_tree.process(pid, comm=f"kworker/{pid}")
    opener = _denying(str(rec_tree.root), set(range(1, 9)))
    with pytest.raises(ScanPermissionError) as caught:
        scan_proc(str(rec_tree.root), rec_tree.is_drm, opener=opener)
    assert (caught.value.unreadable, caught.value.examined) == (8, 10)
