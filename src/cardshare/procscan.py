"""Find the DRM clients of a host by scanning ``<root>/proc``.

For each process, each descriptor whose ``stat()`` (following the ``fd/<n>`` link) is a
character device with major 226 has its ``fdinfo/<n>`` read.  A DRM client is one open DRM
file, identified by ``(drm-pdev, drm-client-id)``: duplicated descriptors and descriptors
inherited by other processes repeat it and are counted once (their pids are collected).

One process, one directory: ``<root>/proc/<pid>`` is opened once (``O_DIRECTORY``) and its
``fd/``, ``fdinfo/``, ``stat``, ``comm``, ``cmdline``, ``cgroup`` and ``ns/mnt`` are read
relative to that descriptor, so a pid that exits and is reused mid-scan cannot lend its
name to another process's client: procfs ties the directory to the process, not to its
number, and once that process is gone every read through it fails (``ESRCH``, or ``ENOENT``
on a lookup), whoever has the pid by then.  So the reads of one process
need no second look at its start time: a record whose process is reaped before its cgroup
and command line are read is dropped (counted in :attr:`ScanStats.vanished`) rather than kept
partial.  A process still exiting reads on: its command line is empty once its memory map is
gone, but it holds its descriptors, and its clients their memory, until its files are
closed, so its clients are kept (named by its container, else its comm).  The start time
(field 22 of ``stat``) is read once and kept with the record, for the reads made later by
pid: a process holding only clients that a lower pid already named keeps a short record
(comm, start time); after the walk, the record of each client's naming process is completed
through ``<root>/proc/<pid>`` opened again, used only if its start time is the one
recorded.  Trees without ``stat`` (the lab's simulated ``/proc``) have no start
time and skip those checks; there a missing file is read as empty.

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

A process that vanishes mid-scan, a descriptor closed between listing and reading, or a file
that cannot be read is skipped and counted in :class:`ScanStats`; none of them stops the scan
alone.  But when most processes refuse their descriptors (no ptrace permission: a user
other than the owner is refused ``fd/`` itself, root without ``CAP_SYS_PTRACE`` each link in
it), the scan raises :class:`ScanPermissionError` instead of returning an empty card.
Processes with no descriptor (kernel threads, zombies) test no right and are not counted.

A process whose leader thread exited while others run (``pthread_exit()`` in ``main``) lists
an empty ``fd/`` though it holds its descriptors: they are read under ``task/<tid>/`` of a
live thread (compared by that thread's id), and its clients recorded under its pid.
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import re
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeAlias, TypeVar

from cardshare.fdinfo import FdInfo, parse_fdinfo
from cardshare.naming import (
    BROKER_COMMS,
    ContainerRef,
    container_from_cgroup,
    naming_pid,
    primary_cgroup,
)

__all__ = [
    "DRM_MAJOR",
    "UNREADABLE_MIN",
    "DedupeUnavailable",
    "DrmClient",
    "FileOrder",
    "Opener",
    "ProcScan",
    "ProcessInfo",
    "ScanPermissionError",
    "ScanStats",
    "is_drm_char_device",
    "kcmp_file_order",
    "parse_stat",
    "read_process_info",
    "scan_proc",
]

DRM_MAJOR = 226
UNKNOWN_PDEV = "unknown"
# More than this many processes refusing their descriptors, and more than half of those
# examined (holding descriptors, or refusing them): the scan is an error (ScanPermissionError).
UNREADABLE_MIN = 5

IsDrm = Callable[[os.stat_result], bool]
ClientKey = tuple[str, int]
# The order of two open files: (pid1, fd1, pid2, fd2) -> <0, 0 (same open file) or >0.
# Raises DedupeUnavailable when comparing is refused for good, OSError (ESRCH, EBADF) when
# one side is gone.
FileOrder = Callable[[int, int, int, int], int]


class Opener(Protocol):
    """``os.open``'s signature: every file and directory of the scan is opened through it."""

    def __call__(
        self, path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None
    ) -> int: ...


class DedupeUnavailable(Exception):
    """Comparing open files is refused (seccomp, no ptrace rights, no kcmp in the kernel)."""


class ScanPermissionError(PermissionError):
    """Most processes could not be read: the scan would show an empty card."""

    def __init__(self, unreadable: int, examined: int) -> None:
        message = (
            f"{unreadable} of {examined} processes could not be read (permission denied on "
            "/proc/<pid>/fd): run the recorder as root or with CAP_SYS_PTRACE (and in the "
            "host's PID namespace when containerised)"
        )
        super().__init__(errno.EACCES, message)
        self.unreadable = unreadable
        self.examined = examined


_READ_SIZE = 65536
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_CLOEXEC
# Link targets of descriptors that are not paths (never a device node).
_PSEUDO_FILES = ("socket:", "pipe:", "anon_inode:")
_CLIENT_ID_RE = re.compile(rb"^drm-client-id:[ \t]*([0-9]+)[ \t]*$", re.MULTILINE)
_PDEV_RE = re.compile(rb"^drm-pdev:[ \t]*(\S+)[ \t]*$", re.MULTILINE)
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


