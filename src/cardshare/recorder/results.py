"""What a scan of ``/proc`` finds: DRM clients, the processes holding them, counters.

Plain records, read by :mod:`cardshare.recorder.compute` and the naming; made by
:mod:`cardshare.recorder.scan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cardshare.fdinfo import FdInfo
from cardshare.naming import ContainerRef

__all__ = ["ClientKey", "DrmClient", "ProcScan", "ProcessInfo", "ScanStats"]

ClientKey = tuple[str, int]


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
