# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the host knows about its Intel GPUs and the xe driver.

Two halves:

* pure parsers and decisions (sysfs values, ``guc_info``/``huc_info`` text, module
  alias lines, fdinfo keys, ``diagnose``), tested with tables;
* readers (``gather`` and its helpers) that walk a root prefix: ``/`` on a real
  host, the simulated tree in the lab.  They catch what a host can refuse
  (missing files, permissions) and turn it into values with a reason.

Formats: sysfs ``vendor``/``device``/``class`` print ``0x%04x``/``0x%06x``;
``modalias`` is ``pci:v%08Xd%08Xsv%08Xsd%08Xbc%02Xsc%02Xi%02X`` (kernel
``drivers/pci/pci-sysfs.c``); ``modules.alias`` lines are ``alias <glob> <module>``
(depmod), matched with fnmatch semantics as modprobe does; the uC info text is
``<type> firmware: <path>`` then ``\\tstatus: <STATE>`` (xe ``xe_uc_fw_print``).
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.cardshare.gpuhost.plugins.module_utils._rpmvercmp import (
    uname_sort_key,
)

__all__ = [
    "DRM_MAJOR",
    "AliasEntry",
    "FdinfoReport",
    "Problem",
    "UcReport",
    "UcStatus",
    "aggregate_uc",
    "diagnose",
    "fdinfo_key_families",
    "gather",
    "id_forms",
    "modules_matching",
    "normalise_device_id",
    "parse_fdinfo",
    "parse_modules_alias",
    "parse_sysfs_hex",
    "parse_sysfs_size",
    "parse_uc_info",
    "pci_modalias",
]

DRM_MAJOR = 226
DISPLAY_CLASS = 0x03
DEFAULT_DRIVER = "xe"
DEFAULT_FIRMWARE_PACKAGE = "linux-firmware"
UC_HEALTHY = "RUNNING"
UC_NOT_SUPPORTED = "N/A"

# ---------------------------------------------------------------------------
# Pure parsers
# ---------------------------------------------------------------------------

_HEX_ID = re.compile(r"^(?:0x)?([0-9a-fA-F]{4})$")


def parse_sysfs_hex(text: str, what: str = "value") -> int:
    """Parse a sysfs hex attribute such as ``0x8086\\n``."""
    value = text.strip()
    if not value.lower().startswith("0x"):
        raise ValueError(f"{what}: expected a 0x-prefixed hex value, got {value!r}")
    try:
        return int(value, 16)
    except ValueError:
        raise ValueError(f"{what}: expected a 0x-prefixed hex value, got {value!r}") from None


def parse_sysfs_size(text: str, what: str = "value") -> int:
    """Parse a size printed either in decimal or as 0x-prefixed hex."""
    value = text.strip()
    try:
        if value.lower().startswith("0x"):
            return int(value, 16)
        if value.isdigit():
            return int(value, 10)
    except ValueError:
        pass
    raise ValueError(f"{what}: expected a decimal or 0x-prefixed hex number, got {value!r}")


def normalise_device_id(value: str) -> str:
    """``E223``, ``e223`` or ``0xE223`` -> ``e223``."""
    match = _HEX_ID.match(value.strip())
    if not match:
        raise ValueError(f"{value!r} is not a 4-digit hex PCI device id (e.g. e223)")
    return match.group(1).lower()


def id_forms(device: int) -> tuple[str, str]:
    """The id as sysfs spells it (``e223``) and as alias tables do (``E223``)."""
    return (f"{device:04x}", f"{device:04X}")


def pci_modalias(vendor: int, device: int, subvendor: int, subdevice: int, pci_class: int) -> str:
    """The ``modalias`` string the kernel prints for a PCI device."""
    return (
        f"pci:v{vendor:08X}d{device:08X}sv{subvendor:08X}sd{subdevice:08X}"
        f"bc{(pci_class >> 16) & 0xFF:02X}sc{(pci_class >> 8) & 0xFF:02X}i{pci_class & 0xFF:02X}"
    )


@dataclass(frozen=True)
class AliasEntry:
    pattern: str
    module: str


def parse_modules_alias(text: str, prefix: str = "pci:") -> list[AliasEntry]:
    """The ``alias <pattern> <module>`` lines of a ``modules.alias`` whose pattern starts
    with ``prefix``.  Comments, blank lines and other buses are skipped."""
    entries: list[AliasEntry] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 3 or parts[0] != "alias" or not parts[1].startswith(prefix):
            continue
        entries.append(AliasEntry(pattern=parts[1], module=parts[2]))
    return entries