def is_drm_char_device(st: os.stat_result) -> bool:
    """True for a character device with the DRM major number (226)."""
    return stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == DRM_MAJOR


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
    syscall.argtypes = [ctypes.c_long] * 6
    get_errno = ctypes.get_errno
    answers = {0: 0, 1: -1, 2: 1}

    def order(pid1: int, fd1: int, pid2: int, fd2: int) -> int:
        ret = syscall(number, pid1, pid2, _KCMP_FILE, fd1, fd2)
        if ret < 0:
            err = get_errno()
            if err in _KCMP_REFUSED:
                raise DedupeUnavailable(os.strerror(err))
            raise OSError(err, os.strerror(err))
        answer = answers.get(ret)
        if answer is None:
            raise DedupeUnavailable(f"kcmp gave no order ({ret})")
        return answer

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


def parse_stat(data: bytes) -> tuple[str, int] | None:
    """``(comm, starttime)`` from the text of ``/proc/<pid>/stat``; ``None`` if malformed.

    The comm is between the first ``(`` and the last ``)`` (it may hold spaces and
    parentheses); the start time is field 22, in clock ticks since boot.
    """
    start = data.find(b"(")
    end = data.rfind(b")")
    if start < 0 or end < start:
        return None
    fields = data[end + 2 :].split(None, 20)  # up to the start time
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    return data[start + 1 : end].decode("utf-8", "replace"), int(fields[19])


def _leader_exited(data: bytes) -> bool:
    """Whether a ``stat`` text is that of a thread group whose leader has exited while other
    threads run: state ``Z`` (field 3) and more than one thread (field 20)."""
    end = data.rfind(b")")
    fields = data[end + 2 :].split(None, 18) if end >= 0 else []
    return len(fields) > 17 and fields[0] == b"Z" and fields[17].isdigit() and fields[17] != b"1"


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """What naming needs to know about a process.

    ``start_time`` is field 22 of its ``stat`` (clock ticks since boot; ``None`` when the tree
    has no ``stat``): with the pid, it names one process, whatever reuses the pid later.
    ``cmdline`` is ``None`` in the short record of a process that holds only clients another
    process names: its comm and start time were read, its cgroup only for a broker's comm
    (``container`` ``None`` and ``cgroup`` empty otherwise); :func:`scan_proc` completes the
    record of every naming process.
    """

    pid: int
    comm: str
    cmdline: str | None
    container: ContainerRef | None
    start_time: int | None = None
    cgroup: str = ""  # the path that places it (naming.primary_cgroup): brokers are told by it


@dataclass(slots=True)
class DrmClient:
    """One DRM client (open DRM file) and the processes holding it."""

    pdev: str
    client_id: int
    fdinfo: FdInfo
    pids: set[int] = field(default_factory=set)
    descriptors: int = 0

    @property
    def key(self) -> str:
        return f"{self.pdev}/{self.client_id}"


@dataclass(slots=True)
class ScanStats:
    """Counters of one scan."""

    processes: int = 0
    descriptors: int = 0
    drm_descriptors: int = 0
    vanished: int = 0  # processes or descriptors gone between listing and reading
    unreadable: int = 0  # permission or I/O errors
    not_clients: int = 0  # DRM descriptors whose fdinfo has no drm-driver/drm-client-id
    malformed_lines: int = 0
    unreadable_processes: int = 0  # processes refusing fd/ or its links (EACCES/EPERM)
    reused: int = 0  # processes dropped: a holder of an open file they share is gone (kcmp)
    fdinfo_reads: int = 0  # DRM fdinfo files read
    fdinfo_reads_saved: int = 0  # DRM descriptors sharing an open file already read

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class ProcScan:
    """The result of :func:`scan_proc`.

    ``processes`` holds the process that names each client: the lowest pid holding it (every
    holder with ``every_holder=True``, those that name nothing without their ``cmdline``).
    ``dedupe`` says how shared open files were found:
    ``"kcmp"`` before reading, ``"compare"`` (an injected :data:`FileOrder`) likewise, or
    ``"client-id"`` (every DRM fdinfo read, clients merged by ``(drm-pdev, drm-client-id)``).
    """

    clients: dict[ClientKey, DrmClient] = field(default_factory=dict)
    processes: dict[int, ProcessInfo] = field(default_factory=dict)
    stats: ScanStats = field(default_factory=ScanStats)
    dedupe: str = "client-id"


def _read_fd(fd: int) -> bytes:
    # A short read is the end of a regular or seq_file (proc) file: one read suffices for
    # the small files read here.
    chunk = os.read(fd, _READ_SIZE)
    if len(chunk) < _READ_SIZE:
        return chunk
    chunks = [chunk]
    while chunk:
        chunk = os.read(fd, _READ_SIZE)
        chunks.append(chunk)
    return b"".join(chunks)


def _read_at(opener: Opener, name: str, dir_fd: int | None) -> bytes:
    fd = opener(name, _FILE_FLAGS, dir_fd=dir_fd)
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


