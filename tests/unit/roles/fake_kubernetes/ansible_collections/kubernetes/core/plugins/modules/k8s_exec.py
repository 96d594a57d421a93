# SIMULATION of kubernetes.core.k8s_exec (see the README of tests/unit/roles/fake_kubernetes).
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
            "pod": {"type": "str", "required": True},
            "container": {"type": "str"},
            "command": {"type": "str", "required": True},
        },
        supports_check_mode=True,
    )
    cluster, path = load(module.params)
    command = module.params["command"]
    for rule in cluster.get("exec", []):
        if rule["match"] in command:
            break
    else:
        module.fail_json(msg=f"SIMULATION: the described cluster has no answer to {command}")
    count = record(path, "k8s_exec:" + rule["match"], module.params)
    reply = nth(rule["replies"], count)
    if "fail" in reply:
        module.fail_json(
            msg=f"Failed to execute on pod {module.params['pod']} due to : {reply['fail']}"
        )
    rc = reply.get("rc", 0)
    module.exit_json(
        changed=True,
        stdout=reply.get("stdout", ""),
        stderr=reply.get("stderr", ""),
        rc=rc,
        return_code=rc,
    )


if __name__ == "__main__":
    main()
