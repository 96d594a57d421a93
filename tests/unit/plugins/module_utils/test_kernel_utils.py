"""Pure kernel facts: rpm query parsing, Secure Boot bytes, trust and reboot decisions."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.cardshare.gpuhost.plugins.module_utils._kernel import (
    SECURE_BOOT_VAR,
    InstalledKernel,
    SecureBoot,
    dedupe_kernels,
    kernel_facts,
    parse_rpm_query,
    parse_secure_boot,
    secure_boot_problems,
    untrusted_kernels,
)

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "sysfs"
RH = "Red Hat, Inc."
RH_SIG = "RSA/SHA256, Tue 06 May 2025 10:12:44 AM UTC, Key ID 199e2f91fd431d51"


def k(
    release: str, name: str = "kernel-core", vendor: str | None = RH, version: str = "6.12.0"
) -> InstalledKernel:
    return InstalledKernel(name, 0, version, release, "x86_64", vendor, RH_SIG if vendor else None)


EL10_0 = k("55.el10")
EL10_2 = k("124.el10")
ML = k("1.el10.elrepo", name="kernel-ml", vendor="The ELRepo Project", version="6.17.8")
ML_CORE = k("1.el10.elrepo", name="kernel-ml-core", vendor="The ELRepo Project", version="6.17.8")
NO_VENDOR = k("1.local", name="kernel-core", vendor=None, version="6.18.0")


def test_parse_rpm_query_fixture() -> None:
    kernels, missing = parse_rpm_query((FIXTURES / "rpm_query.txt").read_text())
    assert missing == ["kernel-ml-core"]
    assert [x.uname for x in kernels] == [
        "6.12.0-55.el10.x86_64",
        "6.12.0-124.el10.x86_64",
        "6.17.8-1.el10.elrepo.x86_64",
    ]
    assert kernels[0].key_id == "199e2f91fd431d51"
    assert kernels[2].vendor == "The ELRepo Project"
    assert kernels[2].signature is None
    assert kernels[2].key_id is None
    assert kernels[1].to_dict() == {
        "name": "kernel-core",
        "epoch": 0,
        "version": "6.12.0",
        "release": "124.el10",
        "arch": "x86_64",
        "vendor": RH,
        "signature": "RSA/SHA256, Wed 12 Nov 2025 09:01:02 AM UTC, Key ID 199e2f91fd431d51",
        "key_id": "199e2f91fd431d51",
        "uname": "6.12.0-124.el10.x86_64",
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "kernel-core\t0\t6.12.0\t55.el10\tx86_64\n",
            "rpm query line 1: expected 7 tab-separated fields, got 5: "
            "'kernel-core\\t0\\t6.12.0\\t55.el10\\tx86_64'",
        ),
        (
            "\nkernel-core\t(none)\t6.12.0\t55.el10\tx86_64\tRed Hat, Inc.\t(none)\n",
            "rpm query line 2: epoch is not a number: '(none)'",
        ),
        (
            "kernel-core\t0\t\t55.el10\tx86_64\tRed Hat, Inc.\t(none)\n",
            "rpm query line 1: empty name, version, release or arch",
        ),
        (
            "error: rpmdb open failed\n",
            "rpm query line 1: expected 7 tab-separated fields, got 1: 'error: rpmdb open failed'",
        ),
    ],
)
def test_parse_rpm_query_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_rpm_query(text)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("text", "vendor", "signature"),
    [
        ("kernel-core\t0\t6.12.0\t1\tx86_64\t(none)\t(none)", None, None),
        ("kernel-core\t0\t6.12.0\t1\tx86_64\t\t", None, None),
        (
            "kernel-core\t0\t6.12.0\t1\tx86_64\tRed Hat, Inc.\tRSA/SHA256, x, Key ID AB12",
            RH,
            "RSA/SHA256, x, Key ID AB12",
        ),
    ],
)
def test_parse_rpm_query_unset_tags(text: str, vendor: str | None, signature: str | None) -> None:
    kernels, missing = parse_rpm_query(text)
    assert missing == []
    assert (kernels[0].vendor, kernels[0].signature) == (vendor, signature)


def test_key_id_lower_case() -> None:
    kernels, _ = parse_rpm_query("kernel-core\t0\t6.12.0\t1\tx86_64\tv\tRSA/SHA256, x, Key ID AB12")
    assert kernels[0].key_id == "ab12"


@pytest.mark.parametrize(
    ("data", "efivars", "expected"),
    [
        (b"\x06\x00\x00\x00\x01", True, SecureBoot(True, True, "Secure Boot enabled")),
        (b"\x06\x00\x00\x00\x00", True, SecureBoot(False, True, "Secure Boot disabled")),
        (b"\x16\x00\x00\x00\x01", True, SecureBoot(True, True, "Secure Boot enabled")),
        (
            None,
            True,
            SecureBoot(False, True, "EFI boot without a SecureBoot variable: Secure Boot disabled"),
        ),
        (
            None,
            False,
            SecureBoot(
                False,
                False,
                "no efivars: legacy BIOS boot, Secure Boot is not available (disabled)",
            ),
        ),
    ],
)
def test_parse_secure_boot(data: bytes | None, efivars: bool, expected: SecureBoot) -> None:
    assert parse_secure_boot(data, efivars) == expected


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            b"\x06\x00\x00\x00",
            f"{SECURE_BOOT_VAR}: expected 4 attribute bytes and 1 data byte, got 4 bytes",
        ),
        (b"", f"{SECURE_BOOT_VAR}: expected 4 attribute bytes and 1 data byte, got 0 bytes"),
        (b"\x06\x00\x00\x00\x02", f"{SECURE_BOOT_VAR}: unexpected data byte 0x02"),
    ],
)
def test_parse_secure_boot_rejects(data: bytes, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_secure_boot(data, True)
    assert str(err.value) == message


ML_MESSAGE = (
    "the newest installed kernel kernel-ml 6.17.8-1.el10.elrepo.x86_64 (vendor: The ELRepo "
    "Project) is not signed by the distribution vendor; under Secure Boot the firmware rejects "
    "it before userspace (a self-enrolled MOK did not help either); remove it or boot a vendor "
    "kernel"
)


@pytest.mark.parametrize(
    ("enabled", "kernels", "expected"),
    [
        (True, [EL10_0, ML], [ML_MESSAGE]),
        (False, [EL10_0, ML], []),
        (True, [EL10_0, EL10_2], []),
        (True, [], []),
        (
            True,
            [EL10_2, NO_VENDOR],
            [
                "the newest installed kernel kernel-core 6.18.0-1.local.x86_64 (vendor: no "
                "vendor) is not signed by the distribution vendor; under Secure Boot the "
                "firmware rejects it before userspace (a self-enrolled MOK did not help either); "
                "remove it or boot a vendor kernel"
            ],
        ),
        # an older untrusted kernel is not what a reboot boots
        (True, [k("1.el10.elrepo", "kernel-ml", "The ELRepo Project", "6.1.0"), EL10_2], []),
    ],
)
def test_secure_boot_problems(
    enabled: bool, kernels: list[InstalledKernel], expected: list[str]
) -> None:
    assert secure_boot_problems(enabled, kernels, [RH]) == expected


def test_untrusted_and_dedupe() -> None:
    assert untrusted_kernels([EL10_0, ML, NO_VENDOR], [RH]) == [ML, NO_VENDOR]
    assert untrusted_kernels([ML], ["The ELRepo Project"]) == []
    assert dedupe_kernels([ML_CORE, EL10_0, ML]) == [ML_CORE, EL10_0]


SB_ON = SecureBoot(True, True, "Secure Boot enabled")
SB_OFF = SecureBoot(False, True, "Secure Boot disabled")


@pytest.mark.parametrize(
    ("running", "kernels", "sb", "newest", "reboot", "newer", "problems"),
    [
        (
            "6.12.0-55.el10.x86_64",
            [EL10_0, EL10_2],
            SB_ON,
            "6.12.0-124.el10.x86_64",
            True,
            ["6.12.0-124.el10.x86_64"],
            0,
        ),
        ("6.12.0-124.el10.x86_64", [EL10_0, EL10_2], SB_ON, "6.12.0-124.el10.x86_64", False, [], 0),
        (
            "6.12.0-124.el10.x86_64",
            [EL10_2, ML, ML_CORE],
            SB_ON,
            "6.17.8-1.el10.elrepo.x86_64",
            True,
            ["6.17.8-1.el10.elrepo.x86_64"],
            1,
        ),
        (
            "6.12.0-124.el10.x86_64",
            [EL10_2, ML],
            SB_OFF,
            "6.17.8-1.el10.elrepo.x86_64",
            True,
            ["6.17.8-1.el10.elrepo.x86_64"],
            0,
        ),
        ("6.12.0-124.el10.x86_64", [], SB_OFF, None, False, [], 0),
    ],
)
def test_kernel_facts(
    running: str,
    kernels: list[InstalledKernel],
    sb: SecureBoot,
    newest: str | None,
    reboot: bool,
    newer: list[str],
    problems: int,
) -> None:
    facts = kernel_facts(running, "b0a1", kernels, sb, [RH])
    assert facts["newest_kernel"] == newest
    assert facts["reboot_needed"] is reboot
    assert facts["running_is_newest"] is (newest == running)
    assert facts["kernels_newer_than_running"] == newer
    assert len(facts["problems"]) == problems
    assert facts["boot_id"] == "b0a1"
    assert facts["secure_boot"] == sb.to_dict()
    unames = [x["uname"] for x in facts["installed_kernels"]]
    assert len(unames) == len(set(unames))


def test_kernel_facts_trusted_newest_and_running_not_installed() -> None:
    facts = kernel_facts("6.11.0-1.x86_64", None, [EL10_0, ML, EL10_2], SB_OFF, [RH])
    assert facts["newest_trusted_kernel"] == "6.12.0-124.el10.x86_64"
    assert facts["running_is_installed"] is False
    assert facts["kernels_newer_than_running"] == []
    assert [x["name"] for x in facts["untrusted_kernels"]] == ["kernel-ml"]
    assert [x["uname"] for x in facts["installed_kernels"]] == [
        "6.17.8-1.el10.elrepo.x86_64",
        "6.12.0-124.el10.x86_64",
        "6.12.0-55.el10.x86_64",
    ]
