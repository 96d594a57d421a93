"""Issue 9, item 7: no permission is an error, not an empty card."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

import pytest

from cardshare.naming import DEFAULT_RULES
from cardshare.procscan import ScanPermissionError, scan_proc
from cardshare.recorder import OutputError, sample


def _denying(root: str, pids: set[int]) -> Callable[..., int]:
    """An opener refusing ``fd/`` of ``pids`` as the kernel does without ptrace rights (tests
    run as root, where chmod stops nothing)."""
    denied = {f"{root}/proc/{pid}" for pid in pids}

    def opener(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if path == "fd" and dir_fd is not None and os.readlink(f"/proc/self/fd/{dir_fd}") in denied:
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