def _literal_can_match(pattern: str, modalias: str) -> bool:
    """Cheap pre-filter: a pattern naming another vendor or device literally cannot match.

    ``pci:v%08Xd%08X``: the vendor is at [5:13], the device at [14:22].
    """
    for start, end in ((5, 13), (14, 22)):
        part = pattern[start:end]
        if len(part) == 8 and all(c in "0123456789ABCDEFabcdef" for c in part):
            if part != modalias[start:end]:
                return False
        else:
            break
    return True


def modules_matching(entries: Iterable[AliasEntry], modalias: str) -> list[str]:
    """Sorted module names whose alias pattern matches ``modalias`` (fnmatch, case-sensitive,
    as modprobe matches)."""
    found = {
        e.module
        for e in entries
        if e.pattern.startswith("pci:v")
        and _literal_can_match(e.pattern, modalias)
        and fnmatch.fnmatchcase(modalias, e.pattern)
    }
    return sorted(found)


@dataclass(frozen=True)
class UcStatus:
    """One ``guc_info``/``huc_info`` file."""

    firmware: str | None
    status: str | None


_UC_FIRMWARE = re.compile(r"^(?:GuC|HuC|GSC|uC) firmware:[ \t]*(\S*)")


def parse_uc_info(text: str) -> UcStatus:
    """First ``<type> firmware: <file>`` line and the ``status:`` line that follows it."""
    firmware: str | None = None
    status: str | None = None
    seen_header = False
    for line in text.splitlines():
        header = _UC_FIRMWARE.match(line.strip())
        if header and not seen_header:
            seen_header = True
            firmware = header.group(1) or None
            continue
        stripped = line.strip()
        if seen_header and status is None and stripped.startswith("status:"):
            status = stripped[len("status:") :].strip() or None
            break
    return UcStatus(firmware=firmware, status=status)


@dataclass(frozen=True)
class UcReport:
    """GuC or HuC state of one device, over all its GTs."""

    status: str | None
    firmware: str | None
    gt: str | None
    reason: str | None
    per_gt: tuple[tuple[str, UcStatus], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "firmware": self.firmware,
            "gt": self.gt,
            "reason": self.reason,
            "per_gt": [
                {"gt": gt, "status": s.status, "firmware": s.firmware} for gt, s in self.per_gt
            ],
        }


def aggregate_uc(per_gt: Sequence[tuple[str, UcStatus]], reason_if_none: str) -> UcReport:
    """One status for a device: the first unhealthy GT wins, then the first healthy one.

    GTs reporting ``N/A`` (the firmware does not exist on that GT, e.g. HuC on the
    primary GT of a part with a media GT) are ignored unless all are ``N/A``.
    """
    if not per_gt:
        return UcReport(status=None, firmware=None, gt=None, reason=reason_if_none)
    relevant = [(gt, s) for gt, s in per_gt if s.status != UC_NOT_SUPPORTED]
    if not relevant:
        gt, s = per_gt[0]
        return UcReport(s.status, s.firmware, gt, "not supported on this device", tuple(per_gt))
    unhealthy = [(gt, s) for gt, s in relevant if s.status != UC_HEALTHY]
    gt, s = unhealthy[0] if unhealthy else relevant[0]
    reason = None if s.status is not None else f"no status line in {gt}"
    return UcReport(s.status, s.firmware, gt, reason, tuple(per_gt))


def parse_fdinfo(text: str) -> dict[str, str]:
    """``key:<whitespace>value`` lines of an fdinfo file."""
    result: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key and not key[0].isspace():
            result[key.strip()] = value.strip()
    return result


_MEMORY_PREFIXES = (
    "drm-total-",
    "drm-shared-",
    "drm-resident-",
    "drm-active-",
    "drm-purgeable-",
    "drm-memory-",
)


def fdinfo_key_families(keys: Iterable[str]) -> list[str]:
    """Which kinds of DRM usage keys appear: ``memory``, ``cycles``, ``engine-ns``,
    ``capacity``."""
    families: set[str] = set()
    for key in keys:
        if key.startswith("drm-total-cycles-") or key.startswith("drm-cycles-"):
            families.add("cycles")
        elif key.startswith("drm-engine-capacity-"):
            families.add("capacity")
        elif key.startswith("drm-engine-"):
            families.add("engine-ns")
        elif key.startswith(_MEMORY_PREFIXES):
            families.add("memory")
    return sorted(families)


@dataclass
class FdinfoReport:
    """Can DRM fdinfo be read for one device, and what it carries."""

    status: str = "no-clients"
    source: str | None = None
    clients: int = 0
    key_families: list[str] = field(default_factory=list)
    driver: str | None = None
    reason: str | None = None

    @property
    def readable(self) -> bool:
        return self.status == "readable"

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "readable": self.readable,
            "source": self.source,
            "clients": self.clients,
            "key_families": self.key_families,
            "driver": self.driver,
            "reason": self.reason,
        }


