"""Benchmark: a full recorder scan against a plain read of the same fdinfo files.

Builds a synthetic root of ``--processes`` processes with ``--fds`` descriptors each:
``--drm-fds`` of them are DRM descriptors (links to a 226:128 character device) that share
``--clients`` distinct DRM clients (so most are duplicates, as threads and children of one
program are), the rest links to a plain file.  Each DRM descriptor's fdinfo is the full xe
text (about 40 lines).

Then, for several rounds, alternating the order, it times:

* baseline: a plain loop that opens and reads every DRM fdinfo file of the tree;
* minimal: the least a scanner must do, the fair comparison: list each ``fd/`` directory,
  ``readlink`` and ``stat`` every descriptor, read the fdinfo of the DRM ones;
* walk floor: what no scanner that walks the descriptors can go below, shown beside the
  baseline's goal: list each ``fd/`` directory, ``readlink`` every descriptor, tell the DRM
  ones by their link's name (the tree's own; a real scanner cannot trust a name), read their
  fdinfo, and nothing else (no ``stat``, no parse, no process identity);
* scan: ``cardshare.recorder.sample`` (list /proc, walk every descriptor, read and parse the
  DRM fdinfo, dedupe, read stat/comm/cmdline/cgroup, name, compute busy shares, build the
  snapshot).

It prints the payload, the machine, the median times, the ratios (goal: at most 1.0x the
minimal scanner), the fdinfo reads and reads saved by the dedupe, and the peak memory of one
scan (tracemalloc) and of the process (ru_maxrss; goal: under 30 MB).

A synthetic tree has no processes for ``kcmp`` to compare, so the scan reads every DRM
fdinfo there (0 saved), and its files cost what a small file costs, not what procfs does.
Unless ``--no-real-part``, a second part builds the same payload from real processes and
measures it on the real ``/proc``: ``--clients`` ordinary files stand in for DRM nodes, each
opened once, ``dup()``-ed to ``--drm-fds`` descriptors and inherited by a group of forked
processes (a program and its children).  Side by side: the baseline (the stand-ins' fdinfo
read by path), the walk floor, the walk alone (the walk floor without its reads: what every
scanner that looks at each descriptor pays, the bound no ratio to the nvtop-like scanner
goes below), an nvtop-like scanner (:func:`nvtop_like`: one ``stat`` per
descriptor, kcmp only within a process, so one fdinfo read per open file per process), and
``scan_proc`` with the kcmp dedupe and without; the reads and reads saved.  The goal: the scan
with the dedupe at most 1.0x the nvtop-like scanner, with fdinfo reads equal to the distinct
open files.  Two differences from a card, stated with the figures: an ordinary file's fdinfo
is four lines the kernel prints cheaply, where an xe fdinfo takes runtime PM and forcewake
(so every read the dedupe saves is worth more on a card than here); and it names no DRM
client, so neither scanner does naming work there (the synthetic part measures that).
``--only-real-part`` skips the synthetic tree.  ``--old-src DIR`` (the ``src`` of another
checkout, e.g. a ``git worktree`` of the previous commit) adds that checkout's ``scan_proc``
with the dedupe to the real part, run side by side with this one's ("old" against "auto").

Usage: ``python benchmarks/recorder/bench_scan.py [--rounds 7] [--dir DIR]`` (needs
``src`` on ``PYTHONPATH``; run as root to get a real character device, otherwise the DRM
check falls back to comparing inodes).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import resource
import shutil
import stat
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from cardshare.fdinfo import parse_fdinfo
from cardshare.naming import DEFAULT_RULES
from cardshare.recorder import sample
from cardshare.recorder.openfiles import FileOrder, kcmp_file_order
from cardshare.recorder.results import ProcScan
from cardshare.recorder.scan import scan_proc

FDINFO = """pos:\t0
flags:\t0100002
mnt_id:\t26
ino:\t685
drm-driver:\txe
drm-client-id:\t{cid}
drm-pdev:\t0000:03:00.0
drm-total-system:\t0
drm-shared-system:\t0
drm-active-system:\t0
drm-resident-system:\t0
drm-purgeable-system:\t0
drm-total-gtt:\t192 KiB
drm-shared-gtt:\t0
drm-active-gtt:\t0
drm-resident-gtt:\t192 KiB
drm-total-vram0:\t{vram} KiB
drm-shared-vram0:\t16 MiB
drm-active-vram0:\t0
drm-resident-vram0:\t{vram} KiB
drm-purgeable-vram0:\t0
drm-cycles-rcs:\t28257900
drm-total-cycles-rcs:\t7655183225
drm-cycles-bcs:\t0
drm-total-cycles-bcs:\t7655183225
drm-cycles-vcs:\t0
drm-total-cycles-vcs:\t7655183225
drm-engine-capacity-vcs:\t2
drm-cycles-vecs:\t0
drm-total-cycles-vecs:\t7655183225
drm-engine-capacity-vecs:\t2
drm-cycles-ccs:\t{ccs}
drm-total-cycles-ccs:\t7655183225
drm-engine-capacity-ccs:\t4
"""
PLAIN_FDINFO = "pos:\t0\nflags:\t0100000\nmnt_id:\t1\nino:\t2\n"


# the link /proc/<pid>/ns/mnt of a process in the host's mount namespace
MOUNT_NAMESPACE = "mnt:[4026531841]"
# /proc/<pid>/stat as the kernel prints it (52 fields; field 22 is the start time in ticks)
STAT = (
    "{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194560 3456 0 0 0 120 40 0 0 20 0 8 0 {start} "
    "1234567890 45678 18446744073709551615 1 1 0 0 0 0 0 4096 17642 0 0 0 17 1 0 0 0 0 0 "
    "0 0 0 0 0 0 0 0\n"
)


def build_tree(
    root: Path, processes: int, fds: int, drm_fds: int, clients: int
) -> tuple[list[str], Callable[[os.stat_result], bool], bool]:
    """Create the tree; return the DRM fdinfo paths, the DRM check and whether mknod worked."""
    (root / "proc").mkdir(parents=True)
    (root / "dev" / "dri").mkdir(parents=True)
    node = root / "dev" / "dri" / "renderD128"
    try:
        os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(226, 128))
        real = True
    except PermissionError:
        node.write_bytes(b"")
        real = False
    node_ino = node.stat().st_ino
    plain = root / "plain"
    plain.write_text("x")
    drm_paths: list[str] = []
    for i in range(processes):
        pid = 1000 + i
        base = root / "proc" / str(pid)
        (base / "fd").mkdir(parents=True)
        (base / "fdinfo").mkdir()
        (base / "comm").write_text(f"worker{i % 7}\n")
        # every real /proc/<pid> has stat (a scanner reads the start time there, and comm)
        (base / "stat").write_text(STAT.format(pid=pid, comm=f"worker{i % 7}", start=1000 + i))
        (base / "cmdline").write_bytes(f"/usr/bin/worker{i % 7}\0--flag\0".encode())
        cid = i % clients
        container = hashlib.sha256(f"container {cid}".encode()).hexdigest()
        (base / "cgroup").write_text(f"0::/system.slice/docker-{container}.scope\n")
        # and ns/mnt (a scanner keys what it learnt of a link target on the mount namespace)
        (base / "ns").mkdir()
        (base / "ns" / "mnt").symlink_to(MOUNT_NAMESPACE)
        text = FDINFO.format(cid=cid, vram=23992 + cid, ccs=cid * 1000)
        for fd in range(fds):
            link, info = base / "fd" / str(fd), base / "fdinfo" / str(fd)
            if fd < drm_fds:
                link.symlink_to(node)
                info.write_text(text)
                drm_paths.append(str(info))
            else:
                link.symlink_to(plain)
                info.write_text(PLAIN_FDINFO)

    def is_drm(st: os.stat_result) -> bool:
        if real:
            return stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 226
        return st.st_ino == node_ino

    return drm_paths, is_drm, real


def baseline(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb") as handle:
            total += len(handle.read())
    return total


def minimal(root: str, is_drm: Callable[[os.stat_result], bool]) -> int:
    """The least a scanner must do: every descriptor's link and stat, the DRM fdinfo."""
    proc = os.path.join(root, "proc")
    total = 0
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            dfd = os.open(f"{proc}/{name}/fd", os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            for fd in os.listdir(dfd):
                try:
                    os.readlink(fd, dir_fd=dfd)
                    st = os.stat(fd, dir_fd=dfd)
                except OSError:
                    continue
                if is_drm(st):
                    try:
                        ifd = os.open(f"{proc}/{name}/fdinfo/{fd}", os.O_RDONLY)
                    except OSError:
                        continue
                    try:
                        total += len(os.read(ifd, 65536))
                    finally:
                        os.close(ifd)
        finally:
            os.close(dfd)
    return total


def walk_floor(root: str, drm_target: Callable[[str], bool]) -> int:
    """Listing, one ``readlink`` per descriptor and the DRM fdinfo reads: nothing else.

    ``drm_target`` tells the DRM descriptors by their link's text (the payload's own names,
    which a real scanner cannot trust).
    """
    proc = os.path.join(root, "proc")
    flags = os.O_RDONLY | os.O_DIRECTORY
    proc_fd = os.open(proc, flags)
    total = 0
    try:
        for name in os.listdir(proc_fd):
            if not name.isdigit():
                continue
            try:
                pid_fd = os.open(name, flags, dir_fd=proc_fd)
            except OSError:  # gone (the real /proc)
                continue
            try:
                try:
                    fd_dir = os.open("fd", flags, dir_fd=pid_fd)
                except OSError:
                    continue
                try:
                    fds = os.listdir(fd_dir)
                    targets = [os.readlink(fd, dir_fd=fd_dir) for fd in fds]
                except OSError:
                    continue
                finally:
                    os.close(fd_dir)
                for fd, target in zip(fds, targets, strict=True):
                    if drm_target(target):
                        info = os.open(f"fdinfo/{fd}", os.O_RDONLY, dir_fd=pid_fd)
                        try:
                            total += len(os.read(info, 65536))
                        finally:
                            os.close(info)
            finally:
                os.close(pid_fd)
    finally:
        os.close(proc_fd)
    return total


def nvtop_like(is_drm: Callable[[os.stat_result], bool], order: FileOrder) -> tuple[int, int]:
    """A scanner that works as nvtop's fdinfo sweep does (``extract_processinfo_fdinfo.c``),
    in Python with the scan's own primitives: per process, its directory and ``fd/`` opened
    once; one ``stat`` per descriptor through the ``fd/`` directory's descriptor; a DRM one
    compared (kcmp) with the DRM descriptors read before in the same process only; the others'
    fdinfo read through the process's directory and parsed (:func:`parse_fdinfo`); clients
    counted once by ``(drm-pdev, drm-client-id)``.  Returns ``(fdinfo reads, clients)``.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    proc_fd = os.open("/proc", flags)
    reads = 0
    clients: set[tuple[str | None, int]] = set()
    try:
        for name in os.listdir(proc_fd):
            if not name.isdigit():
                continue
            try:
                pid_fd = os.open(name, flags, dir_fd=proc_fd)
            except OSError:
                continue
            try:
                try:
                    fd_dir = os.open("fd", flags, dir_fd=pid_fd)
                except OSError:
                    continue
                try:
                    try:
                        fds = os.listdir(fd_dir)
                    except OSError:
                        continue
                    pid = int(name)
                    seen: list[int] = []
                    for fd in fds:
                        try:
                            st = os.stat(fd, dir_fd=fd_dir)
                        except OSError:
                            continue
                        if not is_drm(st):
                            continue
                        number = int(fd)
                        same = False
                        for other in seen:
                            try:
                                same = order(pid, number, pid, other) == 0
                            except Exception:  # nvtop skips a descriptor kcmp fails on
                                same = True
                            if same:
                                break
                        if same:
                            continue
                        seen.append(number)
                        try:
                            info = os.open(
                                f"fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=pid_fd
                            )
                        except OSError:
                            continue
                        try:
                            text = os.read(info, 65536)
                        finally:
                            os.close(info)
                        reads += 1
                        parsed = parse_fdinfo(text.decode("utf-8", "replace"))
                        if parsed.is_drm_client and parsed.client_id is not None:
                            clients.add((parsed.pdev, parsed.client_id))
                finally:
                    os.close(fd_dir)
            finally:
                os.close(pid_fd)
    finally:
        os.close(proc_fd)
    return reads, len(clients)


ScanProc = Callable[..., ProcScan]


def load_scan_proc(src: str) -> ScanProc:
    """``scan_proc`` of the package under ``src`` (another checkout), loaded beside this one.

    Its modules are imported under their own names with ``src`` first on the path and then
    taken out of ``sys.modules`` again, so this checkout's stay what the rest imports; the
    function keeps its own module's globals.
    """
    mine = {name: mod for name, mod in sys.modules.items() if name.split(".")[0] == "cardshare"}
    for name in mine:
        del sys.modules[name]
    sys.path.insert(0, src)
    try:
        import cardshare.recorder.scan as other

        if not other.__file__ or not other.__file__.startswith(os.path.abspath(src)):
            raise SystemExit(f"--old-src {src}: cardshare was not loaded from there")
        found: ScanProc = other.scan_proc
    finally:
        sys.path.remove(src)
        for name in [n for n in sys.modules if n.split(".")[0] == "cardshare"]:
            del sys.modules[name]
        sys.modules.update(mine)
    return found


def timed(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """The median seconds of each runner, run side by side; the order rotates each round.

    Wall time; :data:`CPU` gets the median CPU time of this process (user and system, every
    thread) for the same runs, the fairer figure on a loaded machine.
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        k = r % len(names)
        for which in names[k:] + names[:k]:
            start, start_cpu = time.perf_counter(), time.process_time()
            runs[which]()
            times[which].append(time.perf_counter() - start)
            cpu[which].append(time.process_time() - start_cpu)
    CPU.clear()
    CPU.update({name: statistics.median(values) for name, values in cpu.items()})
    return {name: statistics.median(values) for name, values in times.items()}


CPU: dict[str, float] = {}  # the CPU medians of the last :func:`timed`


def fork_holders(
    processes: int, fds: int, drm_fds: int, clients: int, work: Path
) -> tuple[list[int], list[str], set[tuple[int, int]], int]:
    """Fork the real part's processes; return their pids, the stand-in fdinfo paths, the
    stand-ins' ``(st_dev, st_ino)`` and the write end of the pipe whose closing ends them.

    Each of ``clients`` stand-in files is opened once and ``dup()``-ed to ``drm_fds``
    descriptors, and a group of processes is forked holding them (one program and its
    children share an open file so); every process then fills up to ``fds`` descriptors
    with one plain file's.
    """
    plain = os.open(work / "plain-file", os.O_RDONLY | os.O_CREAT, 0o600)
    hold_r, hold_w = os.pipe()
    ready_r, ready_w = os.pipe()
    ids: set[tuple[int, int]] = set()
    pids: list[int] = []
    paths: list[str] = []
    for client in range(clients):
        group = processes // clients + (1 if client < processes % clients else 0)
        standin = work / f"standin-node-{client}"
        standin.write_text("a DRM node stand-in\n")
        st = standin.stat()
        ids.add((st.st_dev, st.st_ino))
        first = os.open(standin, os.O_RDONLY)
        held = [first] + [os.dup(first) for _ in range(drm_fds - 1)]
        for _ in range(group):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child holds its descriptors until told
                try:
                    os.close(hold_w)
                    mine = len(os.listdir("/proc/self/fd")) - 1  # less listdir's own
                    for _ in range(fds - mine):
                        os.dup(plain)
                    os.write(ready_w, b".")
                    os.read(hold_r, 1)
                finally:
                    os._exit(0)
            pids.append(pid)
            paths.extend(f"/proc/{pid}/fdinfo/{fd}" for fd in held)
        for fd in held:
            os.close(fd)
    for fd in (hold_r, ready_w, plain):
        os.close(fd)
    for _ in pids:
        os.read(ready_r, 1)
    os.close(ready_r)
    return pids, paths, ids, hold_w


def real_part(
    processes: int,
    fds: int,
    drm_fds: int,
    clients: int,
    rounds: int,
    work: Path,
    old_scan: ScanProc | None = None,
) -> None:
    """The same payload as real processes on the real /proc (see the module docstring)."""
    t0 = time.perf_counter()
    pids, paths, ids, hold_w = fork_holders(processes, fds, drm_fds, clients, work)
    try:
        prefix = str(work / "standin-node-")

        def is_standin(st: os.stat_result) -> bool:
            return (st.st_dev, st.st_ino) in ids

        scans: dict[str, ProcScan] = {}

        def scan(mode: Literal["auto", "off"]) -> None:
            scans[mode] = scan_proc("/", is_standin, compare=mode, every_holder=True)

        order = kcmp_file_order()
        if order is None:
            print("no kcmp on this ABI: the nvtop-like scanner cannot run")
            return
        kcmp = order
        nvtop: list[tuple[int, int]] = []

        print(
            f"\nreal part: {len(pids)} real processes x {fds} descriptors ({drm_fds} of a "
            f"stand-in file each, {clients} open files shared by forked groups); forked in "
            f"{time.perf_counter() - t0:.1f} s; rounds: {rounds}"
        )
        runners: dict[str, Callable[[], object]] = {
            "base": lambda: baseline(paths),
            "floor": lambda: walk_floor("/", lambda target: target.startswith(prefix)),
            "walk": lambda: walk_floor("/", lambda target: False),
            "nvtop": lambda: nvtop.append(nvtop_like(is_standin, kcmp)),
            "auto": lambda: scan("auto"),
            "off": lambda: scan("off"),
        }
        if old_scan is not None:
            old = old_scan

            def scan_old() -> None:
                scans["old"] = old("/", is_standin, compare="auto", every_holder=True)

            runners["old"] = scan_old
        medians = timed(runners, rounds)
        b, n = medians["base"], medians["nvtop"]
        print(f"  baseline (plain read of the {len(paths)} stand-in fdinfo): {b * 1e3:.1f} ms")
        print(
            f"  walk floor (real /proc of {scans['auto'].stats.processes} processes): "
            f"{medians['floor'] * 1e3:.1f} ms, {medians['floor'] / n:.2f}x the nvtop-like scanner"
        )
        print(
            f"  the walk alone (listing, one readlink per descriptor, no fdinfo read): "
            f"{medians['walk'] * 1e3:.1f} ms, {medians['walk'] / n:.2f}x the nvtop-like scanner "
            f"(what both scanners pay; CPU {CPU['walk'] / CPU['nvtop']:.2f}x)"
        )
        print(
            f"  nvtop-like scanner: {n * 1e3:.1f} ms; fdinfo reads {nvtop[-1][0]} "
            "(one per open file per process)"
        )
        for label, mode in (("scan, kcmp dedupe:", "auto"), ("scan, no dedupe:  ", "off")):
            st = scans[mode].stats
            print(
                f"  {label} {medians[mode] * 1e3:.1f} ms, {medians[mode] / n:.2f}x the "
                f"nvtop-like scanner (goal <= 1.0x with the dedupe); fdinfo reads "
                f"{st.fdinfo_reads}, saved {st.fdinfo_reads_saved} (dedupe {scans[mode].dedupe!r})"
            )
        if old_scan is not None:
            st = scans["old"].stats
            print(
                f"  old scan (--old-src), kcmp dedupe: {medians['old'] * 1e3:.1f} ms, "
                f"{medians['old'] / n:.2f}x the nvtop-like scanner; fdinfo reads "
                f"{st.fdinfo_reads}, saved {st.fdinfo_reads_saved}"
            )
        print(
            "  CPU time (median, this process): "
            + ", ".join(f"{name} {CPU[name] * 1e3:.1f} ms" for name in CPU)
            + f"; scan with the dedupe {CPU['auto'] / CPU['nvtop']:.2f}x the nvtop-like scanner"
            + (
                f", the old scan {CPU['old'] / CPU['nvtop']:.2f}x it"
                f" (new/old {CPU['auto'] / CPU['old']:.2f}x)"
                if old_scan is not None
                else ""
            )
        )
        print(f"  a stand-in read by path costs {b / len(paths) * 1e6:.1f} us here")
    finally:
        os.close(hold_w)
        for pid in pids:
            os.waitpid(pid, 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2000)
    parser.add_argument("--fds", type=int, default=20)
    parser.add_argument("--drm-fds", type=int, default=4, help="DRM descriptors per process")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", help="where to build the tree (default: a temp directory)")
    parser.add_argument("--no-real-part", action="store_true")
    parser.add_argument("--only-real-part", action="store_true")
    parser.add_argument(
        "--old-src", help="the src directory of another checkout: its scan beside this one's"
    )
    args = parser.parse_args()
    old_scan = load_scan_proc(args.old_src) if args.old_src else None

    work = Path(tempfile.mkdtemp(prefix="cardshare-bench-", dir=args.dir))
    try:
        if args.only_real_part:
            print(
                f"machine: {platform.platform()}, python {platform.python_version()}, "
                f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}"
            )
            real_part(
                args.processes, args.fds, args.drm_fds, args.clients, args.rounds, work, old_scan
            )
            return 0
        t0 = time.perf_counter()
        paths, is_drm, real = build_tree(
            work / "root", args.processes, args.fds, args.drm_fds, args.clients
        )
        built = time.perf_counter() - t0
        root = str(work / "root")
        print(
            f"payload: {args.processes} processes x {args.fds} descriptors "
            f"({args.drm_fds} DRM each, {len(paths)} DRM fdinfo files, "
            f"{args.clients} distinct DRM clients); tree built in {built:.1f} s under {work}"
        )
        print(
            f"machine: {platform.platform()}, python {platform.python_version()}, "
            f"{os.cpu_count()} cpus, DRM check: "
            f"{'real 226:128 char device' if real else 'inode (no mknod)'}"
        )
        # warm the page cache and check the scan sees what was built
        baseline(paths)
        snapshot, state = sample(root, DEFAULT_RULES, None, None, is_drm=is_drm)
        names = sum(len(c["clients"]) for c in snapshot["cards"].values())
        print(f"scan result: {len(state['clients'])} DRM clients, {names} names")

        stats = snapshot["stats"]
        print(
            f"scan stats: {stats.get('drm_descriptors')} DRM descriptors, fdinfo reads "
            f"{stats.get('fdinfo_reads')}, saved by the dedupe {stats.get('fdinfo_reads_saved')}"
        )

        medians = timed(
            {
                "base": lambda: baseline(paths),
                "minimal": lambda: minimal(root, is_drm),
                "floor": lambda: walk_floor(root, lambda target: target.endswith("/renderD128")),
                "scan": lambda: sample(root, DEFAULT_RULES, None, state, is_drm=is_drm),
            },
            args.rounds,
        )
        b, m, f, s = (medians[name] for name in ("base", "minimal", "floor", "scan"))
        print(f"rounds: {args.rounds}")
        print(f"baseline (plain read of the DRM fdinfo files): median {b * 1000:.1f} ms")
        print(f"minimal scanner (walk + DRM fdinfo):           median {m * 1000:.1f} ms")
        print(f"walk floor (readlink + DRM fdinfo, no more):   median {f * 1000:.1f} ms")
        print(f"full scan (cardshare.recorder.sample):         median {s * 1000:.1f} ms")
        print(f"ratio scan/minimal:  {s / m:.2f}x")
        print(f"ratio scan/baseline: {s / b:.2f}x")
        print(f"ratio floor/baseline: {f / b:.2f}x (the least any descriptor walk costs here)")
        print(f"a read here costs {b / len(paths) * 1e6:.1f} us")

        tracemalloc.start()
        sample(root, DEFAULT_RULES, None, state, is_drm=is_drm)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"peak memory of one scan (tracemalloc): {peak / 1024**2:.1f} MB")
        print(f"peak RSS of this process (ru_maxrss, includes building): {rss_kib / 1024:.1f} MB")
        if not args.no_real_part:
            real_part(
                args.processes, args.fds, args.drm_fds, args.clients, args.rounds, work, old_scan
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
