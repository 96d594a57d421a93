#!/usr/bin/python
# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: xe_driver_info
short_description: Report Intel GPUs, the xe driver, their firmware and what each kernel knows
description:
  - Reads, under a root prefix, every Intel display-class PCI device (class C(0x03xxxx)) and reports
    its PCI id, the driver bound, its DRM card and render node, VRAM size, GuC and HuC firmware
    status from debugfs, and whether DRM fdinfo can be read.
  - Reads the C(modules.alias) of the running kernel and of every installed kernel to tell whether
    the xe driver of that kernel lists the device's id (and which other modules, e.g. i915, do).
  - Computes a list of RV(problems), each with a code, a message and a fix, for the role
    C(xe_driver) to assert on. The module itself never fails because of a problem it found.
  - Changes nothing on the host.
version_added: 0.1.0
author:
  - cardshare.gpuhost contributors (@cardshare)
options:
  host_root:
    description:
      - Root prefix under which C(/proc), C(/sys), C(/dev) and debugfs are read.
      - V(/) on a real host; the simulated tree in the lab.
    type: path
    default: /
  modules_dir:
    description:
      - Directory holding one directory per installed kernel with its C(modules.alias).
      - Read as given, never under O(host_root) (the alias tables come from installed packages).
    type: path
    default: /lib/modules
  vendor_ids:
    description:
      - PCI vendor ids to report, in C(0x) hex.
    type: list
    elements: str
    default: ['0x8086']
  debugfs:
    description:
      - Where debugfs is mounted, relative to O(host_root).
    type: str
    default: sys/kernel/debug
  expected_ids:
    description:
      - PCI device ids that must be present, in hex (V(e223), V(E223) or V(0xe223)).
      - When set, only these devices are diagnosed (an integrated GPU on i915 is then no problem);
        when empty, every Intel display device found is diagnosed.
    type: list
    elements: str
    default: []
  cards:
    description:
      - The host's cards by PCI address, each with its job, as the role variable
        C(xe_driver_card_jobs) gives them; each a dict of C(pdev), C(device_id) and C(job)
        (V(llm) or V(transcode)).
      - When set, each card is diagnosed by its own address and id (a card missing, or another
        id at its address, is a problem) and O(expected_ids) is not used for the diagnosis.
    type: list
    elements: dict
    default: []
  require_firmware:
    description:
      - Report GuC and HuC that are not C(RUNNING) (or could not be read) as problems.
    type: bool
    default: true
  require_fdinfo:
    description:
      - Report DRM fdinfo that cannot be read (permissions) or carries no C(drm-*) keys as a
        problem.
    type: bool
    default: true
  firmware_package:
    description:
      - Package named in the fix of a firmware problem.
    type: str
    default: linux-firmware
extends_documentation_fragment:
  - cardshare.gpuhost.attributes
  - cardshare.gpuhost.attributes.info_module
notes:
  - GuC and HuC status needs debugfs, readable by root only.
  - Other processes' fdinfo needs root or C(CAP_SYS_PTRACE) in the host's PID namespace. When no
    process has the card open and O(host_root=/), the module opens the render node itself and
    reads its own fdinfo to learn whether the kernel prints C(drm-*) keys.
seealso:
  - module: cardshare.gpuhost.kernel_info
"""

EXAMPLES = r"""
- name: Read the card's state
  cardshare.gpuhost.xe_driver_info:
    expected_ids: ['e223']
  register: __xe_driver_info

- name: Fail with the cause and the fix of each problem
  ansible.builtin.fail:
    msg: "{{ item.message }}: {{ item.fix }}"
  loop: "{{ __xe_driver_info.problems }}"
  loop_control:
    label: "{{ item.code }}"

- name: Read a simulated card
  cardshare.gpuhost.xe_driver_info:
    host_root: /srv/cardshare-sim
"""

RETURN = r"""
running_kernel:
  description: Kernel release from C(<host_root>/proc/sys/kernel/osrelease).
  returned: always
  type: str
  sample: 6.12.0-124.el10.x86_64
installed_kernels:
  description: Kernels with a C(modules.alias) under O(modules_dir), newest first (rpm order).
  returned: always
  type: list
  elements: str
kernels_without_alias_table:
  description: Directories under O(modules_dir) without a C(modules.alias).
  returned: always
  type: list
  elements: str
