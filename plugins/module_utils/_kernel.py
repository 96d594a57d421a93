# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Kernel facts: installed kernels from rpm, the running one, Secure Boot.

Pure functions only; the module ``kernel_info`` does the reading and runs rpm.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ansible_collections.cardshare.gpuhost.plugins.module_utils._rpmvercmp import (
    compare_evr,
    evr_sort_key,
)

__all__ = [
    "EFI_GLOBAL_GUID",
    "RPM_QUERY_FORMAT",
    "SECURE_BOOT_VAR",
    "InstalledKernel",
    "SecureBoot",
    "dedupe_kernels",
    "kernel_facts",
    "newest_kernel",
    "parse_rpm_query",
    "parse_secure_boot",
    "secure_boot_problems",
    "untrusted_kernels",
]

RPM_QUERY_FORMAT = (
    "%{NAME}\\t%{EPOCHNUM}\\t%{VERSION}\\t%{RELEASE}\\t%{ARCH}\\t%{VENDOR}\\t%{SIGPGP:pgpsig}\\n"
)
"""The ``--qf`` argument given to ``rpm -q`` (rpm expands the ``\\t`` and ``\\n`` escapes)."""

EFI_GLOBAL_GUID = "8be4df61-93ca-11d2-aa0d-00e098032b8c"
SECURE_BOOT_VAR = f"SecureBoot-{EFI_GLOBAL_GUID}"

_NOT_INSTALLED = re.compile(r"^package (\S+) is not installed$")
_KEY_ID = re.compile(r"Key ID ([0-9a-fA-F]+)")


@dataclass(frozen=True)
class InstalledKernel:
    """One installed kernel package, as ``rpm -q`` reports it."""

    name: str
    epoch: int
    version: str
    release: str
    arch: str
    vendor: str | None
    signature: str | None

    @property
    def uname(self) -> str:
        """The kernel release string ``uname -r`` prints once this kernel runs."""
        return f"{self.version}-{self.release}.{self.arch}"

    @property
    def evr(self) -> tuple[int, str, str]:
        return (self.epoch, self.version, self.release)

    @property
    def key_id(self) -> str | None:
        """The signing key id from the signature summary, lower case, or None."""
        if self.signature is None:
            return None
        match = _KEY_ID.search(self.signature)
        return match.group(1).lower() if match else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "epoch": self.epoch,
            "version": self.version,
            "release": self.release,
            "arch": self.arch,
            "vendor": self.vendor,
            "signature": self.signature,
            "key_id": self.key_id,
            "uname": self.uname,
        }


def _none_if_unset(value: str) -> str | None:
    value = value.strip()
    return None if value in ("", "(none)") else value


def parse_rpm_query(text: str) -> tuple[list[InstalledKernel], list[str]]:
    """Parse the output of ``rpm -q <packages> --qf RPM_QUERY_FORMAT``.

    Returns the kernels (in output order) and the package names rpm reported as
    not installed.  Raises ``ValueError`` naming the line for anything else.
    """
    kernels: list[InstalledKernel] = []
    missing: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        not_installed = _NOT_INSTALLED.match(line.strip())
        if not_installed:
            missing.append(not_installed.group(1))
            continue
        fields = line.split("\t")
        if len(fields) != 7:
            raise ValueError(
                f"rpm query line {number}: expected 7 tab-separated fields, "
                f"got {len(fields)}: {line!r}"
            )
        name, epoch, version, release, arch, vendor, signature = fields
        if not epoch.isdigit():
            raise ValueError(f"rpm query line {number}: epoch is not a number: {epoch!r}")
        if not (name and version and release and arch):
            raise ValueError(f"rpm query line {number}: empty name, version, release or arch")
        kernels.append(
            InstalledKernel(
                name=name,
                epoch=int(epoch),
                version=version,
                release=release,
                arch=arch,
                vendor=_none_if_unset(vendor),
                signature=_none_if_unset(signature),
            )
        )
    return kernels, missing


def dedupe_kernels(kernels: Iterable[InstalledKernel]) -> list[InstalledKernel]:
    """Keep the first package seen for each kernel release string.

    ``kernel-ml`` and ``kernel-ml-core`` (or ``kernel`` and ``kernel-core``) describe
    the same bootable kernel; the order of the query decides which name is kept.
    """
    seen: set[str] = set()
    result: list[InstalledKernel] = []
    for kernel in kernels:
        if kernel.uname in seen:
            continue
        seen.add(kernel.uname)
        result.append(kernel)
    return result


def sort_newest_first(kernels: Iterable[InstalledKernel]) -> list[InstalledKernel]:
    """Kernels ordered newest first by rpm's (epoch, version, release) order."""
    return sorted(kernels, key=lambda k: evr_sort_key(k.evr), reverse=True)


