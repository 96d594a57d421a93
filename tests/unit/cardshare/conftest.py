"""Helpers of the recorder tests: fixture files and synthetic ``/proc`` trees (``rec_*``)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

REC_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


class RecTree:
    """A synthetic root (``proc``, ``sys``, ``dev``) for the scanner.

    The DRM node is a real character device 226:128 when ``mknod`` is allowed; otherwise a
    regular file, and :attr:`is_drm` recognises it by inode (the scanner's check is
    injectable for exactly this reason).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "proc").mkdir(parents=True)
        dri = root / "dev" / "dri"
        dri.mkdir(parents=True)
        self.node = dri / "renderD128"
        try:
            os.mknod(self.node, stat.S_IFCHR | 0o600, os.makedev(226, 128))
            self.real_node = True
        except PermissionError:
            self.node.write_bytes(b"")
            self.real_node = False
        self.plain = root / "plain-file"
        self.plain.write_text("not a device\n")
        node_ino = self.node.stat().st_ino

        def is_drm(st: os.stat_result) -> bool:
            if self.real_node:
                return stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 226
            return st.st_ino == node_ino

        self.is_drm: Callable[[os.stat_result], bool] = is_drm

    def process(
        self,
        pid: int,
        comm: str = "worker",
        cmdline: tuple[str, ...] = ("worker",),
        cgroup: str = "0::/user.slice/user-1000.slice/session-1.scope\n",
    ) -> Path:
        base = self.root / "proc" / str(pid)
        (base / "fd").mkdir(parents=True, exist_ok=True)
        (base / "fdinfo").mkdir(exist_ok=True)
        (base / "comm").write_text(comm + "\n")
        (base / "cmdline").write_bytes(b"\0".join(a.encode() for a in cmdline) + b"\0")
        (base / "cgroup").write_text(cgroup)
        return base

    def drm_fd(self, pid: int, fd: int, fdinfo: str) -> None:
        base = self.root / "proc" / str(pid)
        (base / "fd" / str(fd)).symlink_to(self.node)
        (base / "fdinfo" / str(fd)).write_text(fdinfo)

    def file_fd(self, pid: int, fd: int) -> None:
        base = self.root / "proc" / str(pid)
        (base / "fd" / str(fd)).symlink_to(self.plain)
        (base / "fdinfo" / str(fd)).write_text("pos:\t0\nflags:\t0100000\nmnt_id:\t1\nino:\t2\n")

    def card(self, pdev: str, driver: str = "xe", vram: str | None = "0x800000000") -> None:
        dev = self.root / "sys" / "bus" / "pci" / "devices" / pdev
        (dev / "drm" / "card0").mkdir(parents=True)
        (self.root / "sys" / "bus" / "pci" / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (dev / "driver").symlink_to(f"../../../bus/pci/drivers/{driver}")
        if vram is not None:
            (dev / "tile0").mkdir()
            (dev / "tile0" / "physical_vram_size_bytes").write_text(vram + "\n")

    def boot_id(self, value: str) -> None:
        path = self.root / "proc" / "sys" / "kernel" / "random" / "boot_id"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
        (self.root / "proc" / "sys" / "kernel" / "hostname").write_text("testhost\n")


def rec_fdinfo(
    client_id: int,
    pdev: str = "0000:03:00.0",
    vram: str = "0",
    cycles: dict[str, tuple[int, int]] | None = None,
    capacity: dict[str, int] | None = None,
) -> str:
    """An xe-style fdinfo text."""
    lines = [
        "pos:\t0",
        "flags:\t0100002",
        "drm-driver:\txe",
        f"drm-client-id:\t{client_id}",
        f"drm-pdev:\t{pdev}",
        "drm-resident-gtt:\t192 KiB",
        f"drm-resident-vram0:\t{vram}",
    ]
    for cls, (busy, total) in (cycles or {}).items():
        lines.append(f"drm-cycles-{cls}:\t{busy}")
        lines.append(f"drm-total-cycles-{cls}:\t{total}")
    for cls, cap in (capacity or {}).items():
        lines.append(f"drm-engine-capacity-{cls}:\t{cap}")
    return "\n".join(lines) + "\n"


@pytest.fixture
def rec_tree(tmp_path: Path) -> RecTree:
    return RecTree(tmp_path / "root")


@pytest.fixture
def rec_fixtures() -> Path:
    return REC_FIXTURES


@pytest.fixture
def rec_make_fdinfo() -> Callable[..., str]:
    return rec_fdinfo
