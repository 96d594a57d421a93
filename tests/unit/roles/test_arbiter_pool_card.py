"""The arbiter's card by default (``arbiter_card_pdev``): the xe_driver role's LLM pool's first
card, never the transcode card, even where the transcode card's address sorts first; the
host's first card when the xe_driver role names no jobs, as before.

The role's defaults file is read in a play on localhost with the facts the xe_driver role
publishes (``xe_driver_cards``, ``xe_driver_jobs``), one run for the whole table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from role_playbook import ROOT, WRITE_OUTCOMES, run_cases

PLAYBOOK = (
    f"""\
---
- name: Read the arbiter role's defaults with the xe_driver role's facts
  hosts: all
  gather_facts: false
  tasks:
    - name: Read the defaults
      ansible.builtin.include_vars:
        file: {ROOT / "roles" / "arbiter" / "defaults" / "main.yml"}

    - name: Keep the card
      ansible.builtin.set_fact:
        case_outcome: "{{{{ arbiter_card_pdev }}}}"

"""
    + WRITE_OUTCOMES
)

A380, B70_A, B70_B = "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"
CARDS = [{"bdf": A380}, {"bdf": B70_A}, {"bdf": B70_B}]

CASES: dict[str, tuple[dict[str, Any], str]] = {
    "no-xe-driver": ({}, ""),
    "one-card": (
        {
            "xe_driver_cards": [{"bdf": B70_A}],
            "xe_driver_jobs": {"declared": False, "llm": [{"bdf": B70_A}], "transcode": None},
        },
        B70_A,
    ),
    "cards-without-jobs-fact": ({"xe_driver_cards": [{"bdf": B70_A}]}, B70_A),
    "pool-after-the-transcode-card": (
        {
            "xe_driver_cards": CARDS,
            "xe_driver_jobs": {
                "declared": True,
                "llm": [{"bdf": B70_A}, {"bdf": B70_B}],
                "transcode": {"bdf": A380},
            },
        },
        B70_A,
    ),
}


def test_the_arbiter_trades_the_pool_s_first_card(tmp_path: Path) -> None:
    outcomes = run_cases(tmp_path, PLAYBOOK, {name: facts for name, (facts, _) in CASES.items()})
    assert outcomes == {name: card for name, (_, card) in CASES.items()}