def newest_kernel(kernels: Sequence[InstalledKernel]) -> InstalledKernel | None:
    ordered = sort_newest_first(kernels)
    return ordered[0] if ordered else None


def is_trusted(kernel: InstalledKernel, trusted_vendors: Sequence[str]) -> bool:
    return kernel.vendor is not None and kernel.vendor in trusted_vendors


def untrusted_kernels(
    kernels: Iterable[InstalledKernel], trusted_vendors: Sequence[str]
) -> list[InstalledKernel]:
    """Installed kernels whose vendor is not one of ``trusted_vendors``."""
    return [k for k in kernels if not is_trusted(k, trusted_vendors)]


@dataclass(frozen=True)
class SecureBoot:
    """Secure Boot state as read from efivarfs."""

    enabled: bool
    efi: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "efi": self.efi, "detail": self.detail}


def parse_secure_boot(data: bytes | None, efivars_present: bool) -> SecureBoot:
    """Decode the ``SecureBoot`` EFI variable as efivarfs shows it.

    efivarfs prefixes the variable's data with 4 bytes of attributes; the data of
    ``SecureBoot`` is one byte, 1 when enabled.  ``data`` is None when the file is
    absent; ``efivars_present`` says whether the efivars directory exists at all.
    """
    if data is None:
        if not efivars_present:
            return SecureBoot(
                enabled=False,
                efi=False,
                detail="no efivars: legacy BIOS boot, Secure Boot is not available (disabled)",
            )
        return SecureBoot(
            enabled=False,
            efi=True,
            detail="EFI boot without a SecureBoot variable: Secure Boot disabled",
        )
    if len(data) < 5:
        raise ValueError(
            f"{SECURE_BOOT_VAR}: expected 4 attribute bytes and 1 data byte, got {len(data)} bytes"
        )
    value = data[4]
    if value == 1:
        return SecureBoot(enabled=True, efi=True, detail="Secure Boot enabled")
    if value == 0:
        return SecureBoot(enabled=False, efi=True, detail="Secure Boot disabled")
    raise ValueError(f"{SECURE_BOOT_VAR}: unexpected data byte {value:#04x}")


def secure_boot_problems(
    secure_boot_enabled: bool,
    kernels: Sequence[InstalledKernel],
    trusted_vendors: Sequence[str],
) -> list[str]:
    """Messages for kernels that Secure Boot would refuse to boot.

    The newest installed kernel is the one a reboot boots.  Under Secure Boot it
    must come from a trusted vendor (the distribution's signing key).
    """
    if not secure_boot_enabled:
        return []
    newest = newest_kernel(kernels)
    if newest is None or is_trusted(newest, trusted_vendors):
        return []
    vendor = newest.vendor if newest.vendor is not None else "no vendor"
    return [
        f"the newest installed kernel {newest.name} {newest.uname} (vendor: {vendor}) "
        "is not signed by the distribution vendor; under Secure Boot the firmware rejects "
        "it before userspace (a self-enrolled MOK did not help either); remove it or boot "
        "a vendor kernel"
    ]


def kernel_facts(
    running: str,
    boot_id: str | None,
    kernels: Sequence[InstalledKernel],
    secure_boot: SecureBoot,
    trusted_vendors: Sequence[str],
) -> dict[str, Any]:
    """Everything ``kernel_info`` returns, computed from what was read."""
    ordered = sort_newest_first(dedupe_kernels(kernels))
    newest = ordered[0] if ordered else None
    running_pkg = next((k for k in ordered if k.uname == running), None)
    newest_trusted = next((k for k in ordered if is_trusted(k, trusted_vendors)), None)
    running_is_newest = newest is not None and newest.uname == running
    newer_than_running: list[str] = []
    if running_pkg is not None:
        newer_than_running = [k.uname for k in ordered if compare_evr(k.evr, running_pkg.evr) > 0]
    return {
        "running_kernel": running,
        "boot_id": boot_id,
        "installed_kernels": [k.to_dict() for k in ordered],
        "newest_kernel": newest.uname if newest else None,
        "newest_kernel_package": newest.to_dict() if newest else None,
        "newest_trusted_kernel": newest_trusted.uname if newest_trusted else None,
        "running_is_installed": running_pkg is not None,
        "running_is_newest": running_is_newest,
        "reboot_needed": newest is not None and not running_is_newest,
        "kernels_newer_than_running": newer_than_running,
        "secure_boot": secure_boot.to_dict(),
        "untrusted_kernels": [k.to_dict() for k in untrusted_kernels(ordered, trusted_vendors)],
        "problems": secure_boot_problems(secure_boot.enabled, ordered, trusted_vendors),
    }
