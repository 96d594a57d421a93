"""Parse DRM fdinfo (``/proc/<pid>/fdinfo/<fd>``) as the kernel documents it.

Format (kernel ``Documentation/gpu/drm-usage-stats.rst``): one ``key:<whitespace>value`` pair
per line.  Standard keys start with ``drm-``; other lines (``pos:``, ``flags:``, ``mnt_id:``,
``ino:``, driver-specific ``<driver>-*`` keys) are kept verbatim in :attr:`FdInfo.other`.

Keys understood here:

* ``drm-driver``, ``drm-client-id``, ``drm-pdev`` (strings; the client id is a uint);
* memory per region ``drm-{total,shared,resident,active,purgeable}-<region>`` and the old
  ``drm-memory-<region>`` (taken as resident when no ``drm-resident-<region>`` is printed):
  bytes with an optional ``KiB``/``MiB`` (``GiB`` accepted too);
* xe engine utilisation: ``drm-cycles-<class>``, ``drm-total-cycles-<class>``;
* i915 (and other drivers') engine time: ``drm-engine-<class>`` in nanoseconds (``ns``);
* ``drm-engine-capacity-<class>`` (only printed when above 1; defaults to 1).

Malformed lines (no colon, a key with whitespace, a bad number or unit for a known numeric key)
are skipped and counted in :attr:`FdInfo.malformed`.  Nothing here raises on bad input except
:func:`parse_size`, which is the strict building block.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "MEMORY_KINDS",
    "REGION_TABLE",
    "EngineUsage",
    "FdInfo",
    "RegionClass",
    "RegionMemory",
    "is_gtt_region",
    "is_system_region",
    "is_vram_region",
    "parse_fdinfo",
    "parse_size",
    "parse_uint",
    "region_class",
]

MEMORY_KINDS = ("total", "shared", "resident", "active", "purgeable")

RegionClass = Literal["vram", "system", "gtt", "stolen", "other"]

_UNITS = {"": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
_SIZE_RE = re.compile(r"^([0-9]+)(?:[ \t]+([A-Za-z]+))?$")
_NS_RE = re.compile(r"^([0-9]+)(?:[ \t]+ns)?$")
_KEY_RE = re.compile(r"^[^\s:]+$")


def parse_size(text: str) -> int:
    """Return the byte count of a fdinfo size such as ``4097``, ``192 KiB`` or ``16 MiB``.

    Raises ``ValueError`` naming the offending text when it is not a size.
    """
    plain = text.strip()
    if plain.isascii():  # the forms the kernel prints, without the regular expression
        if plain.isdigit():
            return int(plain)
        number, _, unit = plain.partition(" ")
        if number.isdigit() and unit in _UNITS and unit:
            return int(number) * _UNITS[unit]
    match = _SIZE_RE.match(plain)
    if match is None:
        raise ValueError(f"not a size: {text!r}")
    unit = match.group(2) or ""
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit {unit!r} in {text!r}")
    return int(match.group(1)) * _UNITS[unit]


def parse_uint(text: str) -> int:
    """Return an unsigned integer, with an optional ``ns`` unit (engine time)."""
    plain = text.strip()
    if plain.isascii() and plain.isdigit():
        return int(plain)
    match = _NS_RE.match(plain)
    if match is None:
        raise ValueError(f"not an unsigned integer: {text!r}")
    return int(match.group(1))


@dataclass(frozen=True, slots=True)
class RegionMemory:
    """Memory of one client in one region, in bytes; ``None`` when the driver did not print it."""

    total: int | None = None
    shared: int | None = None
    resident: int | None = None
    active: int | None = None
    purgeable: int | None = None


@dataclass(frozen=True, slots=True)
class EngineUsage:
    """Counters of one engine class for one client.

    xe prints ``cycles``/``total_cycles``; i915 prints ``busy_ns``.  ``capacity`` is the number
    of engines of the class (1 when not printed).
    """

    cycles: int | None = None
    total_cycles: int | None = None
    busy_ns: int | None = None
    capacity: int = 1


# What each driver's memory regions are, in ONE table: (driver, full-match pattern, class).
# Classes: ``vram`` (device-local memory), ``system`` (host RAM the GPU does not map through a
# GTT/GART), ``gtt`` (host RAM mapped for the GPU), ``stolen`` (memory the firmware reserved for
# the GPU; xe's ``stolen`` is carved from VRAM on discrete parts, from RAM on integrated ones, so
# it is counted in neither), ``other`` (driver-private resources, never memory a user asked for).
# Rows of the driver come first; the ``*`` rows are the fallback for every driver (and unknown
# drivers).  Sources:
#   xe     drivers/gpu/drm/xe/xe_drm_client.c, mem_type_to_name[]: system, gtt, vram0, vram1, stolen
#   i915   drivers/gpu/drm/i915/intel_memory_region.c: uabi_name "%s%u" of system, local,
#          stolen-system, stolen-local (system0, local0, stolen-system0, stolen-local0), printed by
#          i915_drm_client.c show_meminfo()
#   amdgpu drivers/gpu/drm/amd/amdgpu/amdgpu_fdinfo.c, pl_name[]: vram, gtt, cpu (TTM_PL_SYSTEM),
#          gds, gws, oa, doorbell, mmioremap (on-chip or MMIO resources)
#   *      Documentation/gpu/drm-usage-stats.rst: the region name "memory" is reserved for system
#          memory; the generic names of the drivers above as a fallback.
REGION_TABLE: tuple[tuple[str, str, RegionClass], ...] = (
    ("xe", r"vram[0-9]+", "vram"),
    ("xe", r"system", "system"),
    ("xe", r"gtt", "gtt"),
    ("xe", r"stolen", "stolen"),
    ("i915", r"local[0-9]+", "vram"),
    ("i915", r"system[0-9]+", "system"),
    ("i915", r"stolen-(?:system|local)[0-9]+", "stolen"),
    ("amdgpu", r"vram", "vram"),
    ("amdgpu", r"gtt", "gtt"),
    ("amdgpu", r"cpu", "system"),
    ("amdgpu", r"gds|gws|oa|doorbell|mmioremap", "other"),
    ("*", r"memory", "system"),
    ("*", r"system[0-9]*", "system"),
    ("*", r"(?:vram|local)[0-9]*", "vram"),
    ("*", r"gtt", "gtt"),
    ("*", r"stolen(?:-[a-z]+)?[0-9]*", "stolen"),
)

_COMPILED_TABLE: dict[str, tuple[tuple[re.Pattern[str], RegionClass], ...]] = {}
for _driver, _pattern, _cls in REGION_TABLE:
    _COMPILED_TABLE[_driver] = (*_COMPILED_TABLE.get(_driver, ()), (re.compile(_pattern), _cls))


@functools.lru_cache(maxsize=1024)
def region_class(driver: str | None, region: str) -> RegionClass:
    """The class of a memory region of a driver (see :data:`REGION_TABLE`); ``other`` if unknown."""
    for rows in (_COMPILED_TABLE.get(driver or "*", ()), _COMPILED_TABLE["*"]):
        for pattern, cls in rows:
            if pattern.fullmatch(region):
                return cls
    return "other"


def is_vram_region(region: str, driver: str | None = None) -> bool:
    """Device-local memory: xe ``vram<N>``, i915 ``local<N>``, amdgpu ``vram``."""
    return region_class(driver, region) == "vram"


def is_system_region(region: str, driver: str | None = None) -> bool:
    """Host memory not mapped through a GTT: xe ``system``, i915 ``system<N>``, amdgpu ``cpu``,
    the reserved generic name ``memory``."""
    return region_class(driver, region) == "system"


def is_gtt_region(region: str, driver: str | None = None) -> bool:
    """Host memory mapped for the GPU (xe ``gtt``, amdgpu ``gtt``)."""
    return region_class(driver, region) == "gtt"


@dataclass(frozen=True, slots=True)
class FdInfo:
    """One parsed fdinfo file."""

    driver: str | None = None
    client_id: int | None = None
    pdev: str | None = None
    memory: dict[str, RegionMemory] = field(default_factory=dict)
    engines: dict[str, EngineUsage] = field(default_factory=dict)
    other: dict[str, str] = field(default_factory=dict)
    malformed: int = 0

    @property
    def is_drm_client(self) -> bool:
        """True when the file describes a DRM client (driver and client id present)."""
        return self.driver is not None and self.client_id is not None

    def resident_bytes(self, region: str) -> int:
        """Resident bytes of a region (0 when absent)."""
        mem = self.memory.get(region)
        if mem is None or mem.resident is None:
            return 0
        return mem.resident

    def shared_resident_bytes(self, region: str) -> int:
        """Resident bytes of a region that are shared with another DRM file (0 when absent).

        ``drm-shared-<r>`` counts shared buffers whether resident or not, so it is capped by the
        resident figure.
        """
        mem = self.memory.get(region)
        if mem is None or not mem.shared:
            return 0
        return min(mem.shared, self.resident_bytes(region))

    def _sum(self, cls: RegionClass) -> int:
        return sum(
            self.resident_bytes(r) for r in self.memory if region_class(self.driver, r) == cls
        )

    @property
    def vram_bytes(self) -> int:
        """Resident device memory over all VRAM regions (xe ``vram*``, i915 ``local*``, amdgpu
        ``vram``), shared buffers included."""
        return self._sum("vram")

    @property
    def vram_shared_bytes(self) -> int:
        """The part of :attr:`vram_bytes` in buffers shared with another DRM file."""
        return sum(
            self.shared_resident_bytes(r)
            for r in self.memory
            if region_class(self.driver, r) == "vram"
        )

    @property
    def system_bytes(self) -> int:
        """Resident host memory not mapped through a GTT (xe ``system``, i915 ``system0``,
        amdgpu ``cpu``, generic ``memory``).  i915 has no GTT region: its ``system0`` holds all
        of the client's host memory."""
        return self._sum("system")

    @property
    def gtt_bytes(self) -> int:
        """Resident host memory mapped for the GPU (xe and amdgpu ``gtt``)."""
        return self._sum("gtt")

    @property
    def stolen_bytes(self) -> int:
        """Resident firmware-reserved memory (xe ``stolen``, i915 ``stolen-*``)."""
        return self._sum("stolen")


