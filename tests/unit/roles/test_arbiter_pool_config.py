"""The arbiter's pool as the role renders it from the xe_driver role's facts
(``xe_driver_cards``, ``xe_driver_jobs``): the write-up's second machine (two B70s as the LLM
pool, an A380 for transcodes whose address sorts first) trades both B70s, ComfyUI on the
first or the one named; a one-card host's config is as it was (no pool keys). The rendered
config is read by the arbiter's own parser. Preflight refuses a ComfyUI card off the pool
and a bad pool, naming the variable, the value and the fix, before anything changes.
"""

from __future__ import annotations

from typing import Any

import pytest
from role_playbook import ROOT, WRITE_OUTCOMES, run_cases

from cardshare.arbiter.config import parse_config

ROLE = ROOT / "roles" / "arbiter"

RENDER = (
    f"""\
---
- name: Render the arbiter's config
  hosts: all
  gather_facts: false
  tasks:
    - name: Load the role's defaults and internal variables
      ansible.builtin.include_vars:
        file: "{{{{ item }}}}"
      loop:
        - {ROLE / "defaults" / "main.yml"}
        - {ROLE / "vars" / "main.yml"}

    - name: Name ComfyUI's card (over the defaults file, as an inventory's value is)
      ansible.builtin.set_fact:
        arbiter_comfyui_pdev: "{{{{ case_comfyui }}}}"
      when: case_comfyui is defined

    - name: Keep the config
      ansible.builtin.set_fact:
        case_outcome: "{{{{ __arbiter_config }}}}"

"""
    + WRITE_OUTCOMES
)

PREFLIGHT = (
    """\
---
- name: Run the arbiter's preflight and write what it decided
  hosts: all
  gather_facts: false
  tasks:
    - name: Run the preflight and keep the outcome
      block:
        - name: Include the role's preflight
          ansible.builtin.include_role:
            name: cardshare.gpuhost.arbiter
            tasks_from: preflight

        - name: Keep the success
          ansible.builtin.set_fact:
            case_outcome: {passed: true}
      rescue:
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome: {failed: "{{ ansible_failed_result.msg }}"}

"""
    + WRITE_OUTCOMES
)

