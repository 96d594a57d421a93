"""Find the DRM clients of a host by scanning ``<root>/proc``.

For each process, each descriptor whose ``stat()`` (following the ``fd/<n>`` link) is a
character device with major 226 has its ``fdinfo/<n>`` read.  A DRM client is one open DRM
file, identified by ``(drm-pdev, drm-client-id)``: duplicated descriptors and descriptors
inherited by other processes repeat it and are counted once (their pids are collected).

Each open file is read once: a DRM descriptor sharing an open file with one already read
takes that result without a read (:mod:`cardshare.recorder.openfiles` says how, and where
it cannot be done); a process's directory and its DRM descriptors are read as
:mod:`cardshare.recorder.procfs` says.

A process that vanishes mid-scan, a descriptor closed between listing and reading, or a file
that cannot be read is skipped and counted in :class:`ScanStats`; none of them stops the scan
alone.  But when most processes refuse their descriptors (no ptrace permission: a user
other than the owner is refused ``fd/`` itself, root without ``CAP_SYS_PTRACE`` each link in
it), the scan raises :class:`ScanPermissionError` instead of returning an empty card.
Processes with no descriptor (kernel threads, zombies) test no right and are not counted.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from typing import Literal, TypeAlias

from cardshare.fdinfo import FdInfo, parse_fdinfo
from cardshare.naming import naming_pid
from cardshare.recorder.openfiles import (
    DedupeUnavailable,
    FileOrder,
    Holder,
    in_own_table,
    kcmp_file_order,
    pidfd_take_file,
)
from cardshare.recorder.procfs import (
    DIR_FLAGS,
    FILE_FLAGS,
    GONE,
    READ_SIZE,
    DescriptorWalk,
    IsDrm,
    LiveThread,
    Opener,
    ProcessGone,
    is_drm_char_device,
    parse_stat,
    process_info,
    read_at,
    read_fd,
    stat_of,
)
from cardshare.recorder.results import ClientKey, DrmClient, ProcessInfo, ProcScan

__all__ = ["UNREADABLE_MIN", "ScanPermissionError", "scan_proc"]

UNKNOWN_PDEV = "unknown"
# More than this many processes refusing their descriptors, and more than half of those
# examined (holding descriptors, or refusing them): the scan is an error (ScanPermissionError).
UNREADABLE_MIN = 5


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


_CLIENT_ID_RE = re.compile(rb"^drm-client-id:[ \t]*([0-9]+)[ \t]*$", re.MULTILINE)
_PDEV_RE = re.compile(rb"^drm-pdev:[ \t]*(\S+)[ \t]*$", re.MULTILINE)


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
    (:class:`Holder`), so no other process can change what it stands for; with an injected
    comparator (a simulated tree), the descriptor read and the start time of its process.
    """

    pid: int
    fd: int
    key: ClientKey | None  # None: a DRM descriptor that is not a client
    start_time: int | None
    held: bool = False


# What one DRM descriptor resolved to: a client key, None (not a client), or skipped.
_SKIP: Literal["skip"] = "skip"
_Outcome: TypeAlias = ClientKey | Literal["skip"] | None