# The order matters: ``drm-total-cycles-`` must win over ``drm-total-`` (a memory key) and
# ``drm-engine-capacity-`` over ``drm-engine-``.
_ENGINE_PREFIXES = (
    ("drm-total-cycles-", "total_cycles"),
    ("drm-cycles-", "cycles"),
    ("drm-engine-capacity-", "capacity"),
    ("drm-engine-", "busy_ns"),
)
_MEMORY_KEY_KINDS = frozenset((*MEMORY_KINDS, "memory"))


# What a key is, worked out once per distinct key (drivers print the same keys in every file):
# ("driver"|"client-id"|"pdev"|"other", "", ""), ("engine", class, attribute) or
# ("memory", region, kind); None for a key that is not one (empty, whitespace inside).
_Role = tuple[str, str, str]


@functools.lru_cache(maxsize=1024)
def _key_role(key: str) -> _Role | None:
    if not key or _KEY_RE.match(key) is None:
        return None
    if key in ("drm-driver", "drm-client-id", "drm-pdev"):
        return key[4:], "", ""
    if key.startswith("drm-"):
        for prefix, attr in _ENGINE_PREFIXES:
            if key.startswith(prefix) and len(key) > len(prefix):
                return "engine", key[len(prefix) :], attr
        kind, _, region = key[4:].partition("-")
        if region and kind in _MEMORY_KEY_KINDS:
            return "memory", region, kind
    return "other", "", ""


