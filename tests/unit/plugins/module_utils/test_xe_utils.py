"""Pure parts of the xe module_utils: parsers and ``diagnose``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ansible_collections.cardshare.gpuhost.plugins.module_utils._xe_diagnose import (
    Problem,
    diagnose,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._xe_parse import (
    AliasEntry,
    UcStatus,
    aggregate_uc,
    fdinfo_key_families,
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

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "sysfs"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --- sysfs values ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0x8086\n", 0x8086), ("0xe223\n", 0xE223), ("0x030000\n", 0x030000), ("0XE223", 0xE223)],
)
def test_parse_sysfs_hex(text: str, expected: int) -> None:
    assert parse_sysfs_hex(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("8086\n", "vendor: expected a 0x-prefixed hex value, got '8086'"),
        ("0xzz\n", "vendor: expected a 0x-prefixed hex value, got '0xzz'"),
        ("", "vendor: expected a 0x-prefixed hex value, got ''"),
    ],
)
def test_parse_sysfs_hex_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_sysfs_hex(text, "vendor")
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("34359738368\n", 34359738368),
        ("0x800000000\n", 34359738368),
        ("0x0", 0),
        ("25769803776", 24 * 1024**3),
    ],
)
def test_parse_sysfs_size(text: str, expected: int) -> None:
    assert parse_sysfs_size(text) == expected


@pytest.mark.parametrize("text", ["32G", "-1", "0x", "", "1.5"])
def test_parse_sysfs_size_rejects(text: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_sysfs_size(text, "vram")
    assert str(err.value) == (
        f"vram: expected a decimal or 0x-prefixed hex number, got {text.strip()!r}"
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [("e223", "e223"), ("E223", "e223"), ("0xE223", "e223"), (" e20b ", "e20b")],
)
def test_normalise_device_id(value: str, expected: str) -> None:
    assert normalise_device_id(value) == expected


@pytest.mark.parametrize("value", ["8086:e223", "e22", "e2233", "xyzw", ""])
def test_normalise_device_id_rejects(value: str) -> None:
    with pytest.raises(ValueError) as err:
        normalise_device_id(value)
    assert str(err.value) == f"{value!r} is not a 4-digit hex PCI device id (e.g. e223)"


def test_id_forms_and_modalias() -> None:
    assert id_forms(0xE223) == ("e223", "E223")
    assert id_forms(0x56A0) == ("56a0", "56A0")
    assert (
        pci_modalias(0x8086, 0xE223, 0x8086, 0x1114, 0x030000)
        == "pci:v00008086d0000E223sv00008086sd00001114bc03sc00i00"
    )
    assert (
        pci_modalias(0x8086, 0xE20B, 0, 0, 0x038000)
        == "pci:v00008086d0000E20Bsv00000000sd00000000bc03sc80i00"
    )


# --- alias tables ----------------------------------------------------------


def test_parse_modules_alias_keeps_pci_lines_only() -> None:
    entries = parse_modules_alias(fixture("modules.alias.el10_2"))
    assert AliasEntry("pci:v00008086d0000E223sv*sd*bc03sc*i*", "xe") in entries
    assert all(e.pattern.startswith("pci:") for e in entries)
    assert len(entries) == 8
    assert parse_modules_alias("alias pci:v*d* broken extra\n# alias pci:v* x\n") == []


B70 = "pci:v00008086d0000E223sv00008086sd00001114bc03sc00i00"
DG2 = "pci:v00008086d000056A0sv00008086sd00001020bc03sc00i00"
MTL = "pci:v00008086d00007D55sv00000000sd00000000bc03sc00i00"
USB_HOST = "pci:v00008086d0000A0EDsv00001028sd00000A20bc0Csc03i30"


@pytest.mark.parametrize(
    ("table", "modalias", "expected"),
    [
        ("modules.alias.el10_0", B70, []),
        ("modules.alias.el10_2", B70, ["xe"]),
        ("modules.alias.el10_2", DG2, ["i915"]),
        ("modules.alias.el10_2", MTL, ["i915", "xe"]),
        ("modules.alias.el10_2", USB_HOST, ["xhci_pci"]),
        # the class is part of the match: a non-display function of the same id is not xe's
        ("modules.alias.el10_2", B70.replace("bc03sc00", "bc04sc03"), []),
    ],
)
def test_modules_matching(table: str, modalias: str, expected: list[str]) -> None:
    assert modules_matching(parse_modules_alias(fixture(table)), modalias) == expected


@pytest.mark.parametrize(
    ("pattern", "modalias", "matches"),
    [
        ("pci:v00008086d0000E2??sv*sd*bc03sc*i*", B70, True),
        ("pci:v00008086d0000E22[0-3]sv*sd*bc03sc*i*", B70, True),
        ("pci:v00008086d0000E22[4-9]sv*sd*bc03sc*i*", B70, False),
        ("pci:v0000808?d*sv*sd*bc03sc*i*", B70, True),
        # modprobe's fnmatch is case-sensitive and alias tables are upper case
        ("pci:v00008086d0000e223sv*sd*bc03sc*i*", B70, False),
        ("pci:v00001002d*sv*sd*bc03sc*i*", B70, False),
    ],
)
def test_alias_glob_semantics(pattern: str, modalias: str, matches: bool) -> None:
    assert modules_matching([AliasEntry(pattern, "m")], modalias) == (["m"] if matches else [])


# --- GuC / HuC -------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("guc_info.running.txt", UcStatus("xe/bmg_guc_70.bin", "RUNNING")),
        ("guc_info.missing.txt", UcStatus("xe/bmg_guc_70.bin", "MISSING")),
        ("guc_info.load_fail.txt", UcStatus("xe/bmg_guc_70.bin", "LOAD FAIL")),
        ("huc_info.running.txt", UcStatus("xe/bmg_huc.bin", "RUNNING")),
        ("huc_info.not_supported.txt", UcStatus(None, "N/A")),
    ],
)
def test_parse_uc_info_fixtures(name: str, expected: UcStatus) -> None:
    assert parse_uc_info(fixture(name)) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", UcStatus(None, None)),
        ("GuC firmware: xe/bmg_guc_70.bin\n", UcStatus("xe/bmg_guc_70.bin", None)),
        # a status line before the header is not the firmware's status
        (
            "status: ERROR\nGuC firmware: a.bin\n\tstatus: INIT FAIL\n",
            UcStatus("a.bin", "INIT FAIL"),
        ),
        # the simulated tree's layout (lab/SIMULATION.md)
        (
            "GuC firmware: xe/bmg_guc_70.bin\n\tstatus: RUNNING\n"
            "\tversion: wanted 70.44.1, found 70.44.1\n",
            UcStatus("xe/bmg_guc_70.bin", "RUNNING"),
        ),
        ("GuC firmware: x.bin\n\nGuC status 0x8002f0ec:\n", UcStatus("x.bin", None)),
    ],
)
def test_parse_uc_info_text(text: str, expected: UcStatus) -> None:
    assert parse_uc_info(text) == expected


RUN = UcStatus("xe/bmg_huc.bin", "RUNNING")
NA = UcStatus(None, "N/A")
MISS = UcStatus("xe/bmg_huc.bin", "MISSING")


@pytest.mark.parametrize(
    ("per_gt", "status", "gt", "reason"),
    [
        ([], None, None, "nothing"),
        ([("gt0", NA), ("gt1", RUN)], "RUNNING", "gt1", None),
        ([("gt0", RUN), ("gt1", MISS)], "MISSING", "gt1", None),
        ([("gt0", NA), ("gt1", NA)], "N/A", "gt0", "not supported on this device"),
        ([("gt0", UcStatus("a.bin", None))], None, "gt0", "no status line in gt0"),
    ],
)
def test_aggregate_uc(
    per_gt: list[tuple[str, UcStatus]], status: str | None, gt: str | None, reason: str | None
) -> None:
    report = aggregate_uc(per_gt, "nothing")
    assert (report.status, report.gt, report.reason) == (status, gt, reason)
    assert len(report.to_dict()["per_gt"]) == len(per_gt)


# --- fdinfo ----------------------------------------------------------------


def test_parse_fdinfo_xe_sample() -> None:
    info = parse_fdinfo(fixture("fdinfo.xe.txt"))
    assert info["drm-driver"] == "xe"
    assert info["drm-pdev"] == "0000:03:00.0"
    assert info["drm-resident-vram0"] == "23992 KiB"
    assert info["pos"] == "0"


@pytest.mark.parametrize(
    ("name", "families"),
    [
        ("fdinfo.xe.txt", ["capacity", "cycles", "memory"]),
        ("fdinfo.i915.txt", ["engine-ns", "memory"]),
        ("fdinfo.no_drm_keys.txt", []),
    ],
)
def test_fdinfo_key_families(name: str, families: list[str]) -> None:
    assert fdinfo_key_families(parse_fdinfo(fixture(name))) == families


@pytest.mark.parametrize(
    ("texts", "source", "denied", "status", "reason"),
    [
        (["fdinfo.xe.txt"], "clients", 0, "readable", None),
        (["fdinfo.xe.txt"], "clients", 3, "readable", None),
        (
            ["fdinfo.no_drm_keys.txt"],
            "clients",
            0,
            "no-drm-keys",
            "fdinfo of DRM descriptors has no drm-* keys: the kernel is too old",
        ),
        ([], "clients", 0, "no-clients", "no process has the card open"),
        (
            [],
            "clients",
            2,
            "unreadable",
            "descriptors of 2 processes could not be read: reading other processes' fdinfo "
            "needs root or CAP_SYS_PTRACE",
        ),
        (
            ["fdinfo.xe.txt"],
            "self",
            2,
            "unreadable",
            "descriptors of 2 processes could not be read: reading other processes' fdinfo "
            "needs root or CAP_SYS_PTRACE",
        ),
        (["fdinfo.xe.txt"], "self", 0, "readable", None),
    ],
)
def test_fdinfo_report(
    texts: list[str], source: str, denied: int, status: str, reason: str | None
) -> None:
    report = fdinfo_report([fixture(t) for t in texts], source, denied)
    assert (report.status, report.reason) == (status, reason)
    assert report.readable is (status == "readable")


def test_fdinfo_report_counts_clients_once() -> None:
    xe = fixture("fdinfo.xe.txt")
    report = fdinfo_report(
        [xe, xe, xe.replace("drm-client-id:\t3", "drm-client-id:\t4")], "clients", 0
    )
    assert report.clients == 2
    assert report.driver == "xe"


# --- diagnose --------------------------------------------------------------

RUNNING = "6.12.0-55.el10.x86_64"
NEWER = "6.12.0-124.el10.x86_64"
BDF = "0000:03:00.0"


def device(**overrides: Any) -> dict[str, Any]:
    """A healthy B70 as ``gather`` reports it."""
    dev: dict[str, Any] = {
        "bdf": BDF,
        "device_id": "e223",
        "alias_id": "E223",
        "driver": "xe",
        "card": "card0",
        "render_node": "renderD128",
        "render_node_path": "/dev/dri/renderD128",
        "render_node_exists": True,
        "known_to_running_kernel": True,
        "kernels_knowing_id": [RUNNING],
        "guc": {"status": "RUNNING", "firmware": "xe/bmg_guc_70.bin", "reason": None},
        "huc": {"status": "RUNNING", "firmware": "xe/bmg_huc.bin", "reason": None},
        "fdinfo": {"status": "readable", "reason": None},
    }
    dev.update(overrides)
    return dev


FORCE = (
    "boot with xe.force_probe=e223 i915.force_probe=!e223 (grubby --update-kernel=ALL "
    "--args='xe.force_probe=e223 i915.force_probe=!e223'); force_probe cannot help an id the "
    "kernel does not list"
)


@pytest.mark.parametrize(
    ("devices", "knowledge", "expected"),
    [
        pytest.param([device()], {}, [], id="healthy"),
        pytest.param(
            [],
            {"e223": {"known_to_running_kernel": False, "kernels_knowing_id": [NEWER]}},
            [
                Problem(
                    "no_device",
                    "e223",
                    "no PCI device 8086:e223 found on the bus; installed kernels whose xe driver "
                    f"lists it: {NEWER}",
                    "check that the card is seated and passed through to this machine "
                    "(lspci -nn -d 8086:e223), or correct xe_driver_expected_ids",
                )
            ],
            id="no_device",
        ),
        pytest.param(
            [device(known_to_running_kernel=False, kernels_knowing_id=[NEWER], driver=None)],
            {},
            [
                Problem(
                    "id_unknown_running_known_installed",
                    BDF,
                    f"PCI id E223 of {BDF} is unknown to the xe driver of the running kernel "
                    f"{RUNNING} but known to installed kernel {NEWER}",
                    f"reboot into {NEWER}, or set kernel_release_allow_reboot: true",
                )
            ],
            id="id_unknown_running_known_installed",
        ),
        pytest.param(
            [device(known_to_running_kernel=False, kernels_knowing_id=[], driver=None)],
            {},
            [
                Problem(
                    "id_unknown_everywhere",
                    BDF,
                    f"PCI id E223 of {BDF} is unknown to the xe driver of every installed "
                    f"kernel (running {RUNNING})",
                    "set a newer kernel_release_target (e.g. 10.2) so that a kernel whose xe "
                    "alias table lists E223 gets installed; xe.force_probe cannot help an id "
                    "the kernel does not list",
                )
            ],
            id="id_unknown_everywhere",
        ),
        pytest.param(
            [device(driver=None, card=None, render_node=None)],
            {},
            [
                Problem(
                    "not_bound",
                    BDF,
                    f"{BDF} (E223) is not bound to any driver",
                    f"load the driver (modprobe xe); if it still does not bind, {FORCE}",
                )
            ],
            id="not_bound",
        ),
        pytest.param(
            [device(driver="i915")],
            {},
            [Problem("bound_other_driver", BDF, f"{BDF} (E223) is bound to i915, not xe", FORCE)],
            id="bound_other_driver",
        ),
        pytest.param(
            [device(render_node=None, render_node_path=None, render_node_exists=False)],
            {},
            [
                Problem(
                    "no_render_node",
                    BDF,
                    f"{BDF} is bound to xe but has no render node",
                    "read the kernel log for the probe error (journalctl -k | grep -i xe); udev "
                    "creates /dev/dri/renderD* when the driver registers",
                )
            ],
            id="no_render_node",
        ),
        pytest.param(
            [device(render_node_exists=False)],
            {},
            [
                Problem(
                    "no_render_node",
                    BDF,
                    f"{BDF} is bound to xe but /dev/dri/renderD128 is not a DRM character device",
                    "read the kernel log for the probe error (journalctl -k | grep -i xe); udev "
                    "creates /dev/dri/renderD* when the driver registers",
                )
            ],
            id="no_render_node_device_file",
        ),
        pytest.param(
            [device(guc={"status": "MISSING", "firmware": "xe/bmg_guc_70.bin", "reason": None})],
            {},
            [
                Problem(
                    "guc_not_running",
                    BDF,
                    f"GuC firmware xe/bmg_guc_70.bin of {BDF} reports status MISSING, not RUNNING",
                    "install xe/bmg_guc_70.bin (package linux-firmware: dnf install "
                    "linux-firmware), then reboot; the kernel log names the file it looked for "
                    "(journalctl -k | grep -i guc)",
                )
            ],
            id="guc_missing",
        ),
        pytest.param(
            [device(huc={"status": "LOAD FAIL", "firmware": "xe/bmg_huc.bin", "reason": None})],
            {},
            [
                Problem(
                    "huc_not_running",
                    BDF,
                    f"HuC firmware xe/bmg_huc.bin of {BDF} reports status LOAD FAIL, not RUNNING",
                    "xe/bmg_huc.bin was found but the HuC did not start: read the "
                    "kernel log (journalctl -k | grep -i huc), update linux-firmware, then reboot",
                )
            ],
            id="huc_load_fail",
        ),
        pytest.param(
            [device(huc={"status": None, "firmware": None, "reason": "no debugfs at /x"})],
            {},
            [
                Problem(
                    "huc_not_running",
                    BDF,
                    f"HuC status of {BDF} could not be read: no debugfs at /x",
                    "run as root with debugfs mounted (mount -t debugfs none /sys/kernel/debug)",
                )
            ],
            id="huc_unread",
        ),
        pytest.param(
            [device(huc={"status": "N/A", "firmware": None, "reason": "not supported"})],
            {},
            [],
            id="huc_not_supported_is_fine",
        ),
        pytest.param(
            [device(fdinfo={"status": "unreadable", "reason": "denied"})],
            {},
            [
                Problem(
                    "fdinfo_unreadable",
                    BDF,
                    f"DRM fdinfo of {BDF} is not readable: denied",
                    "read fdinfo as root (or with CAP_SYS_PTRACE) in the host's PID namespace",
                )
            ],
            id="fdinfo_unreadable",
        ),
        pytest.param(
            [device(fdinfo={"status": "no-drm-keys", "reason": "old"})],
            {},
            [
                Problem(
                    "fdinfo_unreadable",
                    BDF,
                    f"DRM fdinfo of {BDF} has no drm-* keys: the running kernel {RUNNING} does "
                    "not print DRM usage stats",
                    "boot a newer kernel (set kernel_release_target)",
                )
            ],
            id="fdinfo_no_drm_keys",
        ),
        pytest.param(
            [device(fdinfo={"status": "no-clients", "reason": "none"})], {}, [], id="no_clients"
        ),
        pytest.param(
            [
                device(),
                device(bdf="0000:00:02.0", device_id="56a0", alias_id="56A0", driver="i915"),
            ],
            {},
            [],
            id="other_intel_gpu_not_expected",
        ),
    ],
)
def test_diagnose(
    devices: list[dict[str, Any]], knowledge: dict[str, Any], expected: list[Problem]
) -> None:
    assert diagnose(devices, ["E223"], True, RUNNING, knowledge) == expected


def test_diagnose_without_expected_ids_checks_every_device() -> None:
    igpu = device(bdf="0000:00:02.0", device_id="56a0", alias_id="56A0", driver="i915")
    problems = diagnose([device(), igpu], [], True, RUNNING, {})
    assert [(p.code, p.device) for p in problems] == [("bound_other_driver", "0000:00:02.0")]
    assert diagnose([], [], True, RUNNING, {}) == [
        Problem(
            "no_device",
            None,
            "no Intel display-class PCI device found",
            "check that the card is seated and passed through to this machine (lspci -nn)",
        )
    ]


def test_diagnose_switches() -> None:
    bad = device(
        guc={"status": "ERROR", "firmware": None, "reason": None},
        fdinfo={"status": "unreadable", "reason": "denied"},
    )
    assert diagnose([bad], ["e223"], False, RUNNING, {}, require_fdinfo=False) == []
    problems = diagnose([bad], ["e223"], True, RUNNING, {}, firmware_package="intel-gpu-firmware")
    assert [p.code for p in problems] == ["guc_not_running", "fdinfo_unreadable"]
    assert problems[0].message == f"GuC of {BDF} reports status ERROR, not RUNNING"
    assert problems[0].fix == (
        "the GuC firmware file was found but the GuC did not start: read the kernel log "
        "(journalctl -k | grep -i guc), update intel-gpu-firmware, then reboot"
    )
    assert problems[0].to_dict()["code"] == "guc_not_running"


def test_diagnose_rejects_bad_expected_id() -> None:
    with pytest.raises(ValueError) as err:
        diagnose([], ["8086:e223"], True, RUNNING, {})
    assert str(err.value) == "'8086:e223' is not a 4-digit hex PCI device id (e.g. e223)"