xe_devices:
  description: One entry per Intel display-class PCI device.
  returned: always
  type: list
  elements: dict
  contains:
    bdf:
      description: PCI address.
      type: str
      sample: "0000:03:00.0"
    device_id:
      description: Device id, lower-case 4 hex digits, as sysfs prints it.
      type: str
      sample: e223
    alias_id:
      description: Device id, upper case, as alias tables spell it.
      type: str
      sample: E223
    class:
      description: PCI class.
      type: str
      sample: "0x030000"
    driver:
      description: Bound driver (basename of the C(driver) link), or null.
      type: str
    card:
      description: DRM card name, e.g. C(card0), or null.
      type: str
    render_node:
      description: Render node name, e.g. C(renderD128), or null.
      type: str
    render_node_path:
      description: Render node path on the host.
      type: str
      sample: /dev/dri/renderD128
    render_node_exists:
      description: Whether the render node is a character device with major 226.
      type: bool
    render_node_by_path_exists:
      description: Whether C(/dev/dri/by-path/pci-<bdf>-render) resolves to a DRM device.
      type: bool
    vram_bytes:
      description: From C(tile0/physical_vram_size_bytes), or null.
      type: int
    engines:
      description:
        - Engine classes xe publishes under C(tile*/gt*/engines) (C(rcs), C(bcs), C(vcs),
          C(vecs), C(ccs)); null when none can be read (the card is not on xe).
      type: list
      elements: str
    guc:
      description: GuC C(status), C(firmware) file, C(gt), C(reason) when unread, C(per_gt).
      type: dict
    huc:
      description: Same as RV(xe_devices[].guc), for HuC (usually on the media GT C(gt1)).
      type: dict
    known_to_running_kernel:
      description: Whether the running kernel's xe alias table lists the id (null if unknown).
      type: bool
    running_kernel_modules:
      description: Modules of the running kernel whose aliases match the device.
      type: list
      elements: str
    kernels_knowing_id:
      description: Installed kernels whose xe alias table lists the id, newest first.
      type: list
      elements: str
    kernel_modules:
      description: For every installed kernel, the modules whose aliases match the device.
      type: dict
    fdinfo:
      description:
        - C(status) (V(readable), V(no-drm-keys), V(unreadable), V(no-clients)), C(readable),
          C(source), C(clients), C(key_families), C(driver), C(reason).
      type: dict
id_knowledge:
  description: For every device id found or expected, what each kernel's alias table says.
  returned: always
  type: dict
problems:
  description: Problems found, each with C(code), C(device), C(message) and C(fix).
  returned: always
  type: list
  elements: dict
ok:
  description: True when there is no problem.
  returned: always
  type: bool
"""

from typing import Any  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # type: ignore[import-untyped]  # noqa: E402
from ansible_collections.cardshare.gpuhost.plugins.module_utils._cards import (  # noqa: E402
    diagnose_cards,
    parse_card_jobs,
    read_engine_classes,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._xe_diagnose import (  # noqa: E402
    diagnose,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._xe_gather import (  # noqa: E402
    gather,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._xe_parse import (  # noqa: E402
    normalise_device_id,
    parse_sysfs_hex,
)

ARGUMENT_SPEC: dict[str, Any] = {
    "host_root": {"type": "path", "default": "/"},
    "modules_dir": {"type": "path", "default": "/lib/modules"},
    "vendor_ids": {"type": "list", "elements": "str", "default": ["0x8086"]},
    "debugfs": {"type": "str", "default": "sys/kernel/debug"},
    "expected_ids": {"type": "list", "elements": "str", "default": []},
    "cards": {"type": "list", "elements": "dict", "default": []},
    "require_firmware": {"type": "bool", "default": True},
    "require_fdinfo": {"type": "bool", "default": True},
    "firmware_package": {"type": "str", "default": "linux-firmware"},
}


def run_module(module: AnsibleModule) -> dict[str, Any]:
    """Gather and diagnose; raises ValueError for unusable options or sysfs values."""
    params = module.params
    vendor_ids = [parse_sysfs_hex(v, "vendor_ids") for v in params["vendor_ids"]]
    expected = [normalise_device_id(i) for i in params["expected_ids"]]
    cards = parse_card_jobs(params["cards"])
    if cards:
        expected = sorted({card.device_id for card in cards})
    facts = gather(
        host_root=params["host_root"],
        modules_dir=params["modules_dir"],
        vendor_ids=vendor_ids,
        debugfs=params["debugfs"],
        expected_ids=expected,
    )
    for dev in facts["xe_devices"]:
        dev["engines"] = read_engine_classes(params["host_root"], dev["bdf"])
    if cards:
        problems = diagnose_cards(
            cards,
            facts["xe_devices"],
            params["require_firmware"],
            facts["running_kernel"],
            facts["id_knowledge"],
            require_fdinfo=params["require_fdinfo"],
            firmware_package=params["firmware_package"],
        )
    else:
        problems = diagnose(
            facts["xe_devices"],
            expected,
            params["require_firmware"],
            facts["running_kernel"],
            facts["id_knowledge"],
            require_fdinfo=params["require_fdinfo"],
            firmware_package=params["firmware_package"],
        )
    return {
        "changed": False,
        **facts,
        "problems": [p.to_dict() for p in problems],
        "ok": not problems,
    }


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    try:
        result = run_module(module)
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