def parse_fdinfo(text: str) -> FdInfo:
    """Parse the text of one fdinfo file (any driver)."""
    driver: str | None = None
    client_id: int | None = None
    pdev: str | None = None
    mem: dict[str, dict[str, int]] = {}
    eng: dict[str, dict[str, int]] = {}
    other: dict[str, str] = {}
    malformed = 0
    for raw in text.splitlines():
        key, sep, value = raw.partition(":")
        if not sep:
            if raw.strip():  # a line without a colon; blank lines are skipped
                malformed += 1
            continue
        key = key.strip()
        role = _key_role(key)
        if role is None:
            malformed += 1
            continue
        what, name, attr = role
        value = value.strip()
        try:
            if what == "memory":
                mem.setdefault(name, {})[attr] = parse_size(value)
            elif what == "engine":
                eng.setdefault(name, {})[attr] = parse_uint(value)
            elif what == "other":
                other[key] = value
            elif what == "client-id":
                client_id = parse_uint(value)
            elif not value:
                raise ValueError(f"empty {what}")
            elif what == "driver":
                driver = value
            else:
                pdev = value
        except ValueError:
            malformed += 1
    memory = {
        region: RegionMemory(
            total=kinds.get("total"),
            shared=kinds.get("shared"),
            resident=kinds.get("resident", kinds.get("memory")),
            active=kinds.get("active"),
            purgeable=kinds.get("purgeable"),
        )
        for region, kinds in mem.items()
    }
    engines = {
        cls: EngineUsage(
            cycles=c.get("cycles"),
            total_cycles=c.get("total_cycles"),
            busy_ns=c.get("busy_ns"),
            capacity=max(1, c.get("capacity", 1)),
        )
        for cls, c in eng.items()
    }
    return FdInfo(
        driver=driver,
        client_id=client_id,
        pdev=pdev,
        memory=memory,
        engines=engines,
        other=other,
        malformed=malformed,
    )
