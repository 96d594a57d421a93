# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the host's files say about its Intel GPUs and the xe driver: pure parsers of sysfs
values, ``guc_info``/``huc_info`` text, module alias lines and fdinfo keys, tested with
tables (the readers are in ``_xe_gather``, the decisions in ``_xe_diagnose``).

Formats: sysfs ``vendor``/``device``/``class`` print ``0x%04x``/``0x%06x``;
``modalias`` is ``pci:v%08Xd%08Xsv%08Xsd%08Xbc%02Xsc%02Xi%02X`` (kernel
``drivers/pci/pci-sysfs.c``); ``modules.alias`` lines are ``alias <glob> <module>``
(depmod), matched with fnmatch semantics as modprobe does; the uC info text is
``<type> firmware: <path>`` then ``\\tstatus: <STATE>`` (xe ``xe_uc_fw_print``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DRM_MAJOR",
    "AliasEntry",
    "FdinfoReport",
    "UcReport",
    "UcStatus",
    "aggregate_uc",
    "fdinfo_key_families",
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
