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

It prints the payload, the machine, the median times, the ratios (goals: at most 1.0x the
minimal scanner and at most 2.0x the baseline), the fdinfo reads and reads saved by the
dedupe, and the peak memory of one scan (tracemalloc) and of the process (ru_maxrss; goal:
under 30 MB).

A synthetic tree has no processes for ``kcmp`` to compare, so the scan reads every DRM
fdinfo there (0 saved).  Unless ``--no-kcmp-part``, a second part forks ``--kcmp-processes``
real processes sharing ``--drm-fds`` descriptors (one open file, ``dup()``-ed, inherited by
``fork()``) of an ordinary file standing in for the DRM node, and scans the real ``/proc``
with and without the dedupe: reads, reads saved and times.

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

from cardshare.naming import DEFAULT_RULES
from cardshare.procscan import scan_proc
from cardshare.recorder import sample

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


def walk_floor(root: str) -> int:
    """Listing, one ``readlink`` per descriptor and the DRM fdinfo reads: nothing else."""
    proc = os.path.join(root, "proc")
    flags = os.O_RDONLY | os.O_DIRECTORY
    proc_fd = os.open(proc, flags)
    total = 0
    try:
        for name in os.listdir(proc_fd):
            pid_fd = os.open(name, flags, dir_fd=proc_fd)
            try:
                fd_dir = os.open("fd", flags, dir_fd=pid_fd)
                try:
                    fds = os.listdir(fd_dir)
                    targets = [os.readlink(fd, dir_fd=fd_dir) for fd in fds]
                finally:
                    os.close(fd_dir)
                for fd, target in zip(fds, targets, strict=True):
                    if target.endswith("/renderD128"):
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


def kcmp_part(processes: int, drm_fds: int, rounds: int, work: Path) -> None:
    """Real processes sharing one open file: what the kcmp dedupe saves on the real /proc."""
    path = work / "standin-node"
    path.write_text("a DRM node stand-in\n")
    target = path.stat()

    def is_it(st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino)

    hold_r, hold_w = os.pipe()
    ready_r, ready_w = os.pipe()
    fd = os.open(path, os.O_RDONLY)
    for _ in range(drm_fds - 1):
        os.dup(fd)
    children = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:  # the child holds the inherited descriptors until the pipe closes
            os.close(hold_w)
            os.write(ready_w, b".")
            os.read(hold_r, 1)
            os._exit(0)
        children.append(pid)
    os.close(hold_r)
    for _ in range(processes):
        os.read(ready_r, 1)
    try:
        times: dict[str, list[float]] = {"auto": [], "off": []}
        scans = {}
        for r in range(rounds):
            for mode in ("auto", "off") if r % 2 == 0 else ("off", "auto"):
                start = time.perf_counter()
                scans[mode] = scan_proc("/", is_it, compare="auto" if mode == "auto" else "off")
                times[mode].append(time.perf_counter() - start)
        on = scans["auto"]
        print(
            f"kcmp part: {processes} real processes + this one, {drm_fds} descriptors of one "
            f"open file each ({on.stats.drm_descriptors} descriptors), real /proc of "
            f"{on.stats.processes} processes, dedupe {on.dedupe!r}"
        )
        for label, mode in (("with dedupe:   ", "auto"), ("without dedupe:", "off")):
            st = scans[mode].stats
            print(
                f"  {label} fdinfo reads {st.fdinfo_reads}, saved {st.fdinfo_reads_saved}; "
                f"median {statistics.median(times[mode]) * 1000:.1f} ms"
            )
    finally:
        os.close(hold_w)
        for pid in children:
            os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(ready_w)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2000)
    parser.add_argument("--fds", type=int, default=20)
    parser.add_argument("--drm-fds", type=int, default=4, help="DRM descriptors per process")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", help="where to build the tree (default: a temp directory)")
    parser.add_argument("--kcmp-processes", type=int, default=200)
    parser.add_argument("--no-kcmp-part", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cardshare-bench-", dir=args.dir))
    try:
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

        runs: dict[str, Callable[[], object]] = {
            "base": lambda: baseline(paths),
            "minimal": lambda: minimal(root, is_drm),
            "floor": lambda: walk_floor(root),
            "scan": lambda: sample(root, DEFAULT_RULES, None, state, is_drm=is_drm),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        names_in_order = list(runs)
        for r in range(args.rounds):
            # rotate the order so no runner always goes first
            k = r % len(names_in_order)
            for which in names_in_order[k:] + names_in_order[:k]:
                start = time.perf_counter()
                runs[which]()
                times[which].append(time.perf_counter() - start)
        b, m, f, s = (
            statistics.median(times[name]) for name in ("base", "minimal", "floor", "scan")
        )
        print(f"rounds: {args.rounds}")
        print(f"baseline (plain read of the DRM fdinfo files): median {b * 1000:.1f} ms")
        print(f"minimal scanner (walk + DRM fdinfo):           median {m * 1000:.1f} ms")
        print(f"walk floor (readlink + DRM fdinfo, no more):   median {f * 1000:.1f} ms")
        print(f"full scan (cardshare.recorder.sample):         median {s * 1000:.1f} ms")
        print(f"ratio scan/minimal:  {s / m:.2f}x (goal <= 1.0x)")
        print(f"ratio scan/baseline: {s / b:.2f}x (goal <= 2.0x)")
        print(f"ratio floor/baseline: {f / b:.2f}x (the least any descriptor walk costs here)")

        tracemalloc.start()
        sample(root, DEFAULT_RULES, None, state, is_drm=is_drm)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"peak memory of one scan (tracemalloc): {peak / 1024**2:.1f} MB")
        print(f"peak RSS of this process (ru_maxrss, includes building): {rss_kib / 1024:.1f} MB")
        if not args.no_kcmp_part:
            kcmp_part(args.kcmp_processes, args.drm_fds, args.rounds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