# What procfs answers for a process that is gone: ENOENT from a lookup by pid or of a file it
# no longer has, ESRCH through its directory (the permission check finds no task) or from a
# file opened before it exited.
_GONE = (FileNotFoundError, ProcessLookupError)


class _ProcessGone(Exception):
    """A read through a process's directory failed because the process is gone."""


def _text_at(opener: Opener, name: str, dir_fd: int, gone_if_missing: bool = False) -> str:
    """The text of a file of a process; ``""`` when it cannot be read.

    ``gone_if_missing`` (a process whose ``stat`` was read, as on every real ``/proc``): a file
    that is not there means the process is gone (raises :class:`_ProcessGone`), not that the
    tree lacks it.
    """
    try:
        return _read_at(opener, name, dir_fd).decode("utf-8", "replace")
    except _GONE:
        if gone_if_missing:
            raise _ProcessGone(name) from None
        return ""
    except OSError:
        return ""


def _process_info(
    opener: Opener,
    pid_dfd: int,
    pid: int,
    comm: str | None,
    start_time: int | None,
    complete: bool = True,
) -> ProcessInfo:
    """comm (unless known from ``stat``), cgroup and cmdline, relative to the process dir.

    Not ``complete``: the record of a holder that may name no client, which naming_pid
    reads by comm and cgroup only; the cgroup is read only for a broker's comm (a broker by
    its unit is found when the record is completed, see complete_naming).  Raises
    :class:`_ProcessGone` when the process exits while its record is read (known by its start
    time, so only where the tree has ``stat``): a partial record would name it wrongly.
    """
    gone_if_missing = start_time is not None
    if comm is None:
        comm = _text_at(opener, "comm", pid_dfd).rstrip("\n")
    if not complete and comm not in BROKER_COMMS:
        return ProcessInfo(pid=pid, comm=comm, cmdline=None, container=None, start_time=start_time)
    container, placed = _cgroup_facts(_text_at(opener, "cgroup", pid_dfd, gone_if_missing))
    cmdline = None
    if complete:
        cmdline = _text_at(opener, "cmdline", pid_dfd, gone_if_missing).replace("\0", " ").strip()
    return ProcessInfo(
        pid=pid,
        comm=comm,
        cmdline=cmdline,
        container=container,
        start_time=start_time,
        cgroup=placed,
    )


@functools.lru_cache(maxsize=4096)
def _cgroup_facts(text: str) -> tuple[ContainerRef | None, str]:
    """The container and the placing path of a cgroup file's text. The processes of one
    container share one text, and every holder of a client is read: each text is parsed once
    (both results are immutable)."""
    return container_from_cgroup(text), primary_cgroup(text)


def read_process_info(proc_dir: str, pid: int, opener: Opener = os.open) -> ProcessInfo:
    """Read comm, cmdline and cgroup of a process; missing pieces become empty."""
    try:
        pid_dfd = opener(f"{proc_dir}/{pid}", _DIR_FLAGS)
    except OSError:
        return ProcessInfo(pid=pid, comm="", cmdline="", container=None)
    try:
        parsed = _stat_of(opener, pid_dfd)
        comm, start = (parsed[0], parsed[1]) if parsed is not None else (None, None)
        return _process_info(opener, pid_dfd, pid, comm, start)
    except _ProcessGone:
        return ProcessInfo(pid=pid, comm="", cmdline="", container=None)
    finally:
        os.close(pid_dfd)


def _stat_of(opener: Opener, pid_dfd: int) -> tuple[str, int] | None:
    try:
        return parse_stat(_read_at(opener, "stat", pid_dfd))
    except OSError:
        return None


def _quick_key(data: bytes) -> ClientKey | None:
    """The client key without a full parse (a repeated client need not be parsed again)."""
    cid = _CLIENT_ID_RE.search(data)
    if cid is None:
        return None
    pdev = _PDEV_RE.search(data)
    return (pdev.group(1).decode("ascii", "replace") if pdev else UNKNOWN_PDEV, int(cid.group(1)))


@dataclass(slots=True)
class _Rep:
    """An open file already read: a descriptor holding it and what its fdinfo said.

    With kcmp, ``pid`` is the scanning thread and ``fd`` the scan's own descriptor of the file
    (:class:`_Holder`), so no other process can change what it stands for; with an injected
    comparator (a simulated tree), the descriptor read and the start time of its process.
    """

    pid: int
    fd: int
    key: ClientKey | None  # None: a DRM descriptor that is not a client
    start_time: int | None
    held: bool = False


class _Holder:
    """The scan's own references to the open files it read (``pidfd_getfd``).

    Made in the scanning thread, whose descriptor table is its own (``unshare(CLONE_FILES)``,
    see :func:`_in_own_table`): the files held are in no ``/proc/<pid>/fd`` another scanner
    walks, and all are closed when the scan ends, at the latest when its thread does.
    """

    def __init__(self, take: TakeFile) -> None:
        self.take = take
        self.tid = threading.get_native_id()
        # our own fdinfo, where a held file's text is read
        self.dfd = os.open("/proc/thread-self", _DIR_FLAGS)
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


