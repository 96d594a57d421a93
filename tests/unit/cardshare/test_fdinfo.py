"""Tests of cardshare.fdinfo: sizes, the kernel's xe example, i915, malformed input."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cardshare.fdinfo import (
    REGION_TABLE,
    EngineUsage,
    RegionMemory,
    parse_fdinfo,
    parse_size,
    parse_uint,
    region_class,
)

KIB = 1024
MIB = 1024**2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4097", 4097),
        ("192 KiB", 192 * KIB),
        ("16 MiB", 16 * MIB),
        ("23992 KiB", 23992 * KIB),
        ("2 GiB", 2 * 1024**3),
        ("\t7 KiB \n", 7 * KIB),
        ("5\tMiB", 5 * MIB),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not a size: ''"),
        ("-1", "not a size: '-1'"),
        ("1.5 MiB", "not a size: '1.5 MiB'"),
        ("KiB", "not a size: 'KiB'"),
        ("12 kB", "unknown size unit 'kB' in '12 kB'"),
        ("3 TiB", "unknown size unit 'TiB' in '3 TiB'"),
        ("1 KiB 2", "not a size: '1 KiB 2'"),
        # what int() would take and the kernel never prints
        ("\u0661\u0662", "not a size: '\u0661\u0662'"),
        ("1_000", "not a size: '1_000'"),
        ("+5 KiB", "not a size: '+5 KiB'"),
    ],
)
def test_parse_size_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("text", "expected"), [("0", 0), ("9288864723 ns", 9288864723), ("28257900", 28257900)]
)
def test_parse_uint(text: str, expected: int) -> None:
    assert parse_uint(text) == expected


@pytest.mark.parametrize("text", ["12 ms", "\u0661\u0662", "1_000", "+3", "0x10", ""])
def test_parse_uint_rejects(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_uint(text)
    assert str(info.value) == f"not an unsigned integer: {text!r}"


def kernel_format(n: int) -> str:
    """The kernel's size printing: divide by 1024 while non-zero and aligned, up to MiB."""
    units = ["", " KiB", " MiB"]
    i = 0
    while i < len(units) - 1 and n != 0 and n % 1024 == 0:
        n //= 1024
        i += 1
    return f"{n}{units[i]}"


@given(st.integers(min_value=0, max_value=2**64))
def test_parse_size_reads_what_the_kernel_prints(n: int) -> None:
    assert parse_size(kernel_format(n)) == n


@given(
    st.integers(min_value=0, max_value=2**48),
    st.sampled_from([("", 1), ("KiB", KIB), ("MiB", MIB), ("GiB", 1024**3)]),
    st.sampled_from([" ", "\t", "  "]),
)
def test_parse_size_units(n: int, unit: tuple[str, int], gap: str) -> None:
    text = f"{n}{gap}{unit[0]}" if unit[0] else str(n)
    assert parse_size(text) == n * unit[1]


@given(st.text(alphabet="0123456789 KMGiBbnsx.-", max_size=12))
def test_parse_size_never_raises_anything_but_value_error(text: str) -> None:
    try:
        value = parse_size(text)
    except ValueError:
        return
    assert value >= 0


def test_xe_documentation_sample(rec_fixtures: Path) -> None:
    info = parse_fdinfo((rec_fixtures / "fdinfo" / "xe-doc.txt").read_text())
    assert (info.driver, info.client_id, info.pdev) == ("xe", 3, "0000:03:00.0")
    assert info.malformed == 0
    assert info.memory["gtt"] == RegionMemory(
        total=192 * KIB, shared=0, resident=192 * KIB, active=0, purgeable=None
    )
    assert info.memory["vram0"] == RegionMemory(
        total=23992 * KIB, shared=16 * MIB, resident=23992 * KIB, active=0, purgeable=0
    )
    assert info.engines["rcs"] == EngineUsage(
        cycles=28257900, total_cycles=7655183225, busy_ns=None, capacity=1
    )
    assert info.engines["vcs"].capacity == 2
    assert info.engines["vecs"].capacity == 2
    assert info.engines["ccs"].capacity == 4
    assert sorted(info.engines) == ["bcs", "ccs", "rcs", "vcs", "vecs"]
    assert sorted(info.memory) == ["gtt", "stolen", "system", "vram0"]
    assert info.vram_bytes == 23992 * KIB
    assert info.gtt_bytes == 192 * KIB
    assert info.system_bytes == 0
    assert info.other == {"pos": "0", "flags": "0100002", "mnt_id": "26", "ino": "685"}
    assert info.is_drm_client