A380, B70_A, B70_B = "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"
SECOND_MACHINE = {
    "xe_driver_cards": [{"bdf": A380}, {"bdf": B70_A}, {"bdf": B70_B}],
    "xe_driver_jobs": {
        "declared": True,
        "llm": [{"bdf": B70_A}, {"bdf": B70_B}],
        "transcode": {"bdf": A380},
    },
}
ONE_CARD = {
    "xe_driver_cards": [{"bdf": B70_A}],
    "xe_driver_jobs": {"declared": False, "llm": [{"bdf": B70_A}], "transcode": None},
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cases = {
        "no-xe-driver": {},
        "one-card": ONE_CARD,
        "second-machine": SECOND_MACHINE,
        "second-machine-comfyui-named": {**SECOND_MACHINE, "case_comfyui": B70_B},
        "transcodes-on-the-pool": {
            **SECOND_MACHINE,
            "xe_driver_jobs": {**SECOND_MACHINE["xe_driver_jobs"], "transcode": {"bdf": B70_A}},
        },
    }
    return run_cases(tmp_path_factory.mktemp("arbiter-pool"), RENDER, cases)


def test_a_one_card_host_s_config_has_no_pool_keys(rendered: dict[str, Any]) -> None:
    for case, card in (("no-xe-driver", None), ("one-card", B70_A)):
        config = rendered[case]
        assert "pool_pdevs" not in config and "image_card_pdev" not in config, case
        assert config["card_pdev"] == card
        parsed = parse_config(config)
        assert (parsed.pool, parsed.image_pdev) == (((card,), card) if card else ((), None))


def test_the_second_machine_trades_both_b70s(rendered: dict[str, Any]) -> None:
    config = rendered["second-machine"]
    assert (config["card_pdev"], config["pool_pdevs"]) == (B70_A, [B70_A, B70_B])
    assert "image_card_pdev" not in config
    assert parse_config(config).image_pdev == B70_A
    named = rendered["second-machine-comfyui-named"]
    assert named["image_card_pdev"] == B70_B
    assert parse_config(named).image_pdev == B70_B


def test_the_transcode_card_is_named_when_it_is_off_the_pool(rendered: dict[str, Any]) -> None:
    """The A380 takes the transcodes: the status page draws its bar after the pool's. A host
    whose transcodes share the pool's card (or with one card) names none."""
    assert rendered["second-machine"]["transcode_pdev"] == A380
    assert parse_config(rendered["second-machine"]).transcode_pdev == A380
    for case in ("no-xe-driver", "one-card"):
        assert "transcode_pdev" not in rendered[case], case
    assert "transcode_pdev" not in rendered["transcodes-on-the-pool"]


# (case id, variables, strings the failure must contain; [] when the case must pass)
PREFLIGHT_CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("one-card", ONE_CARD, []),
    ("second-machine", SECOND_MACHINE, []),
    ("comfyui-on-the-second-b70", {**SECOND_MACHINE, "arbiter_comfyui_pdev": B70_B}, []),
    (
        "comfyui-on-the-a380",
        {**SECOND_MACHINE, "arbiter_comfyui_pdev": A380},
        [
            "arbiter_comfyui_pdev is '0000:02:00.0', not a card of the pool",
            "['0000:03:00.0', '0000:04:00.0']",
            "name one of the pool's cards",
        ],
    ),
    (
        "comfyui-off-the-one-card",
        {**ONE_CARD, "arbiter_comfyui_pdev": B70_B},
        ["arbiter_comfyui_pdev is '0000:04:00.0', not a card of the pool ['0000:03:00.0']"],
    ),
    (
        "comfyui-on-a-host-whose-card-is-not-named",
        {"arbiter_comfyui_pdev": B70_A},
        ["arbiter_comfyui_pdev is '0000:03:00.0', not a card of the pool []", "or ''"],
    ),
    (
        "pool-card-not-found",
        {**SECOND_MACHINE, "arbiter_pool_pdevs": [B70_A, "0000:05:00.0"]},
        [
            "arbiter_pool_pdevs is ['0000:03:00.0', '0000:05:00.0']",
            "of the cards the xe_driver role found: 0000:02:00.0, 0000:03:00.0, 0000:04:00.0",
        ],
    ),
    (
        "pool-card-twice",
        {**SECOND_MACHINE, "arbiter_pool_pdevs": [B70_A, B70_A]},
        ["arbiter_pool_pdevs is ['0000:03:00.0', '0000:03:00.0']", "each PCI address once"],
    ),
    (
        "pool-as-a-string",
        {"arbiter_pool_pdevs": B70_A},
        ["arbiter_pool_pdevs is 0000:03:00.0", "give the LLM pool's cards"],
    ),
    (
        "transcode-card-in-the-pool",
        {**SECOND_MACHINE, "arbiter_transcode_pdev": B70_B},
        [
            "arbiter_transcode_pdev is '0000:04:00.0'",
            "not a card of the LLM pool ['0000:03:00.0', '0000:04:00.0']; or '' to name none",
        ],
    ),
    (
        "transcode-card-not-found",
        {**SECOND_MACHINE, "arbiter_transcode_pdev": "0000:07:00.0"},
        [
            "arbiter_transcode_pdev is '0000:07:00.0'",
            "one of the cards the xe_driver role found: 0000:02:00.0, 0000:03:00.0, 0000:04:00.0",
        ],
    ),
    (
        "card-off-the-pool",
        {**SECOND_MACHINE, "arbiter_card_pdev": A380},
        ["arbiter_card_pdev '0000:02:00.0'", "with arbiter_card_pdev one of them"],
    ),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cases = {name: facts for name, facts, _ in PREFLIGHT_CASES}
    return run_cases(tmp_path_factory.mktemp("arbiter-pool-preflight"), PREFLIGHT, cases)


@pytest.mark.parametrize(
    ("name", "expected"),
    [(n, e) for n, _, e in PREFLIGHT_CASES],
    ids=[n for n, *_ in PREFLIGHT_CASES],
)
def test_preflight_refuses_a_comfyui_card_off_the_pool_and_a_bad_pool(
    refused: dict[str, Any], name: str, expected: list[str]
) -> None:
    outcome = refused[name]
    if not expected:
        assert outcome == {"passed": True}, outcome
        return
    message = " ".join(outcome.get("failed", "").split())
    assert [e for e in expected if e not in message] == [], message
