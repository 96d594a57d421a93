"""Benchmark: a full recorder scan against a plain read of the same fdinfo files.

Builds a synthetic root of ``--processes`` processes with ``--fds`` descriptors each:
``--drm-fds`` of them are DRM descriptors (links to a 226:128 character device) that share
``--clients`` distinct DRM clients (so most are duplicates, as threads and children of one
program are), the rest links to a plain file.  Each DRM descriptor's fdinfo is the full xe
text (about 40 lines).

Then, for several rounds, alternating the order, it times:

* baseline: a plain loop that opens and reads every DRM fdinfo file of the tree;
* scan: ``cardshare.recorder.sample`` (list /proc, stat every descriptor, read and parse the
  DRM fdinfo, dedupe, read comm/cmdline/cgroup, name, compute busy shares, build the snapshot).

It prints the payload, the machine, the median times, their ratio (goal: at most 2x) and the
peak memory of one scan (tracemalloc) and of the process (ru_maxrss; goal: under 30 MB).

Usage: ``python benchmarks/recorder/bench_scan.py [--rounds 7] [--dir DIR]`` (needs
``src`` on ``PYTHONPATH``; run as root to get a real character device, otherwise the DRM
check falls back to comparing inodes).
"""

from __future__ import annotations

import argparse
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
        (base / "cmdline").write_bytes(f"/usr/bin/worker{i % 7}\0--flag\0".encode())
        cid = i % clients
        (base / "cgroup").write_text(f"0::/system.slice/docker-{cid:064x}.scope\n")
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2000)
    parser.add_argument("--fds", type=int, default=20)
    parser.add_argument("--drm-fds", type=int, default=4, help="DRM descriptors per process")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", help="where to build the tree (default: a temp directory)")
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

        base_times: list[float] = []
        scan_times: list[float] = []
        for r in range(args.rounds):
            order = ("base", "scan") if r % 2 == 0 else ("scan", "base")
            for which in order:
                start = time.perf_counter()
                if which == "base":
                    baseline(paths)
                    base_times.append(time.perf_counter() - start)
                else:
                    sample(root, DEFAULT_RULES, None, state, is_drm=is_drm)
                    scan_times.append(time.perf_counter() - start)
        b, s = statistics.median(base_times), statistics.median(scan_times)
        print(f"rounds: {args.rounds}")
        print(f"baseline (plain read of the DRM fdinfo files): median {b * 1000:.1f} ms")
        print(f"full scan (cardshare.recorder.sample):         median {s * 1000:.1f} ms")
        print(f"ratio scan/baseline: {s / b:.2f}x (goal <= 2x)")

        tracemalloc.start()
        sample(root, DEFAULT_RULES, None, state, is_drm=is_drm)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"peak memory of one scan (tracemalloc): {peak / 1024**2:.1f} MB")
        print(f"peak RSS of this process (ru_maxrss, includes building): {rss_kib / 1024:.1f} MB")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