@dataclass(slots=True)
class _Thread:
    """A live thread of a process whose leader has exited: its descriptors are read there."""

    tid: int
    dfd: int  # task/<tid>, opened through the process's directory
    start_time: int | None


# What one DRM descriptor resolved to: a client key, None (not a client), or skipped.
_SKIP: Literal["skip"] = "skip"
_EMPTY: Literal["empty"] = "empty"  # an fd/ that lists nothing (list_drm)
_Outcome: TypeAlias = ClientKey | Literal["skip"] | None


class _Scanner:
    def __init__(
        self,
        proc_dir: str,
        is_drm: IsDrm,
        opener: Opener,
        order: FileOrder | None,
        holder: _Holder | None = None,
    ) -> None:
        self.proc_dir = proc_dir
        self.is_drm = is_drm
        self.opener = opener
        self.order = order
        self.holder = holder
        # the representative last matched or read: the next descriptor, of this process or
        # of the next (a forked child, often the next pid), is compared with it first
        self.hint: _Rep | None = None
        self.result = ProcScan()
        self.stats = self.result.stats
        # per mount namespace: link target -> is a DRM device
        self.cache: dict[str, dict[str, bool]] = {}
        self.parsed: dict[bytes, tuple[ClientKey, FdInfo] | tuple[None, None]] = {}
        self.reps: list[_Rep] = []  # sorted by ``order``
        # the last fdinfo text the process being read gave, and its outcome (read_fdinfo)
        self.last_text: tuple[bytes, ClientKey | None] | None = None
        self.vanished_processes = 0
        # processes with no descriptor (kernel threads, zombies): they say nothing of our rights
        self.empty_processes = 0

    # --- descriptors -----------------------------------------------------------------------

    def drm_descriptors(self, pid: int, pid_dfd: int) -> tuple[list[str], _Thread | None] | None:
        """The DRM descriptors of a process and, when they are a thread's, that thread
        (``None`` when its fd directory is gone or closed; the caller closes ``_Thread.dfd``).

        A process whose leader called ``pthread_exit()`` while other threads run is a zombie
        leader: its ``fd/`` lists empty and its ``ns/mnt`` is gone, yet its descriptors (and
        the memory of its clients) are held, shown under ``task/<tid>/`` of a live thread;
        ``kcmp`` takes that thread's id too.  Only a process whose ``fd/`` lists empty is
        checked (one read of its ``stat``).
        """
        listed = self.list_drm(pid, pid_dfd)
        if listed is None:
            return None
        if isinstance(listed, list):
            return listed, None
        thread = self.live_thread(pid, pid_dfd)
        if thread is not None:
            listed = self.list_drm(thread.tid, thread.dfd)
            if isinstance(listed, list):
                return listed, thread
            os.close(thread.dfd)
            if listed is None:
                return None
        self.empty_processes += 1
        return [], None

    def live_thread(self, pid: int, pid_dfd: int) -> _Thread | None:
        """A live thread of the process when its leader has exited (see drm_descriptors)."""
        opener = self.opener
        try:
            if not _leader_exited(_read_at(opener, "stat", pid_dfd)):
                return None
            task_dfd = opener("task", _DIR_FLAGS, dir_fd=pid_dfd)
            try:
                tids = sorted(int(t) for t in os.listdir(task_dfd) if t.isdigit())
                for tid in tids:
                    if tid == pid:
                        continue
                    try:
                        dfd = opener(str(tid), _DIR_FLAGS, dir_fd=task_dfd)
                    except OSError:
                        continue  # that thread ended meanwhile
                    parsed = _stat_of(opener, dfd)
                    return _Thread(tid, dfd, parsed[1] if parsed is not None else None)
            finally:
                os.close(task_dfd)
        except OSError:
            pass
        return None

    def list_drm(self, pid: int, pid_dfd: int) -> list[str] | Literal["empty"] | None:
        """The DRM descriptors under ``fd/`` of a process or thread directory: ``"empty"``
        when it lists none, ``None`` when it is gone or refused (counted).

        Each link target is read first: kernel pseudo files (``socket:``, ``pipe:``,
        ``anon_inode:``) are never DRM devices, and a path already checked in the same mount
        namespace is not ``stat()``-ed again.  Otherwise the descriptor itself is
        ``stat()``-ed (following the link), which works for real and simulated trees alike.
        """
        stats = self.stats
        try:
            dfd = self.opener("fd", _DIR_FLAGS, dir_fd=pid_dfd)
        except _GONE:
            stats.vanished += 1
            self.vanished_processes += 1
            return None
        except PermissionError:
            stats.unreadable += 1
            stats.unreadable_processes += 1
            return None
        except OSError:
            stats.unreadable += 1
            return None
        try:
            fds = os.listdir(dfd)
            if not fds:
                return _EMPTY
            stats.descriptors += len(fds)
            fds, targets = self.link_targets(fds, dfd)
            # what each path is, learnt once per mount namespace
            known = self.cache.setdefault(self.namespace_key(pid, pid_dfd), {})
            drm: list[bool | None] = list(map(known.get, targets))
            if None in drm:
                for i, answer in enumerate(drm):
                    if answer is None:
                        drm[i] = self.learn(fds[i], targets[i], dfd, known)
            return list(itertools.compress(fds, drm))
        except PermissionError:
            stats.unreadable += 1
            stats.unreadable_processes += 1
            return None
        except OSError:
            stats.unreadable += 1
            return None
        finally:
            os.close(dfd)

    def learn(self, fd: str, target: str, dfd: int, known: dict[str, bool]) -> bool:
        """Whether a descriptor not known yet is a DRM device; paths are remembered."""
        if target.startswith(_PSEUDO_FILES):
            return False
        try:
            st = os.stat(fd, dir_fd=dfd)
        except _GONE:
            self.stats.vanished += 1
            return False
        except OSError:
            self.stats.unreadable += 1
            return False
        drm = known[target] = self.is_drm(st)
        return drm

    def link_targets(self, fds: list[str], dfd: int) -> tuple[list[str], list[str]]:
        """The descriptors still open and their link targets (closed ones are counted).

        Raises ``PermissionError`` when a link is refused: the kernel checks ptrace rights on
        the links, not on listing ``fd/`` (root without ``CAP_SYS_PTRACE`` lists every
        process's descriptors and may read none), and the check is per process.
        """
        readlink = os.readlink
        try:  # the common case: no descriptor closed since the listing
            return fds, [readlink(fd, dir_fd=dfd) for fd in fds]
        except PermissionError:
            raise
        except OSError:
            pass
        still: list[str] = []
        targets: list[str] = []
        for fd in fds:
            try:
                targets.append(readlink(fd, dir_fd=dfd))
            except _GONE:
                self.stats.vanished += 1
                continue
            except PermissionError:
                raise
            except OSError:
                self.stats.unreadable += 1
                continue
            still.append(fd)
        return still, targets

    def namespace_key(self, pid: int, pid_dfd: int) -> str:
        """The mount namespace in which this process's fd link targets resolve.

        ``mnt:[<inode>]``; when ``ns/mnt`` cannot be read, a key of this process alone, so a
        path is never taken to mean the same file in two processes of unknown namespaces.
        """
        try:
            return os.readlink("ns/mnt", dir_fd=pid_dfd)
        except OSError:
            return f"unreadable:{self.proc_dir}/{pid}"

    # --- fdinfo ----------------------------------------------------------------------------

    def read_fdinfo(self, pid_dfd: int, fd: str, pending: dict[ClientKey, FdInfo]) -> _Outcome:
        try:
            ifd = self.opener(f"fdinfo/{fd}", _FILE_FLAGS, dir_fd=pid_dfd)
            try:
                data = os.read(ifd, _READ_SIZE)
                if len(data) == _READ_SIZE:  # a long text (see _read_fd)
                    data += _read_fd(ifd)
            finally:
                os.close(ifd)
        except _GONE:
            self.stats.vanished += 1
            return _SKIP
        except OSError:
            self.stats.unreadable += 1
            return _SKIP
        self.stats.fdinfo_reads += 1
        # Descriptors of one open file print one text: the process's last text is compared
        # first (its outcome is in ``pending`` or known), then the texts of the scan.
        last = self.last_text
        if last is not None and last[0] == data:
            key = last[1]
        else:
            known = self.parsed.get(data)
            if known is None:
                known = self.parse(data, pending)
            key, info = known
            if (
                key is not None
                and info is not None  # both or neither (parse)
                and key not in pending
                and key not in self.result.clients
            ):
                pending[key] = info
            self.last_text = (data, key)
        if key is None:
            self.stats.not_clients += 1
        return key

    def parse(
        self, data: bytes, pending: dict[ClientKey, FdInfo]
    ) -> tuple[ClientKey, FdInfo] | tuple[None, None]:
        """What a fdinfo text not seen in this scan says: ``(key, parsed)`` of a DRM client,
        ``(None, None)`` for a DRM file that is not one.  A text of a client already known
        (another descriptor's text differs only in ``pos`` or ``flags``) is not parsed."""
        quick = _quick_key(data)
        if quick is not None:
            found = pending.get(quick)
            if found is None and quick in self.result.clients:
                found = self.result.clients[quick].fdinfo
            if found is not None:
                return quick, found
        info = parse_fdinfo(data.decode("utf-8", "replace"))
        self.stats.malformed_lines += info.malformed
        if not info.is_drm_client or info.client_id is None:
            self.parsed[data] = (None, None)
            return None, None
        key = (info.pdev or UNKNOWN_PDEV, info.client_id)
        self.parsed[data] = (key, info)
        return key, info

    # --- open files already read -----------------------------------------------------------

    def find_rep(self, pid: int, fd: int, hint: _Rep | None) -> tuple[int, _Rep | None] | None:
        """``(insert position, equal representative)``; ``None`` when this fd is gone.

        Raises :class:`DedupeUnavailable` when comparing is refused.
        """
        order = self.order
        assert order is not None
        if hint is not None:
            try:
                if order(pid, fd, hint.pid, hint.fd) == 0:
                    return -1, hint
            except OSError:
                pass  # the search below sorts out which side is gone
        reps = self.reps
        lo, hi = 0, len(reps)
        while lo < hi:
            mid = (lo + hi) // 2
            rep = reps[mid]
            try:
                answer = order(pid, fd, rep.pid, rep.fd)
            except OSError:
                try:
                    order(pid, fd, pid, fd)
                except OSError:
                    return None  # our descriptor is gone
                del reps[mid]  # theirs is: forget it and search again
                lo, hi = 0, len(reps)
                continue
            if answer == 0:
                return mid, rep
            if answer < 0:
                hi = mid
            else:
                lo = mid + 1
        return lo, None

    def still_there(self, rep_pid: int, start_time: int | None) -> bool:
        """Whether pid ``rep_pid`` is still the process read earlier (same start time).

        A process read without a start time (a tree without ``stat``) cannot be checked.
        """
        if start_time is None:
            return True
        try:
            parsed = parse_stat(_read_at(self.opener, f"{self.proc_dir}/{rep_pid}/stat", None))
        except OSError:
            return False
        return parsed is not None and parsed[1] == start_time

    # --- one process -----------------------------------------------------------------------

    def read_unshared(
        self,
        pid: int,
        pid_dfd: int,
        start: int | None,
        drm_fds: list[str],
        pending: dict[ClientKey, FdInfo],
        mine: list[_Rep],
        others: set[tuple[int, int | None]],
        thread: bool = False,
    ) -> list[_Outcome]:
        """Each DRM descriptor's outcome, reading the fdinfo only of open files not read yet.

        The open files read here are added to the representatives (and to ``mine``); the
        holders of those read before by an injected comparator, with their start times, to
        ``others`` (held representatives need no such check).  ``pid`` is a thread's id when
        ``thread`` (a zombie leader's descriptors).
        """
        stats = self.stats
        outcomes: list[_Outcome] = []
        for fd in drm_fds:
            stats.drm_descriptors += 1
            found: tuple[int, _Rep | None] | None = (-1, None)
            if self.order is not None:
                try:
                    found = self.find_rep(pid, int(fd), self.hint)
                except DedupeUnavailable:
                    self.stop_dedupe()
            if found is None:
                stats.vanished += 1
                continue
            position, rep = found
            if rep is None and position >= 0 and self.holder is not None:
                got = self.read_held(pid, int(fd), position, pending, thread)
                if isinstance(got, _Rep):
                    rep = got  # the file held was read before, under another descriptor
                elif got is not None:
                    outcome, new = got
                    outcomes.append(outcome)
                    if new is not None:
                        mine.append(new)
                        self.hint = new
                    continue
                # None: not held (refused, or no thread pidfd), read through the process
            if rep is not None:
                stats.fdinfo_reads_saved += 1
                if rep.key is None:
                    stats.not_clients += 1
                if not rep.held and rep.pid != pid:
                    others.add((rep.pid, rep.start_time))
                outcomes.append(rep.key)
                self.hint = rep
                continue
            outcome = self.read_fdinfo(pid_dfd, fd, pending)
            outcomes.append(outcome)
            if outcome != _SKIP and self.order is not None and self.holder is None:
                # an injected comparator: the descriptor read stands for its file
                key = outcome if isinstance(outcome, tuple) else None
                self.hint = _Rep(pid, int(fd), key, start)
                self.reps.insert(position, self.hint)
                mine.append(self.hint)
        return outcomes

    def stop_dedupe(self) -> None:
        """Comparing or holding is refused: every DRM fdinfo is read from now on."""
        self.order = None
        self.hint = None
        self.result.dedupe = "client-id"

    def read_held(
        self, pid: int, fd: int, position: int, pending: dict[ClientKey, FdInfo], thread: bool
    ) -> tuple[_Outcome, _Rep | None] | _Rep | None:
        """Hold the open file at ``fd`` of ``pid`` and read its fdinfo through our own
        descriptor: ``(outcome, new representative)``; an existing representative when the
        file held turns out to be one read before (``fd`` was given another file since it was
        compared); ``None`` when holding is refused (the caller reads through the process).

        Holding first, then reading the file held, is what ties the text to the
        representative: the process may put another file on ``fd`` at any time.
        """
        holder = self.holder
        assert holder is not None
        stats = self.stats
        try:
            held = holder.hold(pid, fd, thread)
        except DedupeUnavailable:
            self.stop_dedupe()
            return None
        except (ProcessLookupError, FileNotFoundError):
            stats.vanished += 1
            return _SKIP, None
        except OSError as exc:
            if exc.errno == errno.EBADF:  # closed since it was listed
                stats.vanished += 1
                return _SKIP, None
            return None  # e.g. no thread pidfd before Linux 6.9: read it unheld
        try:
            drm = self.is_drm(os.fstat(held))
        except OSError:
            drm = False
        if not drm:  # the descriptor was given a file that is no DRM device since its stat
            holder.release(held)
            stats.vanished += 1
            return _SKIP, None
        try:
            position, rep = self.place(holder.tid, held, position)
        except DedupeUnavailable:
            self.stop_dedupe()
            position, rep = -1, None
        if rep is not None:
            holder.release(held)
            return rep
        outcome = self.read_fdinfo(holder.dfd, str(held), pending)
        if outcome == _SKIP or position < 0:
            holder.release(held)
            return outcome, None
        key = outcome if isinstance(outcome, tuple) else None
        new = _Rep(holder.tid, held, key, None, held=True)
        self.reps.insert(position, new)
        return outcome, new

    def place(self, tid: int, held: int, position: int) -> tuple[int, _Rep | None]:
        """Where a held file goes among the representatives, checked against its neighbours
        (all held, so the answers cannot change): the position the process's descriptor was
        found at when it still is the file held, else a search with the held file itself."""
        order = self.order
        assert order is not None
        reps = self.reps
        below = reps[position - 1] if position > 0 else None
        above = reps[position] if position < len(reps) else None
        if (below is None or order(tid, held, below.pid, below.fd) > 0) and (
            above is None or order(tid, held, above.pid, above.fd) < 0
        ):
            return position, None
        found = self.find_rep(tid, held, None)
        assert found is not None  # our own descriptor is not gone
        return found

    def process(self, pid: int, pid_dfd: int, every_holder: bool) -> None:
        found = self.drm_descriptors(pid, pid_dfd)
        if found is None:
            return
        drm_fds, thread = found
        try:
            if drm_fds:
                self.process_drm(pid, pid_dfd, drm_fds, thread, every_holder)
        finally:
            if thread is not None:
                os.close(thread.dfd)

    def process_drm(
        self,
        pid: int,
        pid_dfd: int,
        drm_fds: list[str],
        thread: _Thread | None,
        every_holder: bool,
    ) -> None:
        stats = self.stats
        opener = self.opener
        self.last_text = None
        # The start time, read through its directory when the process is known to matter:
        # the pid and start time name this process in later reads by pid (complete_naming,
        # still_there).  Reads through pid_dfd need no second look: they answer for this
        # process or fail (module docstring).  With held representatives it is needed only
        # for a record, so it is read then.
        comm: str | None = None
        start: int | None = None
        early = self.order is not None and self.holder is None
        if early:
            first = _stat_of(opener, pid_dfd)
            if first is not None:
                comm, start = first
        # where the descriptors are: the process's directory, or a live thread's
        if thread is None:
            holder, holder_dfd, holder_start = pid, pid_dfd, start
        else:
            holder, holder_dfd, holder_start = thread.tid, thread.dfd, thread.start_time
        pending: dict[ClientKey, FdInfo] = {}
        mine: list[_Rep] = []
        others: set[tuple[int, int | None]] = set()
        if self.order is None:  # every DRM fdinfo read (a simulated tree, no kcmp)
            stats.drm_descriptors += len(drm_fds)
            read = self.read_fdinfo
            outcomes = [read(holder_dfd, fd, pending) for fd in drm_fds]
        else:
            try:
                outcomes = self.read_unshared(
                    holder,
                    holder_dfd,
                    holder_start,
                    drm_fds,
                    pending,
                    mine,
                    others,
                    thread is not None,
                )
            finally:
                if self.holder is not None:
                    self.holder.drop_pidfd()
        keys = [o for o in outcomes if isinstance(o, tuple)]
        info: ProcessInfo | None = None
        dropped = False
        if pending or (every_holder and keys):
            # complete for a process that may name a new client; other holders are
            # completed later if one of them turns out to name (complete_naming)
            if not early:
                first = _stat_of(opener, pid_dfd)
                if first is not None:
                    comm, start = first
            try:
                info = _process_info(opener, pid_dfd, pid, comm, start, bool(pending))
            except _ProcessGone:
                stats.vanished += 1  # exited while being read: its record would be partial
                dropped = True
        if not dropped and others and not all(self.still_there(p, t) for p, t in others):
            stats.reused += 1  # a holder whose open file answered for ours is not there now
            dropped = True
        if dropped:
            # keep nothing of these reads (a file held stands for itself: it stays)
            mine_ids = {id(rep) for rep in mine if not rep.held}
            self.reps = [rep for rep in self.reps if id(rep) not in mine_ids]
            return
        clients = self.result.clients
        for key in keys:
            client = clients.get(key)
            if client is None:
                client = clients[key] = DrmClient(
                    pdev=key[0], client_id=key[1], fdinfo=pending[key]
                )
            client.pids.add(pid)
            client.descriptors += 1
        if info is not None:
            self.result.processes[pid] = info

    def complete_naming(self) -> None:
        """Complete the record of each client's naming process where the scan kept it short.

        The choice (naming.naming_pid) is made on what is known, the chosen record completed
        (cgroup and command line), and the choice made again, until the chosen record is
        complete.  Reading more only rules holders out (a broker by its unit), and a short
        record is never that of a broker by comm, so the end is the choice every holder's
        full record gives.  The process is opened again by pid and used only if its start
        time is the one recorded; one that exited (or whose pid was reused) meanwhile is
        dropped from ``processes`` and counted as vanished.
        """
        processes = self.result.processes
        for client in self.result.clients.values():
            while True:
                pid = naming_pid(client.pids, processes)
                info = processes.get(pid)
                if info is None or info.cmdline is not None:
                    break
                full = self.reread(info)
                if full is None:
                    del processes[pid]
                    self.stats.vanished += 1
                else:
                    processes[pid] = full

    def reread(self, info: ProcessInfo) -> ProcessInfo | None:
        """The complete record of the process ``info`` describes, or ``None`` when it is gone."""
        opener = self.opener
        try:
            pid_dfd = opener(f"{self.proc_dir}/{info.pid}", _DIR_FLAGS)
        except OSError:
            return None
        try:
            if info.start_time is not None:
                now = _stat_of(opener, pid_dfd)
                if now is None or now[1] != info.start_time:
                    return None
            return _process_info(opener, pid_dfd, info.pid, info.comm, info.start_time)
        except _ProcessGone:
            return None
        finally:
            os.close(pid_dfd)

    def check_permissions(self) -> None:
        stats = self.stats
        # those whose rights were tested: not gone, and holding descriptors or refusing them
        examined = stats.processes - self.vanished_processes - self.empty_processes
        denied = stats.unreadable_processes
        if denied > UNREADABLE_MIN and denied * 2 > examined:
            raise ScanPermissionError(denied, examined)


