"""The arbiter's config and compose project as the role renders them from the vllm role's
published plan: vLLM's ladder (``llm_plans``, the recorder's names of every plan), the
driver's headroom, and the pre-warm of vLLM's weights (a read-only mount of the models'
directory and the path the arbiter reads). Without the vllm role in the play: one plan and no
pre-warm."""

from __future__ import annotations

from typing import Any

import pytest
from role_playbook import ROOT, WRITE_OUTCOMES, run_cases

ROLE = ROOT / "roles" / "arbiter"

PLAYBOOK = (
    f"""\
---
- name: Render the arbiter's config and compose project
  hosts: all
  gather_facts: false
  tasks:
    - name: Load the role's defaults and internal variables
      ansible.builtin.include_vars:
        file: "{{{{ item }}}}"
      loop:
        - {ROLE / "defaults" / "main.yml"}
        - {ROLE / "vars" / "main.yml"}

    - name: Keep the config and the arbiter's volumes
      ansible.builtin.set_fact:
        case_outcome:
          config: "{{{{ __arbiter_config }}}}"
          volumes: "{{{{ __arbiter_definition.services.arbiter.volumes }}}}"
      vars:
        __arbiter_image: cardshare/arbiter:0.1.0-0123456789ab

"""
    + WRITE_OUTCOMES
)

LADDER = [
    {
        "service": "vllm",
        "gpu_memory_utilization": 0.7,
        "max_model_len": 65536,
        "reservation_bytes": 24051816858,
    },
    {
        "service": "plan1",
        "project": "vllm-ladder",
        "gpu_memory_utilization": 0.67,
        "max_model_len": 49152,
        "reservation_bytes": 23021024707,
    },
]
VLLM_PLAN = {
    "arbiter_plans": LADDER,
    "driver_headroom_bytes": 858993459,
    "model_root": "/var/lib/cardshare/models",
    "model_path": "Qwen2.5-7B-Instruct",
    "model": {"served_name": "Qwen2.5-7B-Instruct"},
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cases = {
        "without-vllm": {},
        "with-vllm": {"vllm_plan": VLLM_PLAN},
        # an older vllm role's plan: no model_root/model_path published, no pre-warm
        "no-model-dir": {"vllm_plan": {k: v for k, v in VLLM_PLAN.items() if k != "model_root"}},
    }
    return run_cases(tmp_path_factory.mktemp("arbiter-plans"), PLAYBOOK, cases)


def test_the_ladder_and_the_names_of_every_plan(rendered: dict[str, Any]) -> None:
    config = rendered["with-vllm"]["config"]
    assert config["llm_plans"] == LADDER
    assert config["llm_client_names"] == ["vllm/vllm", "vllm-ladder/plan1"]
    assert config["vram_headroom_bytes"] == 858993459
    assert config["restore_full_plan"] is True


def test_the_prewarm_reads_the_model_through_a_read_only_mount(rendered: dict[str, Any]) -> None:
    case = rendered["with-vllm"]
    assert "/var/lib/cardshare/models:/prewarm/models:ro" in case["volumes"]
    assert case["config"]["prewarm_paths"] == ["/prewarm/models/Qwen2.5-7B-Instruct"]
    off = rendered["no-model-dir"]
    assert off["config"]["prewarm_paths"] == []
    assert not any(str(v).startswith("/var/lib/cardshare/models") for v in off["volumes"])


def test_without_the_vllm_role_one_plan_and_no_prewarm(rendered: dict[str, Any]) -> None:
    case = rendered["without-vllm"]
    assert case["config"]["llm_plans"] == []
    assert case["config"]["llm_client_names"] == ["vllm/vllm"]
    assert case["config"]["vram_headroom_bytes"] == 0
    assert case["config"]["prewarm_paths"] == []


def test_the_package_accepts_the_rendered_config(rendered: dict[str, Any]) -> None:
    from cardshare.arbiter.config import parse_config

    for case in rendered.values():
        config = parse_config(case["config"])
        assert config.plans
    assert parse_config(rendered["with-vllm"]["config"]).llm_names == (
        "vllm/vllm",
        "vllm-ladder/plan1",
    )
