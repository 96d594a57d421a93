#!/usr/bin/python
# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: kernel_info
short_description: Report the running kernel, installed kernels, reboot need and Secure Boot
description:
  - Reads the running kernel and boot id under a root prefix, queries rpm for installed kernel
    packages, orders them in rpm version order and tells whether the running kernel is the newest
    installed one (RV(reboot_needed) compares versions; it does not rely on C(needs-restarting),
    which also asks for a reboot after glibc or firmware updates).
  - Reads the Secure Boot state from efivarfs and lists installed kernels whose vendor is not
    trusted. Under Secure Boot, an untrusted newest kernel is reported in RV(problems), as the
    firmware refuses to boot a kernel that is not signed by the distribution vendor.
  - Changes nothing on the host.
version_added: 0.1.0
author:
  - cardshare.gpuhost contributors (@cardshare)
options:
  host_root:
    description:
      - Root prefix under which C(/proc) and C(/sys) are read. V(/) on a real host.
      - rpm is always queried on the host itself (its database is real in the lab too).
    type: path
    default: /
  packages:
    description:
      - Kernel packages to query. The C(-core) packages carry the bootable kernel on EL9 and
        later; ELRepo's mainline (C(kernel-ml)) and long-term (C(kernel-lt)) kernels are queried
        too, so that an unsigned kernel is seen. Several packages of one kernel release (for
        example C(kernel-ml) and C(kernel-ml-core)) count once, under the first name listed.
    type: list
    elements: str
    aliases: [package]
    default: [kernel-core, kernel-ml-core, kernel-ml, kernel-lt-core, kernel-lt]
  trusted_vendors:
    description:
      - Package vendors whose kernels are signed with a key the firmware trusts.
    type: list
    elements: str
    default: ['Red Hat, Inc.']
extends_documentation_fragment:
  - cardshare.gpuhost.attributes
  - cardshare.gpuhost.attributes.info_module
notes:
  - Trust is decided by the package vendor. The signing key id is reported for reference.
seealso:
  - module: cardshare.gpuhost.xe_driver_info
"""

EXAMPLES = r"""
- name: Read kernel facts
  cardshare.gpuhost.kernel_info:
  register: __kernel_release_info

- name: Refuse kernels Secure Boot would reject
  ansible.builtin.assert:
    that: __kernel_release_info.problems | length == 0
    fail_msg: "{{ __kernel_release_info.problems | join('; ') }}"
"""

RETURN = r"""
running_kernel:
  description: Kernel release from C(<host_root>/proc/sys/kernel/osrelease).
  returned: always
  type: str
  sample: 6.12.0-55.el10.x86_64
boot_id:
  description: From C(<host_root>/proc/sys/kernel/random/boot_id); null when absent.
  returned: always
  type: str
installed_kernels:
  description:
    - Installed kernels, newest first in rpm order, each with C(name), C(epoch), C(version),
      C(release), C(arch), C(vendor), C(signature), C(key_id) and C(uname)
      (C(VERSION-RELEASE.ARCH)).
  returned: always
  type: list
  elements: dict
newest_kernel:
  description: C(uname) form of the newest installed kernel, or null.
  returned: always
  type: str
  sample: 6.12.0-124.el10.x86_64
newest_kernel_package:
  description: The RV(installed_kernels) entry of the newest kernel.
  returned: always
  type: dict
newest_trusted_kernel:
  description: C(uname) form of the newest kernel from a trusted vendor, or null.
  returned: always
  type: str
running_is_installed:
  description: Whether the running kernel is among the installed packages.
  returned: always
  type: bool
running_is_newest:
  description: Whether the running kernel is the newest installed.
  returned: always
  type: bool
reboot_needed:
  description: True when the newest installed kernel is not the running one.
  returned: always
  type: bool
kernels_newer_than_running:
  description: Installed kernels newer than the running one, newest first.
  returned: always
  type: list
  elements: str
secure_boot:
  description: C(enabled), C(efi) (false on a legacy BIOS boot) and a C(detail) sentence.
  returned: always
  type: dict
untrusted_kernels:
  description: Installed kernels whose vendor is not in O(trusted_vendors).
  returned: always
  type: list
  elements: dict
missing_packages:
  description: Packages of O(packages) that are not installed.
  returned: always
  type: list
  elements: str
problems:
  description: Messages for kernels Secure Boot would refuse.
  returned: always
  type: list
  elements: str
"""

import os  # noqa: E402
from typing import Any  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # type: ignore[import-untyped]  # noqa: E402
from ansible_collections.cardshare.gpuhost.plugins.module_utils._kernel import (  # noqa: E402
    RPM_QUERY_FORMAT,
    SECURE_BOOT_VAR,
    kernel_facts,
    parse_rpm_query,
    parse_secure_boot,
)

ARGUMENT_SPEC: dict[str, Any] = {
    "host_root": {"type": "path", "default": "/"},
    "packages": {
        "type": "list",
        "elements": "str",
        "aliases": ["package"],
        "default": ["kernel-core", "kernel-ml-core", "kernel-ml", "kernel-lt-core", "kernel-lt"],
    },
    "trusted_vendors": {"type": "list", "elements": "str", "default": ["Red Hat, Inc."]},
}


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except FileNotFoundError:
        return None


def read_secure_boot_bytes(root: str) -> tuple[bytes | None, bool]:
    """(content of the SecureBoot variable or None, whether efivars exists)."""
    efivars = _under(root, "/sys/firmware/efi/efivars")
    try:
        with open(os.path.join(efivars, SECURE_BOOT_VAR), "rb") as handle:
            return handle.read(), True
    except FileNotFoundError:
        return None, os.path.isdir(efivars)


def run_module(module: AnsibleModule) -> dict[str, Any]:
    """Read, query rpm and decide; raises ValueError for unparsable input."""
    params = module.params
    root = params["host_root"] or "/"
    running = _read_text(_under(root, "/proc/sys/kernel/osrelease"))
    if running is None:
        raise ValueError(
            f"cannot read the running kernel from {_under(root, '/proc/sys/kernel/osrelease')}"
        )
    boot_id = _read_text(_under(root, "/proc/sys/kernel/random/boot_id"))

    rpm = module.get_bin_path("rpm", required=True)
    rc, out, err = module.run_command(
        [rpm, "-q", "--qf", RPM_QUERY_FORMAT, *params["packages"]],
        environ_update={"LC_ALL": "C"},
    )
    if rc != 0 and err.strip():
        raise ValueError(f"rpm -q failed (rc={rc}): {err.strip()}")
    kernels, missing = parse_rpm_query(out)

    data, efivars_present = read_secure_boot_bytes(root)
    secure_boot = parse_secure_boot(data, efivars_present)
    facts = kernel_facts(running, boot_id, kernels, secure_boot, params["trusted_vendors"])
    return {"changed": False, **facts, "missing_packages": missing}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    try:
        result = run_module(module)
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
