# SIMULATION of kubernetes.core.k8s (see the README of tests/unit/roles/fake_kubernetes).
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
            "state": {"type": "str", "default": "present"},
            "definition": {"type": "raw"},
            "apply": {"type": "bool", "default": False},
            "server_side_apply": {"type": "dict"},
            "wait": {"type": "bool", "default": False},
            "wait_timeout": {"type": "int", "default": 120},
        },
        supports_check_mode=True,
    )
    cluster, path = load(module.params)
    record(path, "k8s", module.params)
    definition = module.params["definition"] or {
        "kind": module.params["kind"],
        "metadata": {"name": module.params["name"]},
    }
    if (
        module.params["wait"]
        and definition.get("kind") == "Deployment"
        and not cluster.get("rollout", True)
    ):
        module.fail_json(
            msg=f'"{definition["kind"]}" "{definition["metadata"]["name"]}": '
            "Timed out waiting on resource",
            duration=module.params["wait_timeout"],
        )
    module.exit_json(changed=True, result=definition, method="apply")


if __name__ == "__main__":
    main()
