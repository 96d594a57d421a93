"""Module-test helpers: a simulated card tree and an Ansible module runner.

The tree follows ``lab/SIMULATION.md`` (the same layout the lab provides); the
module ``modules.alias`` files come from ``tests/fixtures/sysfs``.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ansible.module_utils import basic  # type: ignore[import-untyped]

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "sysfs"
BDF = "0000:03:00.0"
OLD_KERNEL = "6.12.0-55.el10.x86_64"
NEW_KERNEL = "6.12.0-124.el10.x86_64"


def _mknod_allowed() -> bool:
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f".cardshare-mknod-{os.getpid()}"
    try:
        os.mknod(probe, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES, errno.EROFS):
            return False
        raise
    probe.unlink()
    return True


MKNOD = _mknod_allowed()
needs_mknod = pytest.mark.skipif(
    not MKNOD, reason="creating character devices (mknod) is not permitted here"
)


@dataclass
class Sim:
    root: Path
    modules_dir: Path


def _write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)


def build_sim(
    base: Path,
    *,
    pci_id: str = "e223",
    driver: str | None = "xe",
    guc: str = "RUNNING",
    huc: str = "RUNNING",
    secure_boot: int | None = 0,
    vram: str | None = "34359738368",
    running: str = NEW_KERNEL,
    kernels: tuple[str, ...] = (OLD_KERNEL, NEW_KERNEL),
    client: str | None = "fdinfo.xe.txt",
    devices: bool = True,
    pci_dir_is_link: bool = False,
) -> Sim:
    """Build the simulated tree under ``base/root`` and alias tables under ``base/modules``.

    ``OLD_KERNEL`` gets the 10.0 alias table (no E223), any other kernel the 10.2 one.
    """
    root = base / "root"
    modules = base / "modules"
    for kver in kernels:
        table = "modules.alias.el10_0" if kver == OLD_KERNEL else "modules.alias.el10_2"
        _write(modules / kver / "modules.alias", (FIXTURES / table).read_text())
    _write(root / "proc/sys/kernel/osrelease", running + "\n")
    _write(root / "proc/sys/kernel/random/boot_id", "4f1c2a9e-0d1b-4a57-9a43-6c1f0e5b7d21\n")
    if secure_boot is not None:
        _write(
            root / "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c",
            bytes([6, 0, 0, 0, secure_boot]),
        )
    (root / "sys/bus/pci/drivers/xe").mkdir(parents=True)
    (root / "sys/bus/pci/drivers/i915").mkdir(parents=True)
    pci = root / "sys/bus/pci/devices"
    pci.mkdir(parents=True)
    # a non-GPU Intel function and a non-Intel display device: both ignored
    _write(pci / "0000:00:14.0/vendor", "0x8086\n")
    _write(pci / "0000:00:14.0/device", "0xa0ed\n")
    _write(pci / "0000:00:14.0/class", "0x0c0330\n")
    _write(pci / "0000:05:00.0/vendor", "0x1002\n")
    _write(pci / "0000:05:00.0/device", "0x73bf\n")
    _write(pci / "0000:05:00.0/class", "0x030000\n")
    if not devices:
        return Sim(root, modules)

    if pci_dir_is_link:
        dev = root / "sys/devices/pci0000:00/0000:00:01.0" / BDF
        dev.mkdir(parents=True)
        (pci / BDF).symlink_to(os.path.relpath(dev, pci))
    else:
        dev = pci / BDF
        dev.mkdir()
    _write(dev / "vendor", "0x8086\n")
    _write(dev / "device", f"0x{pci_id}\n")
    _write(dev / "class", "0x030000\n")
    _write(dev / "subsystem_vendor", "0x8086\n")
    _write(dev / "subsystem_device", "0x1114\n")
    if vram is not None:
        _write(dev / "tile0/physical_vram_size_bytes", vram + "\n")
    if driver is None:
        return Sim(root, modules)

    (dev / "driver").symlink_to(f"../../../bus/pci/drivers/{driver}")
    (dev / "drm/card0").mkdir(parents=True)
    (dev / "drm/renderD128").mkdir(parents=True)
    dri = root / "dev/dri"
    dri.mkdir(parents=True)
    if MKNOD:
        os.mknod(dri / "renderD128", stat.S_IFCHR | 0o666, os.makedev(226, 128))
        os.mknod(dri / "card0", stat.S_IFCHR | 0o660, os.makedev(226, 0))
    (dri / "by-path").mkdir()
    (dri / "by-path" / f"pci-{BDF}-render").symlink_to("../renderD128")
    debug = root / "sys/kernel/debug/dri/0"
    _write(
        debug / "gt0/uc/guc_info",
        f"GuC firmware: xe/bmg_guc_70.bin\n\tstatus: {guc}\n"
        "\tversion: wanted 70.44.1, found 70.44.1\n",
    )
    _write(debug / "gt0/uc/huc_info", "HuC firmware: \n\tstatus: N/A\n")
    _write(debug / "gt1/uc/guc_info", "GuC firmware: xe/bmg_guc_70.bin\n\tstatus: RUNNING\n")
    _write(debug / "gt1/uc/huc_info", f"HuC firmware: xe/bmg_huc.bin\n\tstatus: {huc}\n")
    if client is not None and MKNOD:
        proc = root / "proc/100001"
        _write(proc / "comm", "vllm\n")
        _write(proc / "cgroup", "0::/system.slice/docker-" + "a" * 64 + ".scope\n")
        (proc / "fd").mkdir()
        (proc / "fd/7").symlink_to(dri / "renderD128")
        (proc / "fd/0").symlink_to("/dev/null")
        _write(proc / "fdinfo/7", (FIXTURES / client).read_text())
        _write(proc / "fdinfo/0", "pos:\t0\nflags:\t02\n")
    return Sim(root, modules)


@pytest.fixture
def sim(tmp_path: Path) -> Callable[..., Sim]:
    def make(**knobs: Any) -> Sim:
        return build_sim(tmp_path, **knobs)

    return make


class ExitJson(Exception):
    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__("exit_json")
        self.result = result


class FailJson(Exception):
    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(result.get("msg"))
        self.result = result


@pytest.fixture
def run_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., dict[str, Any]]]:
    """Run a module's ``main()`` with arguments; return its result or raise ``FailJson``."""

    def exit_json(_self: Any, **kwargs: Any) -> None:
        raise ExitJson(kwargs)

    def fail_json(_self: Any, **kwargs: Any) -> None:
        raise FailJson(kwargs)

    monkeypatch.setattr(basic.AnsibleModule, "exit_json", exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", fail_json)

    def run(main: Callable[[], None], args: dict[str, Any]) -> dict[str, Any]:
        payload = {"ANSIBLE_MODULE_ARGS": {"_ansible_check_mode": False, **args}}
        monkeypatch.setattr(basic, "_ANSIBLE_ARGS", json.dumps(payload).encode())
        monkeypatch.setattr(basic, "_ANSIBLE_PROFILE", "legacy")
        try:
            main()
        except ExitJson as done:
            return done.result
        raise AssertionError("module returned without exit_json")

    yield run