def test_i915_sample(rec_fixtures: Path) -> None:
    info = parse_fdinfo((rec_fixtures / "fdinfo" / "i915-dg2.txt").read_text())
    assert (info.driver, info.client_id, info.pdev) == ("i915", 7, "0000:03:00.0")
    assert info.malformed == 0
    assert info.engines["render"] == EngineUsage(busy_ns=9288864723)
    assert info.engines["video"] == EngineUsage(busy_ns=0, capacity=2)
    assert info.engines["video-enhance"] == EngineUsage(busy_ns=0)
    assert info.engines["compute"].capacity == 4
    assert sorted(info.memory) == ["local0", "stolen-local", "system"]
    assert info.vram_bytes == 512 * MIB
    assert info.system_bytes == 8396 * KIB


@pytest.mark.parametrize(
    ("text", "malformed", "other"),
    [
        ("no colon here\n", 1, {}),
        ("drm key: 1\n", 1, {}),
        (":value\n", 1, {}),
        ("drm-total-vram0: 12 furlongs\n", 1, {}),
        ("drm-cycles-rcs: abc\n", 1, {}),
        ("drm-client-id: x\n", 1, {}),
        ("drm-driver:\n", 1, {}),
        ("drm-maxfreq-rcs: 2400 MHz\n", 0, {"drm-maxfreq-rcs": "2400 MHz"}),
        ("amdxdna-custom:  7\n", 0, {"amdxdna-custom": "7"}),
        ("\n\n   \n", 0, {}),
        ("drm-total-: 5\n", 0, {"drm-total-": "5"}),
    ],
)
def test_malformed_and_unknown_lines(text: str, malformed: int, other: dict[str, str]) -> None:
    info = parse_fdinfo("drm-driver: xe\n" + text if "drm-driver" not in text else text)
    assert info.malformed == malformed
    assert info.other == other


@pytest.mark.parametrize(
    ("lines", "resident"),
    [
        (["drm-memory-vram: 10 KiB"], 10 * KIB),
        (["drm-memory-vram: 10 KiB", "drm-resident-vram: 4 KiB"], 4 * KIB),
        (["drm-resident-vram: 4 KiB", "drm-memory-vram: 10 KiB"], 4 * KIB),
        (["drm-total-vram: 4 KiB"], None),
    ],
)
def test_old_memory_key_is_resident(lines: list[str], resident: int | None) -> None:
    info = parse_fdinfo("\n".join(["drm-driver: amdgpu", "drm-client-id: 1", *lines]))
    assert info.memory["vram"].resident == resident


@pytest.mark.parametrize(
    ("text", "vram"),
    [
        ("drm-resident-vram0: 1 MiB\ndrm-resident-vram1: 2 MiB\n", 3 * MIB),
        ("drm-resident-local0: 1 MiB\ndrm-resident-local1: 1 KiB\n", MIB + KIB),
        ("drm-total-vram0: 1 MiB\n", 0),
        ("drm-resident-system: 1 MiB\n", 0),
        ("", 0),
    ],
)
def test_vram_sums_device_regions(text: str, vram: int) -> None:
    assert parse_fdinfo(text).vram_bytes == vram


@pytest.mark.parametrize(
    ("text", "is_client"),
    [
        ("drm-driver: xe\ndrm-client-id: 4\n", True),
        ("drm-driver: xe\n", False),
        ("drm-client-id: 4\n", False),
        ("pos: 0\nflags: 02\n", False),
    ],
)
def test_is_drm_client(text: str, is_client: bool) -> None:
    assert parse_fdinfo(text).is_drm_client is is_client


def test_capacity_below_one_counts_as_one() -> None:
    info = parse_fdinfo("drm-cycles-ccs: 5\ndrm-engine-capacity-ccs: 0\n")
    assert info.engines["ccs"].capacity == 1


# -- memory regions by driver (issue 9, item 4) ---------------------------------------------


