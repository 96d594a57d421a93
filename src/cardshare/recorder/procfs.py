"""A process's directory under ``/proc``: its DRM descriptors and what names it.

A descriptor is a DRM device when its ``stat()`` (following the ``fd/<n>`` link) is a
character device with major 226 (what a link target is, is learnt once per mount
namespace).

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

A process whose leader thread exited while others run (``pthread_exit()`` in ``main``) lists
an empty ``fd/`` though it holds its descriptors: they are read under ``task/<tid>/`` of a
live thread (compared by that thread's id), and its clients recorded under its pid.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from cardshare.naming import (
    BROKER_COMMS,
    ContainerRef,
    container_from_cgroup,
    primary_cgroup,
)
from cardshare.recorder.results import ProcessInfo, ScanStats

__all__ = [
    "DIR_FLAGS",
    "DRM_MAJOR",
    "FILE_FLAGS",
    "GONE",
    "READ_SIZE",
    "DescriptorWalk",
    "IsDrm",
    "LiveThread",
    "Opener",
    "ProcessGone",
    "is_drm_char_device",
    "leader_exited",
    "parse_stat",
    "process_info",
    "read_at",
    "read_fd",
    "read_process_info",
    "stat_of",
]

DRM_MAJOR = 226

IsDrm = Callable[[os.stat_result], bool]


class Opener(Protocol):
    """``os.open``'s signature: every file and directory of the scan is opened through it."""

    def __call__(
        self, path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None
    ) -> int: ...


READ_SIZE = 65536
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_CLOEXEC
# Link targets of descriptors that are not paths (never a device node).
_PSEUDO_FILES = ("socket:", "pipe:", "anon_inode:")
_NONES = itertools.repeat(None)


def is_drm_char_device(st: os.stat_result) -> bool:
    """True for a character device with the DRM major number (226)."""
    return stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == DRM_MAJOR


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


def leader_exited(data: bytes) -> bool:
    """Whether a ``stat`` text is that of a thread group whose leader has exited while other
    threads run: state ``Z`` (field 3) and more than one thread (field 20)."""
    end = data.rfind(b")")
    fields = data[end + 2 :].split(None, 18) if end >= 0 else []
    return len(fields) > 17 and fields[0] == b"Z" and fields[17].isdigit() and fields[17] != b"1"


def read_fd(fd: int) -> bytes:
    # A short read is the end of a regular or seq_file (proc) file: one read suffices for
    # the small files read here.
    chunk = os.read(fd, READ_SIZE)
    if len(chunk) < READ_SIZE:
        return chunk
    chunks = [chunk]
    while chunk:
        chunk = os.read(fd, READ_SIZE)
        chunks.append(chunk)
    return b"".join(chunks)


def read_at(opener: Opener, name: str, dir_fd: int | None) -> bytes:
    fd = opener(name, FILE_FLAGS, dir_fd=dir_fd)
    try:
        return read_fd(fd)
    finally:
        os.close(fd)


# What procfs answers for a process that is gone: ENOENT from a lookup by pid or of a file it
# no longer has, ESRCH through its directory (the permission check finds no task) or from a
# file opened before it exited.
GONE = (FileNotFoundError, ProcessLookupError)


class ProcessGone(Exception):
    """A read through a process's directory failed because the process is gone."""


def _text_at(opener: Opener, name: str, dir_fd: int, gone_if_missing: bool = False) -> str:
    """The text of a file of a process; ``""`` when it cannot be read.

    ``gone_if_missing`` (a process whose ``stat`` was read, as on every real ``/proc``): a file
    that is not there means the process is gone (raises :class:`ProcessGone`), not that the
    tree lacks it.
    """
    try:
        return read_at(opener, name, dir_fd).decode("utf-8", "replace")
    except GONE:
        if gone_if_missing:
            raise ProcessGone(name) from None
        return ""
    except OSError:
        return ""


def process_info(
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
    :class:`ProcessGone` when the process exits while its record is read (known by its start
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
        pid_dfd = opener(f"{proc_dir}/{pid}", DIR_FLAGS)
    except OSError:
        return ProcessInfo(pid=pid, comm="", cmdline="", container=None)
    try:
        parsed = stat_of(opener, pid_dfd)
        comm, start = (parsed[0], parsed[1]) if parsed is not None else (None, None)
        return process_info(opener, pid_dfd, pid, comm, start)
    except ProcessGone:
        return ProcessInfo(pid=pid, comm="", cmdline="", container=None)
    finally:
        os.close(pid_dfd)


def stat_of(opener: Opener, pid_dfd: int) -> tuple[str, int] | None:
    try:
        return parse_stat(read_at(opener, "stat", pid_dfd))
    except OSError:
        return None


@dataclass(slots=True)
class LiveThread:
    """A live thread of a process whose leader has exited: its descriptors are read there."""

    tid: int
    dfd: int  # task/<tid>, opened through the process's directory
    start_time: int | None


_EMPTY: Literal["empty"] = "empty"  # an fd/ that lists nothing (list_drm)


class DescriptorWalk:
    """The walk of each process's ``fd/``: which descriptors are DRM devices (the base of the
    scanner, :class:`cardshare.recorder.scan._Scanner`)."""

    def __init__(self, proc_dir: str, is_drm: IsDrm, opener: Opener, stats: ScanStats) -> None:
        self.proc_dir = proc_dir
        self.is_drm = is_drm
        self.opener = opener
        self.stats = stats
        # per mount namespace: link target -> is a DRM device
        self.cache: dict[str, dict[str, bool]] = {}
        self.vanished_processes = 0
        # processes with no descriptor (kernel threads, zombies): they say nothing of our rights
        self.empty_processes = 0

    def drm_descriptors(self, pid: int, pid_dfd: int) -> tuple[list[str], LiveThread | None] | None:
        """The DRM descriptors of a process and, when they are a thread's, that thread
        (``None`` when its fd directory is gone or closed; the caller closes ``LiveThread.dfd``).

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

    def live_thread(self, pid: int, pid_dfd: int) -> LiveThread | None:
        """A live thread of the process when its leader has exited (see drm_descriptors)."""
        opener = self.opener
        try:
            if not leader_exited(read_at(opener, "stat", pid_dfd)):
                return None
            task_dfd = opener("task", DIR_FLAGS, dir_fd=pid_dfd)
            try:
                tids = sorted(int(t) for t in os.listdir(task_dfd) if t.isdigit())
                for tid in tids:
                    if tid == pid:
                        continue
                    try:
                        dfd = opener(str(tid), DIR_FLAGS, dir_fd=task_dfd)
                    except OSError:
                        continue  # that thread ended meanwhile
                    parsed = stat_of(opener, dfd)
                    return LiveThread(tid, dfd, parsed[1] if parsed is not None else None)
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
            dfd = self.opener("fd", DIR_FLAGS, dir_fd=pid_dfd)
        except GONE:
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
            if None in drm:  # only those not known are visited (the others in C)
                for i in itertools.compress(range(len(drm)), map(operator.is_, drm, _NONES)):
                    target = targets[i]
                    if target.startswith(_PSEUDO_FILES):
                        drm[i] = False
                    else:
                        drm[i] = self.learn(fds[i], target, dfd, known)
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
        """Whether a descriptor whose path is not known yet is a DRM device (remembered)."""
        try:
            st = os.stat(fd, dir_fd=dfd)
        except GONE:
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
            except GONE:
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
