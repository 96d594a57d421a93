"""ComfyUI on the arbiter's image card alone (``xe_driver_jobs``, ``arbiter_comfyui_pdev``).

On the one-card host (no facts, or ``declared`` false) the container gets the card's device
directory as ``/dev/dri``, as before. On the write-up's second machine (two Arc Pro B70s as the
LLM pool, an Arc A380 for transcodes) it gets the render node of the arbiter's image card by PCI
path and nothing else: the pool's first card, or the one ``arbiter_comfyui_pdev`` names. A named
card off the pool, or the device directory set beside a pool, is refused before anything
changes, with the variable, the value and the fix.

Each case runs the role's preflight with ``ansible-playbook`` on localhost, one run for the
whole table, and keeps the compose definition the role would write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from role_playbook import WRITE_OUTCOMES, compose_refuses_devices, run_cases

PLAYBOOK = (
    """\
---
- name: Run comfyui's preflight and keep its definition
  hosts: all
  gather_facts: false
  tasks:
    - name: Run comfyui's preflight and keep its definition
      block:
        - name: Include comfyui's preflight
          ansible.builtin.include_role:
            name: cardshare.gpuhost.comfyui
            tasks_from: preflight
            public: true

        - name: Keep the definition
          ansible.builtin.set_fact:
            case_outcome: "{{ __comfyui_definition }}"
      rescue:
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome: {failed: "{{ ansible_failed_result.msg }}"}

"""
    + WRITE_OUTCOMES
)

GIB = 1024**3
B70_A, B70_B, A380 = "0000:03:00.0", "0000:04:00.0", "0000:07:00.0"


def _card(bdf: str, vram: int = 32 * GIB) -> dict[str, Any]:
    return {
        "bdf": bdf,
        "device_id": "e223",
        "vram_bytes": vram,
        "render_node_by_path": f"/dev/dri/by-path/pci-{bdf}-render",
    }


ONE_CARD = {"declared": False, "llm": [_card(B70_A)], "transcode": _card(B70_A)}
THREE_CARDS = {
    "declared": True,
    "llm": [_card(B70_A), _card(B70_B)],
    "transcode": _card(A380, 6 * GIB),
}


def _node(pdev: str) -> str:
    return f"/dev/dri/by-path/pci-{pdev}-render"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("comfyui-card")
    common = {
        "docker_engine_render_gid": 105,
        "comfyui_models_dir": str(work / "models"),
        "comfyui_missing_models_action": "warn",
    }
    three = {**common, "xe_driver_jobs": THREE_CARDS}
    cases = {
        "no-xe-driver-facts": common,
        "one-card": {**common, "xe_driver_jobs": ONE_CARD},
        "one-card-in-the-lab": {
            **common,
            "xe_driver_jobs": ONE_CARD,
            "cardshare_host_root": "/srv/sim",
        },
        "three-cards": three,
        "three-cards-in-the-lab": {**three, "cardshare_host_root": "/srv/sim"},
        "three-cards-second-b70-named": {**three, "arbiter_comfyui_pdev": B70_B},
        "three-cards-a380-named": {**three, "arbiter_comfyui_pdev": A380},
        "three-cards-dri-set": {**three, "comfyui_dri_device": "/dev/dri/renderD129"},
    }
    return run_cases(work / "run", PLAYBOOK, cases)


def _devices(outcome: dict[str, Any]) -> Any:
    return outcome["services"]["comfyui"]["devices"]


def test_the_one_card_host_keeps_the_device_directory(
    outcomes: dict[str, Any], tmp_path: Path
) -> None:
    assert _devices(outcomes["no-xe-driver-facts"]) == ["/dev/dri:/dev/dri"]
    # the whole definition as before a pool existed: only the facts differ
    assert outcomes["one-card"] == outcomes["no-xe-driver-facts"]
    assert _devices(outcomes["one-card-in-the-lab"]) == ["/srv/sim/dev/dri:/dev/dri"]
    assert compose_refuses_devices(_devices(outcomes["one-card"]), tmp_path) == ""


def test_over_a_pool_the_image_card_s_node_is_all_it_gets(
    outcomes: dict[str, Any], tmp_path: Path
) -> None:
    node = _node(B70_A)
    assert _devices(outcomes["three-cards"]) == [
        {"source": node, "target": node, "permissions": "rwm"}
    ]
    # compose takes it (its short syntax would split the address's colons)
    assert compose_refuses_devices(_devices(outcomes["three-cards"]), tmp_path) == ""
    rendered = str(_devices(outcomes["three-cards"]))
    assert B70_B not in rendered and A380 not in rendered and "/dev/dri:" not in rendered
    lab = _devices(outcomes["three-cards-in-the-lab"])
    assert lab == [{"source": "/srv/sim" + node, "target": node, "permissions": "rwm"}]


def test_the_card_arbiter_comfyui_pdev_names(outcomes: dict[str, Any]) -> None:
    node = _node(B70_B)
    assert _devices(outcomes["three-cards-second-b70-named"]) == [
        {"source": node, "target": node, "permissions": "rwm"}
    ]


def test_a_card_off_the_pool_or_a_device_directory_is_refused(outcomes: dict[str, Any]) -> None:
    a380 = " ".join(outcomes["three-cards-a380-named"]["failed"].split())
    assert a380 == (
        f"arbiter_comfyui_pdev is '{A380}', not a card of the LLM pool that xe_driver_card_jobs "
        f"names ({B70_A}, {B70_B}): ComfyUI runs on a pool card while the arbiter has vLLM "
        "stopped; name one of them, or leave arbiter_comfyui_pdev empty for the pool's first "
        "card."
    )
    dri = " ".join(outcomes["three-cards-dri-set"]["failed"].split())
    assert dri == (
        "comfyui_dri_device is '/dev/dri/renderD129', but xe_driver_card_jobs names the LLM "
        f"pool ({B70_A}, {B70_B}): ComfyUI gets only its card's render node by PCI path "
        f"({_node(B70_A)}); leave comfyui_dri_device unset, and name ComfyUI's card with "
        "arbiter_comfyui_pdev instead."
    )