def fdinfo_report(
    texts: Sequence[str],
    source: str,
    denied: int,
) -> FdinfoReport:
    """Decide the fdinfo state from the fdinfo texts found for one device.

    ``denied`` counts processes whose descriptors could not be read.
    """
    drm = [parse_fdinfo(t) for t in texts]
    with_driver = [d for d in drm if "drm-driver" in d]
    if with_driver:
        keys: set[str] = set()
        for d in with_driver:
            keys.update(d)
        clients = {d.get("drm-client-id", f"#{i}") for i, d in enumerate(with_driver)}
        if denied and source == "self":
            return FdinfoReport(
                status="unreadable",
                source=source,
                key_families=fdinfo_key_families(keys),
                driver=with_driver[0]["drm-driver"],
                reason=_denied_reason(denied),
            )
        return FdinfoReport(
            status="readable",
            source=source,
            clients=len(clients) if source != "self" else 0,
            key_families=fdinfo_key_families(keys),
            driver=with_driver[0]["drm-driver"],
        )
    if drm:
        return FdinfoReport(
            status="no-drm-keys",
            source=source,
            reason="fdinfo of DRM descriptors has no drm-* keys: the kernel is too old",
        )
    if denied:
        return FdinfoReport(status="unreadable", source=source, reason=_denied_reason(denied))
    return FdinfoReport(status="no-clients", source=source, reason="no process has the card open")


def _denied_reason(denied: int) -> str:
    return (
        f"descriptors of {denied} {'process' if denied == 1 else 'processes'} could not be read: "
        "reading other processes' fdinfo needs root or CAP_SYS_PTRACE"
    )


# ---------------------------------------------------------------------------
# Diagnosis
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    code: str
    device: str | None
    message: str
    fix: str

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "device": self.device, "message": self.message, "fix": self.fix}


def _uc_problem(
    code: str,
    kind: str,
    device: Mapping[str, Any],
    report: Mapping[str, Any],
    firmware_package: str,
) -> Problem:
    bdf = device["bdf"]
    status = report.get("status")
    firmware = report.get("firmware")
    fw_name = firmware if firmware else f"the {kind} firmware file"
    if status is None:
        return Problem(
            code=code,
            device=bdf,
            message=f"{kind} status of {bdf} could not be read: {report.get('reason')}",
            fix="run as root with debugfs mounted (mount -t debugfs none /sys/kernel/debug)",
        )
    subject = f"{kind} firmware {firmware}" if firmware else kind
    message = f"{subject} of {bdf} reports status {status}, not {UC_HEALTHY}"
    if status == "MISSING":
        fix = (
            f"install {fw_name} (package {firmware_package}: dnf install {firmware_package}), "
            "then reboot; the kernel log names the file it looked for (journalctl -k | grep -i "
            f"{kind.lower()})"
        )
    else:
        fix = (
            f"{fw_name} was found but the {kind} did not start: read the kernel log "
            f"(journalctl -k | grep -i {kind.lower()}), update {firmware_package}, then reboot"
        )
    return Problem(code=code, device=bdf, message=message, fix=fix)


def diagnose(
    devices: Sequence[Mapping[str, Any]],
    expected_ids: Sequence[str],
    require_firmware: bool,
    running_kernel: str | None,
    id_knowledge: Mapping[str, Mapping[str, Any]],
    require_fdinfo: bool = True,
    driver: str = DEFAULT_DRIVER,
    firmware_package: str = DEFAULT_FIRMWARE_PACKAGE,
) -> list[Problem]:
    """Every reason the card is not ready for use through ``driver``, with its fix.

    ``devices`` are the dicts ``gather`` returns; ``id_knowledge`` maps a lower-case id
    to ``{"known_to_running_kernel": bool | None, "kernels_knowing_id": [...]}``.
    With ``expected_ids`` only those devices are checked (an integrated GPU on i915
    is then no problem); without, every device found is.
    """
    problems: list[Problem] = []
    wanted = [normalise_device_id(i) for i in expected_ids]
    by_id: dict[str, list[Mapping[str, Any]]] = {}
    for dev in devices:
        by_id.setdefault(dev["device_id"], []).append(dev)

    for ident in wanted:
        if ident in by_id:
            continue
        knows = id_knowledge.get(ident, {})
        kernels = list(knows.get("kernels_knowing_id") or [])
        known_note = (
            f"; installed kernels whose {driver} driver lists it: {', '.join(kernels)}"
            if kernels
            else ""
        )
        problems.append(
            Problem(
                code="no_device",
                device=ident,
                message=f"no PCI device 8086:{ident} found on the bus{known_note}",
                fix=(
                    f"check that the card is seated and passed through to this machine "
                    f"(lspci -nn -d 8086:{ident}), or correct xe_driver_expected_ids"
                ),
            )
        )
    if not wanted and not devices:
        problems.append(
            Problem(
                code="no_device",
                device=None,
                message="no Intel display-class PCI device found",
                fix="check that the card is seated and passed through to this machine (lspci -nn)",
            )
        )

    checked = [d for d in devices if not wanted or d["device_id"] in wanted]
    for dev in checked:
        problems.extend(
            _device_problems(
                dev, require_firmware, require_fdinfo, running_kernel, driver, firmware_package
            )
        )
    return problems


