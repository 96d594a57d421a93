# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The readers of the host's Intel GPUs and the xe driver (:func:`gather` and its helpers):
they walk a root prefix, ``/`` on a real host and the simulated tree in the lab, and turn
what a host can refuse (missing files, permissions) into values with a reason.  The parsing
is ``_xe_parse``'s.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.cardshare.gpuhost.plugins.module_utils._rpmvercmp import uname_sort_key
from ansible_collections.cardshare.gpuhost.plugins.module_utils._xe_parse import (
    DEFAULT_DRIVER,
    DISPLAY_CLASS,
    DRM_MAJOR,
    AliasEntry,
    UcReport,
    UcStatus,
    aggregate_uc,
    fdinfo_report,
    id_forms,
    modules_matching,
    normalise_device_id,
    parse_fdinfo,
    parse_modules_alias,
    parse_sysfs_hex,
    parse_sysfs_size,
    parse_uc_info,
    pci_modalias,
)

__all__ = [
    "gather",
]

# ---------------------------------------------------------------------------
# Readers (I/O at the edge)
# ---------------------------------------------------------------------------


def _under(root: str, path: str) -> str:
    """``path`` (absolute on the host) under the root prefix."""
    return os.path.join(root, path.lstrip("/"))


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _char_device(path: str) -> tuple[bool, int | None, int | None]:
    """(is a DRM char device, major, minor) for ``path`` (following links)."""
    try:
        st = os.stat(path)
    except OSError:
        return (False, None, None)
    if not stat.S_ISCHR(st.st_mode):
        return (False, None, None)
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    return (major == DRM_MAJOR, major, minor)


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _gt_sort_key(name: str) -> tuple[int, str]:
    digits = name[2:]
    return (int(digits) if digits.isdigit() else 1 << 30, name)


def read_uc(debugfs_dri: str, card_minor: int | None, bdf: str, filename: str) -> UcReport:
    """Read ``gt*/uc/<filename>`` of one device from debugfs ``dri/``.

    The device directory is ``dri/<card minor>``; newer kernels also name it by PCI
    address, which is tried second.
    """
    if card_minor is None:
        return aggregate_uc([], "the device has no DRM card (not bound to a DRM driver)")
    debugfs = os.path.dirname(debugfs_dri)
    try:
        if not os.path.isdir(debugfs):
            return aggregate_uc([], f"no debugfs at {debugfs}")
        os.listdir(debugfs)
        if not os.path.isdir(debugfs_dri):
            return aggregate_uc([], f"no {debugfs_dri}: debugfs is not mounted")
        candidates = [os.path.join(debugfs_dri, str(card_minor)), os.path.join(debugfs_dri, bdf)]
        base = next((c for c in candidates if os.path.isdir(c)), None)
        if base is None:
            return aggregate_uc([], f"no debugfs directory {candidates[0]}")
        per_gt: list[tuple[str, UcStatus]] = []
        gts = [g for g in os.listdir(base) if re.fullmatch(r"gt\d+", g)]
        for gt in sorted(gts, key=_gt_sort_key):
            text = _read_text(os.path.join(base, gt, "uc", filename))
            if text is not None:
                per_gt.append((gt, parse_uc_info(text)))
    except PermissionError as exc:
        where = exc.filename or debugfs
        return aggregate_uc([], f"permission denied reading {where} (needs root)")
    return aggregate_uc(per_gt, f"no gt*/uc/{filename} under {base}")


@dataclass
class _FdScan:
    """DRM descriptors found under ``<root>/proc``."""

    by_bdf: dict[str, list[str]] = field(default_factory=dict)
    by_minor: dict[int, list[str]] = field(default_factory=dict)
    denied: int = 0


def scan_proc_fdinfo(proc: str) -> _FdScan:
    """Find DRM descriptors (char major 226) of every process and read their fdinfo."""
    scan = _FdScan()
    for pid in _listdir(proc):
        if not pid.isdigit():
            continue
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            scan.denied += 1
            continue
        except OSError:
            continue
        denied_here = False
        for fd in fds:
            is_drm, _major, minor = _char_device(os.path.join(fd_dir, fd))
            if not is_drm:
                continue
            try:
                text = _read_text(os.path.join(proc, pid, "fdinfo", fd))
            except PermissionError:
                denied_here = True
                continue
            except OSError:  # the process or descriptor went away meanwhile
                continue
            if text is None:
                continue
            pdev = parse_fdinfo(text).get("drm-pdev")
            if pdev:
                scan.by_bdf.setdefault(pdev, []).append(text)
            elif minor is not None:
                scan.by_minor.setdefault(minor, []).append(text)
        if denied_here:
            scan.denied += 1
    return scan


