"""compose_stack is internal: the stack roles include it, a play that names it is refused.

The guard is the first task of every entry point (``main``, ``verify`` and ``check``) and reads
``ansible_parent_role_names``, which Ansible sets only when a role includes the role. Each case
is a play on localhost: compose_stack named by the play itself, or included by a small role the
way vllm, comfyui, plex and arbiter include it. Each entry point has an include of its own:
one include with a templated ``tasks_from`` gives every host the entry point of the host whose
result Ansible processed first (it merges the hosts' includes before it templates the entry
point), so which entry each case ran depended on timing. The role's case asks for ``absent`` under a
root that does not exist, so it passes the guard and ends without a Docker engine or a change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from role_playbook import WRITE_OUTCOMES, run_cases

PLAYBOOK = (
    """\
---
- name: Name compose_stack directly, or through a role that includes it
  hosts: all
  gather_facts: false
  tasks:
    - name: Run the case and keep what happened
      block:
        - name: Include compose_stack's main from the play
          ansible.builtin.include_role:
            name: cardshare.gpuhost.compose_stack
            tasks_from: main
          vars: &demo_stack
            compose_stack_name: demo
            compose_stack_root: "{{ out_dir }}/{{ inventory_hostname }}"
            compose_stack_definition: {services: {}}
            compose_stack_state: absent
            compose_stack_services: [demo]
          when: not case_through_role and case_entry == "main"

        - name: Include compose_stack's verify from the play
          ansible.builtin.include_role:
            name: cardshare.gpuhost.compose_stack
            tasks_from: verify
          vars: *demo_stack
          when: not case_through_role and case_entry == "verify"

        - name: Include compose_stack's check from the play
          ansible.builtin.include_role:
            name: cardshare.gpuhost.compose_stack
            tasks_from: check
          vars:
            <<: *demo_stack
            # what the check entry point requires, so that its arguments pass and its guard
            # is what refuses the play
            compose_stack_check_image: demo:1
            compose_stack_check_module: demo
            compose_stack_check_file: /tmp/demo.json
            compose_stack_check_config: {}
          when: not case_through_role and case_entry == "check"

        - name: Include the stack role that includes compose_stack
          ansible.builtin.include_role:
            name: stack
          when: case_through_role

        - name: Keep the success
          ansible.builtin.set_fact:
            case_outcome: {failed: false}
      rescue:
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome: {failed: true, msg: "{{ ansible_failed_result.msg }}"}

"""
    + WRITE_OUTCOMES
)

STACK_ROLE = """\
---
- name: Take the demo project down, as a stack role does
  ansible.builtin.include_role:
    name: cardshare.gpuhost.compose_stack
  vars:
    compose_stack_name: demo
    compose_stack_root: "{{ out_dir }}/{{ inventory_hostname }}"
    compose_stack_definition: {services: {}}
    compose_stack_state: absent
"""

CASES: dict[str, dict[str, Any]] = {
    "play-names-main": {"case_entry": "main", "case_through_role": False},
    "play-names-verify": {"case_entry": "verify", "case_through_role": False},
    "play-names-check": {"case_entry": "check", "case_through_role": False},
    "role-includes-main": {"case_entry": "main", "case_through_role": True},
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir: Path = tmp_path_factory.mktemp("compose-stack-internal")
    tasks = workdir / "roles" / "stack" / "tasks"
    tasks.mkdir(parents=True)
    (tasks / "main.yml").write_text(STACK_ROLE, encoding="utf-8")
    return run_cases(workdir, PLAYBOOK, CASES)


@pytest.mark.parametrize("case", ["play-names-main", "play-names-verify", "play-names-check"])
def test_a_play_that_names_it_is_refused_with_the_way_out(
    outcomes: dict[str, Any], case: str
) -> None:
    outcome = outcomes[case]
    assert outcome["failed"] is True
    assert "cardshare.gpuhost.compose_stack is internal" in outcome["msg"]
    assert "Use the role that owns the project demo" in outcome["msg"]


def test_a_role_that_includes_it_passes(outcomes: dict[str, Any]) -> None:
    assert outcomes["role-includes-main"] == {"failed": False}
