# SIMULATION of kubernetes.core.k8s_log (see the README of tests/unit/roles/fake_kubernetes).
from __future__ import annotations

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.kubernetes.core.plugins.module_utils.fake_cluster import (
    COMMON,
    load,
    record,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            **COMMON,
            "container": {"type": "str"},
            "label_selectors": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    cluster, path = load(module.params)
    record(path, "k8s_log", module.params)
    log = cluster.get("log", "")
    module.exit_json(changed=False, log=log, log_lines=log.split("\n"))


if __name__ == "__main__":
    main()