@pytest.mark.parametrize(
    ("driver", "region", "cls"),
    [
        # xe: xe_drm_client.c mem_type_to_name[]
        ("xe", "system", "system"),
        ("xe", "gtt", "gtt"),
        ("xe", "vram0", "vram"),
        ("xe", "vram1", "vram"),
        ("xe", "stolen", "stolen"),
        # i915: intel_memory_region.c uabi_name "%s%u"
        ("i915", "system0", "system"),
        ("i915", "local0", "vram"),
        ("i915", "local1", "vram"),
        ("i915", "stolen-system0", "stolen"),
        ("i915", "stolen-local0", "stolen"),
        # amdgpu: amdgpu_fdinfo.c pl_name[]
        ("amdgpu", "vram", "vram"),
        ("amdgpu", "gtt", "gtt"),
        ("amdgpu", "cpu", "system"),
        ("amdgpu", "gds", "other"),
        ("amdgpu", "gws", "other"),
        ("amdgpu", "oa", "other"),
        ("amdgpu", "doorbell", "other"),
        ("amdgpu", "mmioremap", "other"),
        # drm-usage-stats.rst: "memory" is reserved for system memory, any driver
        ("amdxdna", "memory", "system"),
        (None, "memory", "system"),
        # fallbacks and near misses
        ("xe", "vram", "vram"),
        ("i915", "system", "system"),
        ("i915", "stolen-local", "stolen"),
        ("xe", "cpu", "other"),  # "cpu" is amdgpu's name only
        ("xe", "vram0x", "other"),
        ("i915", "localfoo", "other"),
        ("xe", "", "other"),
    ],
)
def test_region_class(driver: str | None, region: str, cls: str) -> None:
    assert region_class(driver, region) == cls


def test_region_table_has_every_driver_and_class() -> None:
    drivers = {d for d, _, _ in REGION_TABLE}
    assert {"xe", "i915", "amdgpu", "*"} <= drivers
    assert {c for _, _, c in REGION_TABLE} == {"vram", "system", "gtt", "stolen", "other"}


@pytest.mark.parametrize(
    ("fixture", "driver", "vram", "vram_shared", "system", "gtt", "stolen"),
    [
        ("xe-doc.txt", "xe", 23992 * KIB, 16 * MIB, 0, 192 * KIB, 0),
        ("i915-dg2-regions.txt", "i915", 512 * MIB, 64 * MIB, 8396 * KIB, 0, 0),
        ("amdgpu-format.txt", "amdgpu", 1612 * MIB, 8 * MIB, 4 * MIB, 18 * MIB, 0),
        ("amdgpu-legacy.txt", "amdgpu", 256 * MIB, 0, 512 * KIB, 2 * MIB, 0),
    ],
)
def test_memory_by_driver_from_real_formats(
    rec_fixtures: Path,
    fixture: str,
    driver: str,
    vram: int,
    vram_shared: int,
    system: int,
    gtt: int,
    stolen: int,
) -> None:
    info = parse_fdinfo((rec_fixtures / "fdinfo" / fixture).read_text())
    assert info.driver == driver
    assert info.malformed == 0
    assert (
        info.vram_bytes,
        info.vram_shared_bytes,
        info.system_bytes,
        info.gtt_bytes,
        info.stolen_bytes,
    ) == (vram, vram_shared, system, gtt, stolen)


def test_amdgpu_private_resources_are_not_memory(rec_fixtures: Path) -> None:
    info = parse_fdinfo((rec_fixtures / "fdinfo" / "amdgpu-format.txt").read_text())
    assert info.resident_bytes("doorbell") == 8 * KIB
    assert info.system_bytes + info.gtt_bytes + info.vram_bytes == 1612 * MIB + 22 * MIB
    assert info.engines["compute"] == EngineUsage(busy_ns=1028374600)
    assert info.other["amd-requested-vram"] == "1650688 KiB"


@pytest.mark.parametrize(
    ("text", "shared"),
    [
        ("drm-resident-vram0: 4 MiB\ndrm-shared-vram0: 1 MiB\n", MIB),
        ("drm-resident-vram0: 1 MiB\ndrm-shared-vram0: 4 MiB\n", MIB),  # not all resident
        ("drm-shared-vram0: 4 MiB\n", 0),
        ("drm-resident-gtt: 4 MiB\ndrm-shared-gtt: 4 MiB\n", 0),
    ],
)
def test_vram_shared_is_capped_by_resident(text: str, shared: int) -> None:
    assert parse_fdinfo("drm-driver: xe\n" + text).vram_shared_bytes == shared