def _same_proc(proc_dir: str) -> bool:
    """Whether the tree is the ``/proc`` of this PID namespace (kcmp takes its pids)."""
    try:
        return os.readlink(os.path.join(proc_dir, "self")) == str(os.getpid())
    except OSError:
        return False


_T = TypeVar("_T")


def _in_own_table(work: Callable[[bool], _T]) -> _T:
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


def scan_proc(
    root: str = "/",
    is_drm: IsDrm = is_drm_char_device,
    *,
    opener: Opener | None = None,
    compare: FileOrder | Literal["auto", "off"] = "auto",
    every_holder: bool = False,
) -> ProcScan:
    """Scan ``<root>/proc`` for DRM clients.

    ``is_drm`` decides from a descriptor's ``stat()`` whether it is a DRM device; tests may
    inject another predicate.  Every file and directory is opened through ``opener``
    (default ``os.open``; tests inject failures or changes between reads).  ``compare`` finds
    descriptors sharing an open file before their fdinfo is read: ``"auto"`` uses ``kcmp`` on
    the real ``/proc`` of this PID namespace, ``"off"`` reads every DRM fdinfo, a
    :data:`FileOrder` is used as given.  ``every_holder`` records every process holding a client,
    not only the lowest pid, so that a broker (:func:`cardshare.naming.naming_pid`) does not
    name a session's client: a short record (comm and start time) for a holder that may name
    nothing, completed for the process that names each client.

    Raises ``OSError`` when ``<root>/proc`` itself cannot be listed, and
    :class:`ScanPermissionError` when more than :data:`UNREADABLE_MIN` processes, and more
    than half of those examined (not gone, not without descriptors), refused their
    descriptors.
    """
    if opener is None:
        opener = os.open  # looked up now: a test may patch it
    proc_dir = os.path.join(root, "proc")
    if compare == "off":
        return _scan(proc_dir, is_drm, opener, None, None, every_holder)
    if compare != "auto":
        return _scan(proc_dir, is_drm, opener, compare, None, every_holder)
    order = kcmp_file_order() if _same_proc(proc_dir) else None
    take = pidfd_take_file() if order is not None else None
    if order is None or take is None:
        return _scan(proc_dir, is_drm, opener, None, None, every_holder)
    kcmp, getfd = order, take

    def held_scan(private: bool) -> ProcScan:
        if not private:  # files held would show in this process's fd/: compare nothing
            return _scan(proc_dir, is_drm, opener, None, None, every_holder)
        holder = _Holder(getfd)
        try:
            return _scan(proc_dir, is_drm, opener, kcmp, holder, every_holder)
        finally:
            holder.close()

    return _in_own_table(held_scan)


def _scan(
    proc_dir: str,
    is_drm: IsDrm,
    opener: Opener,
    order: FileOrder | None,
    holder: _Holder | None,
    every_holder: bool,
) -> ProcScan:
    proc_dfd = opener(proc_dir, _DIR_FLAGS)
    try:
        scanner = _Scanner(proc_dir, is_drm, opener, order, holder)
        if order is not None:
            scanner.result.dedupe = "kcmp" if holder is not None else "compare"
        stats = scanner.stats
        pids = sorted(int(name) for name in os.listdir(proc_dfd) if name.isdigit())
        for pid in pids:
            stats.processes += 1
            try:
                pid_dfd = opener(str(pid), _DIR_FLAGS, dir_fd=proc_dfd)
            except _GONE:
                stats.vanished += 1
                scanner.vanished_processes += 1
                continue
            except OSError:
                stats.unreadable += 1
                continue
            try:
                scanner.process(pid, pid_dfd, every_holder)
            finally:
                os.close(pid_dfd)
    finally:
        os.close(proc_dfd)
    scanner.check_permissions()
    scanner.complete_naming()
    return scanner.result