_UC_CHECKS = (("guc_not_running", "GuC", "guc"), ("huc_not_running", "HuC", "huc"))


def _device_problems(
    dev: Mapping[str, Any],
    require_firmware: bool,
    require_fdinfo: bool,
    running_kernel: str | None,
    driver: str,
    firmware_package: str,
) -> list[Problem]:
    bdf = dev["bdf"]
    ident = dev["device_id"]
    alias = dev["alias_id"]
    known = dev.get("known_to_running_kernel")
    kernels = list(dev.get("kernels_knowing_id") or [])
    running = running_kernel or "(unknown)"
    if known is False:
        if kernels:
            return [
                Problem(
                    code="id_unknown_running_known_installed",
                    device=bdf,
                    message=(
                        f"PCI id {alias} of {bdf} is unknown to the {driver} driver of the running "
                        f"kernel {running} but known to installed kernel {kernels[0]}"
                    ),
                    fix=f"reboot into {kernels[0]}, or set kernel_release_allow_reboot: true",
                )
            ]
        return [
            Problem(
                code="id_unknown_everywhere",
                device=bdf,
                message=(
                    f"PCI id {alias} of {bdf} is unknown to the {driver} driver of every "
                    f"installed kernel (running {running})"
                ),
                fix=(
                    "set a newer kernel_release_target (e.g. 10.2) so that a kernel whose "
                    f"{driver} alias table lists {alias} gets installed; {driver}.force_probe "
                    "cannot help an id the kernel does not list"
                ),
            )
        ]

    bound = dev.get("driver")
    force = (
        f"boot with {driver}.force_probe={ident} i915.force_probe=!{ident} "
        f"(grubby --update-kernel=ALL --args='{driver}.force_probe={ident} "
        f"i915.force_probe=!{ident}'); force_probe cannot help an id the kernel does not list"
    )
    if bound is None:
        return [
            Problem(
                code="not_bound",
                device=bdf,
                message=f"{bdf} ({alias}) is not bound to any driver",
                fix=f"load the driver (modprobe {driver}); if it still does not bind, {force}",
            )
        ]
    if bound != driver:
        return [
            Problem(
                code="bound_other_driver",
                device=bdf,
                message=f"{bdf} ({alias}) is bound to {bound}, not {driver}",
                fix=force,
            )
        ]

    problems: list[Problem] = []
    render = dev.get("render_node")
    if not render or not dev.get("render_node_exists"):
        where = dev.get("render_node_path") or "/dev/dri/renderD*"
        problems.append(
            Problem(
                code="no_render_node",
                device=bdf,
                message=(
                    f"{bdf} is bound to {bound} but has no render node"
                    if not render
                    else f"{bdf} is bound to {bound} but {where} is not a DRM character device"
                ),
                fix=(
                    "read the kernel log for the probe error (journalctl -k | grep -i "
                    f"{driver}); udev creates /dev/dri/renderD* when the driver registers"
                ),
            )
        )

    if require_firmware:
        for code, kind, key in _UC_CHECKS:
            report = dev.get(key) or {}
            status = report.get("status")
            if status in (UC_HEALTHY, UC_NOT_SUPPORTED):
                continue
            problems.append(_uc_problem(code, kind, dev, report, firmware_package))

    if require_fdinfo:
        fd = dev.get("fdinfo") or {}
        if fd.get("status") == "unreadable":
            problems.append(
                Problem(
                    code="fdinfo_unreadable",
                    device=bdf,
                    message=f"DRM fdinfo of {bdf} is not readable: {fd.get('reason')}",
                    fix=(
                        "read fdinfo as root (or with CAP_SYS_PTRACE) in the host's PID namespace"
                    ),
                )
            )
        elif fd.get("status") == "no-drm-keys":
            problems.append(
                Problem(
                    code="fdinfo_unreadable",
                    device=bdf,
                    message=(
                        f"DRM fdinfo of {bdf} has no drm-* keys: the running kernel {running} "
                        "does not print DRM usage stats"
                    ),
                    fix="boot a newer kernel (set kernel_release_target)",
                )
            )
    return problems


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
