# SIMULATION of kubernetes.core.k8s_info (see the README of tests/unit/roles/fake_kubernetes).
from __future__ import annotations

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.kubernetes.core.plugins.module_utils.fake_cluster import (
    COMMON,
    load,
    nth,
    record,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            **COMMON,
            "label_selectors": {"type": "list", "elements": "str", "default": []},
            "wait": {"type": "bool", "default": False},
            "wait_condition": {"type": "dict"},
            "wait_timeout": {"type": "int", "default": 120},
        },
        supports_check_mode=True,
    )
    cluster, path = load(module.params)
    looks = record(path, "k8s_info", module.params)
    pods = nth(cluster.get("pods", [[]]), looks)
    name = module.params["name"]
    if name:
        pods = [p for p in pods if p["metadata"]["name"] == name]
    module.exit_json(changed=False, api_found=True, resources=pods)


if __name__ == "__main__":
    main()