def probe_self_fdinfo(render_path: str) -> tuple[str | None, str | None]:
    """Open the render node and read this process's own fdinfo for it.

    Returns (text, error).  Only meaningful on a real host (root prefix ``/``).
    """
    try:
        fd = os.open(render_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return (None, f"cannot open {render_path}: {exc.strerror}")
    try:
        text = _read_text(f"/proc/self/fdinfo/{fd}")
    finally:
        os.close(fd)
    return (text, None if text is not None else "no /proc/self/fdinfo entry")


def read_alias_tables(modules_dir: str) -> tuple[dict[str, list[AliasEntry]], list[str]]:
    """PCI alias entries of each kernel under ``modules_dir`` (kernels with a
    ``modules.alias``), and the kernel directories without one."""
    tables: dict[str, list[AliasEntry]] = {}
    missing: list[str] = []
    for name in _listdir(modules_dir):
        path = os.path.join(modules_dir, name)
        if not os.path.isdir(path):
            continue
        text = _read_text(os.path.join(path, "modules.alias"))
        if text is None:
            missing.append(name)
            continue
        tables[name] = parse_modules_alias(text)
    return tables, missing


def id_knowledge(
    modalias: str,
    tables: Mapping[str, Sequence[AliasEntry]],
    running_kernel: str | None,
    driver: str = DEFAULT_DRIVER,
) -> dict[str, Any]:
    """Which kernels' alias tables let ``driver`` (and others) claim ``modalias``."""
    modules = {kver: modules_matching(entries, modalias) for kver, entries in tables.items()}
    knowing = sorted(
        (k for k, mods in modules.items() if driver in mods), key=uname_sort_key, reverse=True
    )
    ordered = sorted(modules, key=uname_sort_key, reverse=True)
    known: bool | None = None
    if running_kernel is not None and running_kernel in modules:
        known = driver in modules[running_kernel]
    return {
        "modalias": modalias,
        "known_to_running_kernel": known,
        "running_kernel_modules": modules.get(running_kernel or ""),
        "kernels_knowing_id": knowing,
        "kernel_modules": {k: modules[k] for k in ordered},
    }


def _read_hex_attr(dev_dir: str, name: str) -> int | None:
    text = _read_text(os.path.join(dev_dir, name))
    if text is None:
        return None
    return parse_sysfs_hex(text, f"{os.path.join(dev_dir, name)}")


def gather(
    host_root: str = "/",
    modules_dir: str = "/lib/modules",
    vendor_ids: Sequence[int] = (0x8086,),
    debugfs: str = "sys/kernel/debug",
    expected_ids: Sequence[str] = (),
    driver: str = DEFAULT_DRIVER,
    self_probe: bool | None = None,
) -> dict[str, Any]:
    """Read everything ``xe_driver_info`` reports from the tree under ``host_root``.

    ``modules_dir`` is read as given (never under ``host_root``): alias tables come
    from the installed kernel packages.  ``self_probe`` (default: host_root is ``/``)
    allows opening the render node to read this process's own fdinfo when no other
    process has the card open.
    """
    root = host_root or "/"
    if self_probe is None:
        self_probe = os.path.realpath(root) == "/"
    osrelease = _read_text(_under(root, "/proc/sys/kernel/osrelease"))
    running = osrelease.strip() if osrelease else None
    tables, no_alias = read_alias_tables(modules_dir)
    installed = sorted(tables, key=uname_sort_key, reverse=True)
    debugfs_dri = os.path.join(_under(root, debugfs), "dri")
    fd_scan = scan_proc_fdinfo(_under(root, "/proc"))

    devices: list[dict[str, Any]] = []
    knowledge: dict[str, dict[str, Any]] = {}
    pci_dir = _under(root, "/sys/bus/pci/devices")
    for bdf in _listdir(pci_dir):
        dev_dir = os.path.join(pci_dir, bdf)
        vendor = _read_hex_attr(dev_dir, "vendor")
        pci_class = _read_hex_attr(dev_dir, "class")
        if vendor is None or pci_class is None:
            continue
        if vendor not in vendor_ids or (pci_class >> 16) != DISPLAY_CLASS:
            continue
        device = _read_hex_attr(dev_dir, "device") or 0
        devices.append(
            _read_device(
                root, dev_dir, bdf, vendor, device, pci_class, debugfs_dri, fd_scan, self_probe
            )
        )
    for dev in devices:
        modalias_text = _read_text(os.path.join(pci_dir, dev["bdf"], "modalias"))
        modalias = modalias_text.strip() if modalias_text else dev["modalias"]
        info = id_knowledge(modalias, tables, running, driver)
        dev.update(
            {
                "known_to_running_kernel": info["known_to_running_kernel"],
                "running_kernel_modules": info["running_kernel_modules"],
                "kernels_knowing_id": info["kernels_knowing_id"],
                "kernel_modules": info["kernel_modules"],
            }
        )
        knowledge.setdefault(dev["device_id"], info)
    for ident in expected_ids:
        norm = normalise_device_id(ident)
        if norm not in knowledge:
            vendor = vendor_ids[0] if vendor_ids else 0x8086
            modalias = pci_modalias(vendor, int(norm, 16), 0, 0, DISPLAY_CLASS << 16)
            knowledge[norm] = id_knowledge(modalias, tables, running, driver)
    return {
        "running_kernel": running,
        "installed_kernels": installed,
        "kernels_without_alias_table": no_alias,
        "xe_devices": devices,
        "id_knowledge": knowledge,
    }


def _read_device(
    root: str,
    dev_dir: str,
    bdf: str,
    vendor: int,
    device: int,
    pci_class: int,
    debugfs_dri: str,
    fd_scan: _FdScan,
    self_probe: bool,
) -> dict[str, Any]:
    sub_vendor = _read_hex_attr(dev_dir, "subsystem_vendor")
    sub_device = _read_hex_attr(dev_dir, "subsystem_device")
    driver_link = os.path.join(dev_dir, "driver")
    bound = os.path.basename(os.readlink(driver_link)) if os.path.islink(driver_link) else None
    drm_entries = _listdir(os.path.join(dev_dir, "drm"))
    card = next((e for e in drm_entries if re.fullmatch(r"card\d+", e)), None)
    render = next((e for e in drm_entries if re.fullmatch(r"renderD\d+", e)), None)
    card_minor = int(card[4:]) if card else None
    render_minor = int(render[7:]) if render else None

    render_host_path = f"/dev/dri/{render}" if render else None
    render_exists = False
    if render_host_path:
        is_drm, _major, _minor = _char_device(_under(root, render_host_path))
        render_exists = is_drm
    by_path = f"/dev/dri/by-path/pci-{bdf}-render"
    by_path_exists = _char_device(_under(root, by_path))[0]

    vram: int | None = None
    vram_text = _read_text(os.path.join(dev_dir, "tile0", "physical_vram_size_bytes"))
    if vram_text is not None:
        vram = parse_sysfs_size(vram_text, "physical_vram_size_bytes")

    guc = read_uc(debugfs_dri, card_minor, bdf, "guc_info")
    huc = read_uc(debugfs_dri, card_minor, bdf, "huc_info")

    texts = list(fd_scan.by_bdf.get(bdf, []))
    for minor in (card_minor, render_minor):
        if minor is not None:
            texts.extend(fd_scan.by_minor.get(minor, []))
    fdinfo = fdinfo_report(texts, "clients", fd_scan.denied)
    if (
        fdinfo.status in ("no-clients", "unreadable")
        and self_probe
        and render_exists
        and render_host_path is not None
    ):
        text, error = probe_self_fdinfo(_under(root, render_host_path))
        if text is not None:
            fdinfo = fdinfo_report([text], "self", fd_scan.denied)
        elif fdinfo.status == "no-clients":
            fdinfo.reason = f"no process has the card open and {error}"

    lower, upper = id_forms(device)
    return {
        "bdf": bdf,
        "vendor": f"0x{vendor:04x}",
        "device_id": lower,
        "alias_id": upper,
        "class": f"0x{pci_class:06x}",
        "subsystem_vendor": f"0x{sub_vendor:04x}" if sub_vendor is not None else None,
        "subsystem_device": f"0x{sub_device:04x}" if sub_device is not None else None,
        "modalias": pci_modalias(vendor, device, sub_vendor or 0, sub_device or 0, pci_class),
        "driver": bound,
        "card": card,
        "render_node": render,
        "render_node_path": render_host_path,
        "render_node_exists": render_exists,
        "render_node_by_path": by_path,
        "render_node_by_path_exists": by_path_exists,
        "vram_bytes": vram,
        "guc": guc.to_dict(),
        "huc": huc.to_dict(),
        "fdinfo": fdinfo.to_dict(),
    }
