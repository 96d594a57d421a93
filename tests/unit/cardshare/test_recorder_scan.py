"""Tests of cardshare.recorder.scan on synthetic /proc trees."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cardshare.recorder.procfs import is_drm_char_device, read_process_info
from cardshare.recorder.scan import scan_proc

CID = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"


def test_shared_descriptors_count_once(rec_tree: Any, rec_make_fdinfo: Callable[..., str]) -> None:
    t = rec_tree
    shared = rec_make_fdinfo(3, vram="1 MiB")
    t.process(100, comm="vllm", cgroup=f"0::/system.slice/docker-{CID}.scope\n")
    t.drm_fd(100, 5, shared)
    t.drm_fd(100, 6, shared)  # dup() of fd 5
    t.process(101, comm="worker")
    t.drm_fd(101, 9, shared)  # inherited by a child
    t.drm_fd(101, 10, rec_make_fdinfo(4, vram="2 MiB"))
    t.drm_fd(101, 11, rec_make_fdinfo(3, pdev="0000:04:00.0"))  # same id, other card
    t.file_fd(101, 0)
    t.process(102, comm="bash")
    t.file_fd(102, 0)
    t.file_fd(102, 1)

    scan = scan_proc(str(t.root), t.is_drm)

    assert sorted(scan.clients) == [("0000:03:00.0", 3), ("0000:03:00.0", 4), ("0000:04:00.0", 3)]
    shared_client = scan.clients[("0000:03:00.0", 3)]
    assert shared_client.pids == {100, 101}
    assert shared_client.descriptors == 3
    assert shared_client.fdinfo.vram_bytes == 1024**2
    assert sorted(scan.processes) == [100, 101]
    assert scan.processes[100].container is not None
    assert scan.processes[100].comm == "vllm"
    stats = scan.stats.as_dict()
    assert stats == {
        "processes": 3,
        "descriptors": 8,
        "drm_descriptors": 5,
        "vanished": 0,
        "unreadable": 0,
        "not_clients": 0,
        "malformed_lines": 0,
        "unreadable_processes": 0,
        "reused": 0,
        "fdinfo_reads": 5,
        "fdinfo_reads_saved": 0,  # a synthetic tree: no kcmp, every DRM fdinfo is read
    }
    assert scan.dedupe == "client-id"


def test_no_clients_is_empty(rec_tree: Any) -> None:
    rec_tree.process(1, comm="init")
    rec_tree.file_fd(1, 0)
    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm)
    assert scan.clients == {}
    assert scan.processes == {}
    assert scan.stats.processes == 1


@pytest.mark.parametrize(
    ("damage", "counter"),
    [
        ("remove_fd_dir", "vanished"),
        ("fd_dir_is_file", "unreadable"),
        ("remove_fdinfo", "vanished"),
        ("dangling_fd", "vanished"),
        ("fdinfo_is_dir", "unreadable"),
        ("no_client_id", "not_clients"),
    ],
)
def test_damaged_processes_are_skipped(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], damage: str, counter: str
) -> None:
    t = rec_tree
    t.process(200, comm="good")
    t.drm_fd(200, 3, rec_make_fdinfo(1))
    base = t.process(201, comm="bad")
    t.drm_fd(201, 3, rec_make_fdinfo(2))
    if damage == "remove_fd_dir":
        shutil.rmtree(base / "fd")
    elif damage == "fd_dir_is_file":
        shutil.rmtree(base / "fd")
        (base / "fd").write_text("")
    elif damage == "remove_fdinfo":
        (base / "fdinfo" / "3").unlink()
    elif damage == "dangling_fd":
        (base / "fd" / "4").symlink_to(base / "gone")
        (base / "fdinfo" / "3").unlink()
        (base / "fd" / "3").unlink()
    elif damage == "fdinfo_is_dir":
        (base / "fdinfo" / "3").unlink()
        (base / "fdinfo" / "3").mkdir()
    elif damage == "no_client_id":
        (base / "fdinfo" / "3").write_text("drm-driver: xe\ndrm-pdev: 0000:03:00.0\n")

    scan = scan_proc(str(t.root), t.is_drm)

    assert sorted(scan.clients) == [("0000:03:00.0", 1)]
    assert getattr(scan.stats, counter) == 1


def test_process_info_of_vanished_process(tmp_path: Path) -> None:
    info = read_process_info(str(tmp_path), 4242)
    assert (info.comm, info.cmdline, info.container) == ("", "", None)


def test_missing_proc_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        scan_proc(str(tmp_path / "nothing"))


def test_cmdline_and_comm(rec_tree: Any, rec_make_fdinfo: Callable[..., str]) -> None:
    rec_tree.process(7, comm="Plex Transcoder", cmdline=("/usr/lib/Plex Transcoder", "-i", "a"))
    rec_tree.drm_fd(7, 3, rec_make_fdinfo(9))
    scan = scan_proc(str(rec_tree.root), rec_tree.is_drm)
    assert scan.processes[7].comm == "Plex Transcoder"
    assert scan.processes[7].cmdline == "/usr/lib/Plex Transcoder -i a"


def test_real_character_device(rec_tree: Any, rec_make_fdinfo: Callable[..., str]) -> None:
    if not rec_tree.real_node:
        pytest.skip("mknod of a character device is not permitted here (needs CAP_MKNOD)")
    rec_tree.process(300)
    rec_tree.drm_fd(300, 3, rec_make_fdinfo(1))
    rec_tree.file_fd(300, 4)
    scan = scan_proc(str(rec_tree.root))  # the default check: char device, major 226
    assert sorted(scan.clients) == [("0000:03:00.0", 1)]
    assert scan.stats.drm_descriptors == 1


@pytest.mark.parametrize(
    ("mode", "rdev", "expected"),
    [
        (stat.S_IFCHR | 0o600, os.makedev(226, 128), True),
        (stat.S_IFCHR | 0o600, os.makedev(226, 0), True),
        (stat.S_IFCHR | 0o600, os.makedev(1, 3), False),  # /dev/null
        (stat.S_IFBLK | 0o600, os.makedev(226, 0), False),
        (stat.S_IFREG | 0o644, 0, False),
    ],
)
def test_is_drm_char_device(mode: int, rdev: int, expected: bool) -> None:
    st = os.stat_result((mode, 1, 1, 1, 0, 0, 0, 0, 0, 0))
    fake = _StatWithRdev(st, rdev)
    assert is_drm_char_device(fake) is expected  # type: ignore[arg-type]


class _StatWithRdev:
    def __init__(self, st: os.stat_result, rdev: int) -> None:
        self.st_mode = st.st_mode
        self.st_rdev = rdev
