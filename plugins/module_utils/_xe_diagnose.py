# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What is wrong with the host's Intel GPUs and the xe driver (:func:`diagnose`, pure): each
problem with its code, the device, what was found and the fix, from the facts
``_xe_gather.gather`` read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ansible_collections.cardshare.gpuhost.plugins.module_utils._xe_parse import (
    DEFAULT_DRIVER,
    DEFAULT_FIRMWARE_PACKAGE,
    UC_HEALTHY,
    UC_NOT_SUPPORTED,
    normalise_device_id,
)

__all__ = [
    "Problem",
    "diagnose",
]

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
