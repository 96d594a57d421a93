"""Other processes' open files, compared (``kcmp``) and held (``pidfd_getfd``) by the scan.

Each open file read once: before a DRM descriptor's fdinfo is read it is compared with the
open files already read (``kcmp(pid1, pid2, KCMP_FILE, fd1, fd2)``, through ``ctypes``);
one that shares an open file with a descriptor already read (``dup()``, ``fork()``,
``SCM_RIGHTS``) takes that result without a read (:attr:`ScanStats.fdinfo_reads_saved`).
``kcmp`` orders open files, so the comparison is a binary search.  What it compares with is
the scan's own descriptor of each file read, taken with ``pidfd_getfd`` before the read (the
text read is that of the file held): a descriptor number of another process can be given
another file at any time (``dup2``, close and open), and compared by number it would lend
the file read earlier to whatever the number holds now.  The scan runs in a thread with a
descriptor table of its own (``unshare(CLONE_FILES)``), so the files it holds are in no
``/proc/<pid>/fd`` another scanner walks, and all are closed when it ends; a file its holders
close meanwhile is released at the end of the scan, not before.  This is used only on the
real ``/proc`` of this PID namespace (``<root>/proc/self`` is this process) and stops for the
rest of the scan when refused (``EPERM`` from seccomp or without ptrace rights, ``ENOSYS``);
then, as on a simulated tree, every DRM descriptor's fdinfo is read and clients are
deduplicated by ``(drm-pdev, drm-client-id)`` after reading (:attr:`ProcScan.dedupe` says
which).  Where ``unshare`` is refused (Docker's default seccomp profile without
``CAP_SYS_ADMIN``) nothing is held: files held in the process's own table would make a
concurrent scanner count this process as a holder of every client, so every DRM fdinfo is
read instead.  An injected comparator (tests, simulated trees) compares descriptors by number.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from typing import TypeVar

from cardshare.recorder.procfs import DIR_FLAGS

__all__ = [
    "DedupeUnavailable",
    "FileOrder",
    "Holder",
    "TakeFile",
    "in_own_table",
    "kcmp_file_order",
    "pidfd_take_file",
]

# The order of two open files: (pid1, fd1, pid2, fd2) -> <0, 0 (same open file) or >0.
# Raises DedupeUnavailable when comparing is refused for good, OSError (ESRCH, EBADF) when
# one side is gone.
FileOrder = Callable[[int, int, int, int], int]


class DedupeUnavailable(Exception):
    """Comparing open files is refused (seccomp, no ptrace rights, no kcmp in the kernel)."""


# kcmp(2): syscall numbers of 64-bit ABIs (x86_64: arch/x86/entry/syscalls/syscall_64.tbl;
# the generic table, include/uapi/asm-generic/unistd.h, for arm64, riscv64, loongarch64).
_KCMP_NR = {"x86_64": 312, "aarch64": 272, "arm64": 272, "riscv64": 272, "loongarch64": 272}
_KCMP_FILE = 0
# pidfd_getfd(2): 438 in both tables above; CLONE_FILES for unshare(2); PIDFD_THREAD (6.9) is
# O_EXCL, for a thread's pidfd.
_PIDFD_GETFD_NR = 438
_CLONE_FILES = 0x400
_PIDFD_THREAD = os.O_EXCL
# Errors that say kcmp cannot be used at all (as opposed to a process or fd being gone).
_KCMP_REFUSED = frozenset({errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EINVAL})


def kcmp_file_order() -> FileOrder | None:
    """``kcmp(KCMP_FILE)`` as a :data:`FileOrder`, or ``None`` on an ABI without a known number.

    Returns -1, 0 or 1 as kcmp returns 1 (less), 0 (same open file) or 2 (greater); raises
    :class:`DedupeUnavailable` for ``ENOSYS``, ``EPERM``, ``EACCES``, ``EINVAL`` or an
    unordered answer, and ``OSError`` otherwise (``ESRCH``, ``EBADF``: one side is gone).
    """
    import ctypes  # only where kcmp is used
    import platform

    if ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    number = _KCMP_NR.get(platform.machine())
    if number is None:
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    # No argtypes: the arguments go as C ints, which libffi widens to the 64-bit registers
    # syscall() reads (pids, descriptor numbers and the type are small and not negative);
    # converting each to a c_long costs more than the system call (about 2.5 us a call
    # against 1.6 us here), and a scan makes one call per DRM descriptor or more.
    get_errno = ctypes.get_errno
    kcmp_file = _KCMP_FILE

    def order(pid1: int, fd1: int, pid2: int, fd2: int) -> int:
        ret: int = syscall(number, pid1, pid2, kcmp_file, fd1, fd2)
        if ret == 0:
            return 0
        if ret == 1:
            return -1
        if ret == 2:
            return 1
        if ret < 0:
            err = get_errno()
            if err in _KCMP_REFUSED:
                raise DedupeUnavailable(os.strerror(err))
            raise OSError(err, os.strerror(err))
        raise DedupeUnavailable(f"kcmp gave no order ({ret})")

    return order


# Takes a copy of a descriptor of another process: (pidfd, fd) -> our new descriptor.
TakeFile = Callable[[int, int], int]


def _syscalls() -> tuple[Callable[..., int], Callable[[int], int]] | None:
    """``(syscall, unshare)`` from the C library, or ``None`` where the ABI is not known."""
    import ctypes
    import platform

    if ctypes.sizeof(ctypes.c_void_p) != 8 or platform.machine() not in _KCMP_NR:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall, unshare = libc.syscall, libc.unshare
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    unshare.restype = ctypes.c_int
    unshare.argtypes = [ctypes.c_int]

    def checked_unshare(flags: int) -> int:
        if unshare(flags) < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return 0

    return syscall, checked_unshare


def pidfd_take_file() -> TakeFile | None:
    """``pidfd_getfd(pidfd, fd, 0)`` as a :data:`TakeFile`, or ``None`` on an unknown ABI.

    Raises :class:`DedupeUnavailable` when refused (``EPERM``, ``EACCES``: no ptrace attach
    right; ``ENOSYS``: before Linux 5.6) and ``OSError`` otherwise (``EBADF``, ``ESRCH``: the
    descriptor or the process is gone).
    """
    import ctypes

    found = _syscalls()
    if found is None:
        return None
    syscall = found[0]

    def take(pidfd: int, fd: int) -> int:
        ret = int(
            syscall(
                ctypes.c_long(_PIDFD_GETFD_NR),
                ctypes.c_long(pidfd),
                ctypes.c_long(fd),
                ctypes.c_long(0),
            )
        )
        if ret < 0:
            err = ctypes.get_errno()
            if err in _KCMP_REFUSED and err != errno.EINVAL:
                raise DedupeUnavailable(os.strerror(err))
            raise OSError(err, os.strerror(err))
        return ret

    return take


class Holder:
    """The scan's own references to the open files it read (``pidfd_getfd``).

    Made in the scanning thread, whose descriptor table is its own (``unshare(CLONE_FILES)``,
    see :func:`in_own_table`): the files held are in no ``/proc/<pid>/fd`` another scanner
    walks, and all are closed when the scan ends, at the latest when its thread does.
    """

    def __init__(self, take: TakeFile) -> None:
        self.take = take
        self.tid = threading.get_native_id()
        # our own fdinfo, where a held file's text is read
        self.dfd = os.open("/proc/thread-self", DIR_FLAGS)
        self.held: list[int] = []
        self.pidfd: tuple[int, int] | None = None  # (pid, pidfd) of the process being read

    def hold(self, pid: int, fd: int, thread: bool) -> int:
        """Our descriptor of the open file at ``fd`` of ``pid`` (a thread's id when
        ``thread``).  Raises :class:`DedupeUnavailable` when refused, ``OSError`` otherwise."""
        if self.pidfd is None or self.pidfd[0] != pid:
            self.drop_pidfd()
            try:
                self.pidfd = (pid, os.pidfd_open(pid, _PIDFD_THREAD if thread else 0))
            except OSError as exc:
                if exc.errno in (errno.ENOSYS, errno.EPERM):  # before Linux 5.3, seccomp
                    raise DedupeUnavailable(os.strerror(exc.errno)) from None
                raise
        held = self.take(self.pidfd[1], fd)
        self.held.append(held)
        return held

    def release(self, held: int) -> None:
        self.held.remove(held)
        os.close(held)

    def drop_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd[1])
            self.pidfd = None

    def close(self) -> None:
        self.drop_pidfd()
        for held in self.held:
            os.close(held)
        self.held.clear()
        os.close(self.dfd)


_T = TypeVar("_T")


def in_own_table(work: Callable[[bool], _T]) -> _T:
    """``work(private)`` run in a thread with a descriptor table of its own.

    ``unshare(CLONE_FILES)`` gives the thread a copy of the table: what it opens is in no
    ``/proc/<pid>/fd`` (that lists the leader's table), and all of it is closed when the
    thread ends.  ``private`` is false when the kernel refused (the work then holds nothing).
    """
    found = _syscalls()
    outcome: list[_T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            private = False
            if found is not None:
                try:
                    private = found[1](_CLONE_FILES) == 0
                except OSError:
                    private = False
            outcome.append(work(private))
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    worker = threading.Thread(target=run, name="cardshare-scan")
    worker.start()
    worker.join()
    if failure:
        raise failure[0]
    return outcome[0]