class _Scanner(DescriptorWalk):
    def __init__(
        self,
        proc_dir: str,
        is_drm: IsDrm,
        opener: Opener,
        order: FileOrder | None,
        holder: Holder | None = None,
    ) -> None:
        self.result = ProcScan()
        super().__init__(proc_dir, is_drm, opener, self.result.stats)
        self.order = order
        self.holder = holder
        # the representative last matched or read: the next descriptor, of this process or
        # of the next (a forked child, often the next pid), is compared with it first
        self.hint: _Rep | None = None
        self.parsed: dict[bytes, tuple[ClientKey, FdInfo] | tuple[None, None]] = {}
        # every client parsed in this scan: one whose reads were dropped with a holder that
        # vanished is still known to the next holder of its open file (process_drm)
        self.infos: dict[ClientKey, FdInfo] = {}
        self.reps: list[_Rep] = []  # sorted by ``order``
        # the last fdinfo text the process being read gave, and its outcome (read_fdinfo)
        self.last_text: tuple[bytes, ClientKey | None] | None = None

    # --- fdinfo ----------------------------------------------------------------------------

    def read_fdinfo(self, pid_dfd: int, fd: str, pending: dict[ClientKey, FdInfo]) -> _Outcome:
        try:
            ifd = self.opener(f"fdinfo/{fd}", FILE_FLAGS, dir_fd=pid_dfd)
            try:
                data = os.read(ifd, READ_SIZE)
                if len(data) == READ_SIZE:  # a long text (see read_fd)
                    data += read_fd(ifd)
            finally:
                os.close(ifd)
        except GONE:
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
                known = self.parse(data)
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

    def parse(self, data: bytes) -> tuple[ClientKey, FdInfo] | tuple[None, None]:
        """What a fdinfo text not seen in this scan says: ``(key, parsed)`` of a DRM client,
        ``(None, None)`` for a DRM file that is not one.  A text of a client already known
        (another descriptor's text differs only in ``pos`` or ``flags``) is not parsed."""
        quick = _quick_key(data)
        if quick is not None:
            found = self.infos.get(quick)
            if found is not None:
                return quick, found
        info = parse_fdinfo(data.decode("utf-8", "replace"))
        self.stats.malformed_lines += info.malformed
        if not info.is_drm_client or info.client_id is None:
            self.parsed[data] = (None, None)
            return None, None
        key = (info.pdev or UNKNOWN_PDEV, info.client_id)
        self.parsed[data] = (key, info)
        self.infos[key] = info
        return key, info

    # --- open files already read -----------------------------------------------------------

    def find_rep(self, pid: int, fd: int) -> tuple[int, _Rep | None] | None:
        """``(insert position, equal representative)``; ``None`` when this fd is gone.

        Raises :class:`DedupeUnavailable` when comparing is refused.
        """
        order = self.order
        assert order is not None
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
            parsed = parse_stat(read_at(self.opener, f"{self.proc_dir}/{rep_pid}/stat", None))
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
        stats.drm_descriptors += len(drm_fds)
        outcomes: list[_Outcome] = []
        for fd in drm_fds:
            number = int(fd)
            order, hint = self.order, self.hint
            rep: _Rep | None = None
            position = -1
            # the open file last matched or read first (the next descriptor of one process
            # and of a forked child hold it most often): one comparison and no search
            if order is not None and hint is not None:
                try:
                    if order(pid, number, hint.pid, hint.fd) == 0:
                        rep = hint
                        if hint.held:  # the common case, and all there is to do for it
                            stats.fdinfo_reads_saved += 1
                            if hint.key is None:
                                stats.not_clients += 1
                            outcomes.append(hint.key)
                            continue
                except OSError:
                    pass  # the search below sorts out which side is gone
                except DedupeUnavailable:
                    self.stop_dedupe()
            if rep is None and self.order is not None:
                try:
                    found = self.find_rep(pid, number)
                except DedupeUnavailable:
                    self.stop_dedupe()
                    found = (-1, None)
                if found is None:
                    stats.vanished += 1
                    continue
                position, rep = found
            if rep is None and position >= 0 and self.holder is not None:
                got = self.read_held(pid, number, position, pending, thread)
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
                self.hint = _Rep(pid, number, key, start)
                self.reps.insert(position, self.hint)
                mine.append(self.hint)
        return outcomes

    def all_hint(self, pid: int, drm_fds: list[str]) -> bool:
        """Whether every descriptor in ``drm_fds`` holds the hint's open file (``False`` on any
        error: :meth:`read_unshared` then sorts each descriptor out)."""
        order, hint = self.order, self.hint
        assert order is not None and hint is not None
        hint_pid, hint_fd = hint.pid, hint.fd
        try:
            for fd in drm_fds:
                if order(pid, int(fd), hint_pid, hint_fd) != 0:
                    return False
        except (OSError, DedupeUnavailable):
            return False
        return True

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
        found = self.find_rep(tid, held)
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
        thread: LiveThread | None,
        every_holder: bool,
    ) -> None:
        stats = self.stats
        opener = self.opener
        self.last_text = None
        # The start time, read through its directory when the process is known to matter:
        # the pid and start time name this process in later reads by pid (complete_naming,
        # still_there).  Reads through pid_dfd need no second look: they answer for this
        # process or fail (procfs's docstring).  With held representatives it is needed only
        # for a record, so it is read then.
        comm: str | None = None
        start: int | None = None
        early = self.order is not None and self.holder is None
        if early:
            first = stat_of(opener, pid_dfd)
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
        hint = self.hint
        if thread is None and hint is not None and hint.held and self.all_hint(pid, drm_fds):
            # the common case (a forked child's descriptors, a dup()): every DRM descriptor
            # holds the open file last matched or read; nothing read, held or searched
            count = len(drm_fds)
            stats.drm_descriptors += count
            stats.fdinfo_reads_saved += count
            if hint.key is None:
                stats.not_clients += count
            outcomes: list[_Outcome] = [hint.key] * count
        elif self.order is None:  # every DRM fdinfo read (a simulated tree, no kcmp)
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
        clients = self.result.clients
        for key in keys:
            if key not in clients and key not in pending:
                # read before, with a holder that vanished while its record was read (its
                # reads dropped): this process names it now
                pending[key] = self.infos[key]
        info: ProcessInfo | None = None
        dropped = False
        if pending or (every_holder and keys):
            # complete for a process that may name a new client; other holders are
            # completed later if one of them turns out to name (complete_naming)
            if not early:
                first = stat_of(opener, pid_dfd)
                if first is not None:
                    comm, start = first
            try:
                info = process_info(opener, pid_dfd, pid, comm, start, bool(pending))
            except ProcessGone:
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
            pid_dfd = opener(f"{self.proc_dir}/{info.pid}", DIR_FLAGS)
        except OSError:
            return None
        try:
            if info.start_time is not None:
                now = stat_of(opener, pid_dfd)
                if now is None or now[1] != info.start_time:
                    return None
            return process_info(opener, pid_dfd, info.pid, info.comm, info.start_time)
        except ProcessGone:
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
        holder = Holder(getfd)
        try:
            return _scan(proc_dir, is_drm, opener, kcmp, holder, every_holder)
        finally:
            holder.close()

    return in_own_table(held_scan)


def _scan(
    proc_dir: str,
    is_drm: IsDrm,
    opener: Opener,
    order: FileOrder | None,
    holder: Holder | None,
    every_holder: bool,
) -> ProcScan:
    proc_dfd = opener(proc_dir, DIR_FLAGS)
    try:
        scanner = _Scanner(proc_dir, is_drm, opener, order, holder)
        if order is not None:
            scanner.result.dedupe = "kcmp" if holder is not None else "compare"
        stats = scanner.stats
        pids = sorted(int(name) for name in os.listdir(proc_dfd) if name.isdigit())
        for pid in pids:
            stats.processes += 1
            try:
                pid_dfd = opener(str(pid), DIR_FLAGS, dir_fd=proc_dfd)
            except GONE:
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
