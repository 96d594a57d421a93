"""Find the DRM clients of a host by scanning ``<root>/proc``.

For each process, each descriptor whose ``stat()`` (following the ``fd/<n>`` link) is a
character device with major 226 has its ``fdinfo/<n>`` read.  A DRM client is one open DRM
file, identified by ``(drm-pdev, drm-client-id)``: duplicated descriptors and descriptors
inherited by other processes repeat it and are counted once (their pids are collected).

A process that vanishes mid-scan, a descriptor closed between listing and reading, or a file
that cannot be read (no ptrace permission) is skipped and counted in :class:`ScanStats`;
none of them stops the scan.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from cardshare.fdinfo import FdInfo, parse_fdinfo
from cardshare.naming import ContainerRef, container_from_cgroup

__all__ = [
    "DRM_MAJOR",
    "DrmClient",
    "ProcScan",
    "ProcessInfo",
    "ScanStats",
    "is_drm_char_device",
    "scan_proc",
]

DRM_MAJOR = 226
UNKNOWN_PDEV = "unknown"

IsDrm = Callable[[os.stat_result], bool]

_READ_SIZE = 65536
# Link targets of descriptors that are not paths (never a device node).
_PSEUDO_FILES = ("socket:", "pipe:", "anon_inode:")
_CLIENT_ID_RE = re.compile(rb"^drm-client-id:[ \t]*([0-9]+)[ \t]*$", re.MULTILINE)
_PDEV_RE = re.compile(rb"^drm-pdev:[ \t]*(\S+)[ \t]*$", re.MULTILINE)


def is_drm_char_device(st: os.stat_result) -> bool:
    """True for a character device with the DRM major number (226)."""
    return stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == DRM_MAJOR


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """What naming needs to know about a process."""

    pid: int
    comm: str
    cmdline: str
    container: ContainerRef | None


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

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class ProcScan:
    """The result of :func:`scan_proc`.

    ``processes`` holds the process that names each client: the lowest pid holding it.
    """

    clients: dict[tuple[str, int], DrmClient] = field(default_factory=dict)
    processes: dict[int, ProcessInfo] = field(default_factory=dict)
    stats: ScanStats = field(default_factory=ScanStats)


def _read_bytes(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # A short read is the end of a regular or seq_file (proc) file: one read suffices
        # for the small files read here.
        chunk = os.read(fd, _READ_SIZE)
        if len(chunk) < _READ_SIZE:
            return chunk
        chunks = [chunk]
        while chunk:
            chunk = os.read(fd, _READ_SIZE)
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_text(path: str) -> str:
    return _read_bytes(path).decode("utf-8", "replace")


def read_process_info(proc_dir: str, pid: int) -> ProcessInfo:
    """Read comm, cmdline and cgroup of a process; missing pieces become empty."""
    base = f"{proc_dir}/{pid}"
    parts: list[str] = []
    for name in ("comm", "cmdline", "cgroup"):
        try:
            parts.append(_read_text(f"{base}/{name}"))
        except OSError:
            parts.append("")
    comm, cmdline, cgroup = parts
    return ProcessInfo(
        pid=pid,
        comm=comm.rstrip("\n"),
        cmdline=cmdline.replace("\0", " ").strip(),
        container=container_from_cgroup(cgroup),
    )


def _quick_key(data: bytes) -> tuple[str, int] | None:
    """The client key without a full parse (a repeated client need not be parsed again)."""
    cid = _CLIENT_ID_RE.search(data)
    if cid is None:
        return None
    pdev = _PDEV_RE.search(data)
    return (pdev.group(1).decode("ascii", "replace") if pdev else UNKNOWN_PDEV, int(cid.group(1)))


def _namespace_key(pid_dir: str) -> str:
    """The mount namespace of a process: the context in which its fd link targets resolve."""
    try:
        return os.readlink(f"{pid_dir}/ns/mnt")
    except OSError:
        return ""


def _drm_descriptors(
    pid_dir: str, is_drm: IsDrm, cache: dict[tuple[str, str], bool], stats: ScanStats
) -> list[str] | None:
    """The DRM descriptors of a process (``None`` when its fd directory is gone or closed).

    Each link target is read first: kernel pseudo files (``socket:``, ``pipe:``,
    ``anon_inode:``) are never DRM devices, and a path already checked in the same mount
    namespace is not ``stat()``-ed again.  Otherwise the descriptor itself is
    ``stat()``-ed (following the link), which works for real and simulated trees alike.
    """
    try:
        dfd = os.open(f"{pid_dir}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        stats.vanished += 1
        return None
    except OSError:
        stats.unreadable += 1
        return None
    drm_fds: list[str] = []
    namespace: str | None = None
    try:
        fds = os.listdir(dfd)
        stats.descriptors += len(fds)
        for fd in fds:
            try:
                target = os.readlink(fd, dir_fd=dfd)
            except FileNotFoundError:
                stats.vanished += 1
                continue
            except OSError:
                stats.unreadable += 1
                continue
            if target.startswith(_PSEUDO_FILES):
                continue
            if namespace is None:
                namespace = _namespace_key(pid_dir)
            key = (namespace, target)
            drm = cache.get(key)
            if drm is None:
                try:
                    st = os.stat(fd, dir_fd=dfd)
                except FileNotFoundError:
                    stats.vanished += 1
                    continue
                except OSError:
                    stats.unreadable += 1
                    continue
                drm = cache[key] = is_drm(st)
            if drm:
                drm_fds.append(fd)
    except OSError:
        stats.unreadable += 1
        return None
    finally:
        os.close(dfd)
    return drm_fds


def scan_proc(root: str = "/", is_drm: IsDrm = is_drm_char_device) -> ProcScan:
    """Scan ``<root>/proc`` for DRM clients.

    ``is_drm`` decides from a descriptor's ``stat()`` whether it is a DRM device; tests may
    inject another predicate.  Raises ``OSError`` only when ``<root>/proc`` itself cannot be
    listed.
    """
    proc_dir = os.path.join(root, "proc")
    result = ProcScan()
    stats = result.stats
    cache: dict[tuple[str, str], bool] = {}
    by_text: dict[bytes, DrmClient] = {}
    with os.scandir(proc_dir) as entries:
        pids = [int(e.name) for e in entries if e.name.isdigit()]
    for pid in pids:
        stats.processes += 1
        pid_dir = f"{proc_dir}/{pid}"
        drm_fds = _drm_descriptors(pid_dir, is_drm, cache, stats)
        if not drm_fds:
            continue
        for fd in drm_fds:
            stats.drm_descriptors += 1
            try:
                data = _read_bytes(f"{pid_dir}/fdinfo/{fd}")
            except FileNotFoundError:
                stats.vanished += 1
                continue
            except OSError:
                stats.unreadable += 1
                continue
            # Descriptors of one client print the same text: the common case is a dict hit.
            client = by_text.get(data)
            if client is None:
                key = _quick_key(data)
                client = result.clients.get(key) if key is not None else None
            if client is None:
                info = parse_fdinfo(data.decode("utf-8", "replace"))
                stats.malformed_lines += info.malformed
                if not info.is_drm_client or info.client_id is None:
                    stats.not_clients += 1
                    continue
                full_key = (info.pdev or UNKNOWN_PDEV, info.client_id)
                client = result.clients.get(full_key)
                if client is None:
                    client = DrmClient(pdev=full_key[0], client_id=full_key[1], fdinfo=info)
                    result.clients[full_key] = client
            by_text[data] = client
            client.pids.add(pid)
            client.descriptors += 1
    # Naming reads comm, cmdline and cgroup of one process per client: the lowest pid.
    for client in result.clients.values():
        pid = min(client.pids)
        if pid not in result.processes:
            result.processes[pid] = read_process_info(proc_dir, pid)
    return result
