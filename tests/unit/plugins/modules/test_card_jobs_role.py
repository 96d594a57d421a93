"""The xe_driver role's preflight on the three-card host (SIMULATION, ``multicard_sim``):
the pool and the transcode card published, and each bad inventory refused before any change
with the variable, the value and the fix.

The preflight runs with ``ansible-playbook`` on localhost (``tests/unit/roles/role_playbook``),
one run for the whole table, one simulated tree per case.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from gpuhost_sim import BDF, build_sim, needs_mknod
from multicard_sim import A380, B70_A, B70_B, GIB, three_cards

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "roles"))
from role_playbook import WRITE_OUTCOMES, run_cases

PLAYBOOK = (
    """\
---
- name: Run the xe_driver role's preflight and write what it decided
  hosts: all
  gather_facts: false
  tasks:
    - name: Run the preflight and keep the outcome
      block:
        # one include per entry: a templated tasks_from is not taken per host in one run
        - name: Include the role's preflight
          ansible.builtin.include_role:
            name: cardshare.gpuhost.xe_driver
            tasks_from: preflight
          when: case_tasks == 'preflight'

        - name: Include the role's verify
          ansible.builtin.include_role:
            name: cardshare.gpuhost.xe_driver
            tasks_from: verify
          when: case_tasks == 'verify'

        - name: Keep what the role published
          ansible.builtin.set_fact:
            case_outcome:
              passed: true
              declared: "{{ xe_driver_jobs.declared }}"
              llm: "{{ xe_driver_jobs.llm | map(attribute='render_node_by_path') | list }}"
              transcode: "{{ xe_driver_jobs.transcode.bdf }}"
      rescue:
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome: {failed: "{{ ansible_failed_result.msg }}"}

"""
    + WRITE_OUTCOMES
)

JOBS: list[dict[str, Any]] = [
    {"pdev": B70_A, "device_id": "e223", "job": "llm"},
    {"pdev": B70_B, "device_id": "e223", "job": "llm"},
    {"pdev": A380, "device_id": "56a5", "job": "transcode"},
]

THREE = {
    "passed": True,
    "declared": True,
    "llm": [f"/dev/dri/by-path/pci-{B70_A}-render", f"/dev/dri/by-path/pci-{B70_B}-render"],
    "transcode": A380,
}
UNREAD = (
    "xe_driver_card_jobs[2] (0000:07:00.0) takes transcodes but its engines could not be read "
    "(no tile*/gt*/engines in its sysfs directory): run as root, on a kernel whose xe publishes "
    "them"
)

# (case, how its tree is built, xe_driver_card_jobs, the outcome or the failure's message);
# a case whose name starts with "verify-" runs the role's verify instead of its preflight
CASES: list[tuple[str, str, list[dict[str, Any]], dict[str, Any]]] = [
    (
        "one-card-default",
        "one",
        [],
        {
            "passed": True,
            "declared": False,
            "llm": [f"/dev/dri/by-path/pci-{BDF}-render"],
            "transcode": BDF,
        },
    ),
    ("three-cards", "three", JOBS, THREE),
    ("verify-three-cards", "three", JOBS, THREE),
    # the A380's engines unread: not judged before any change, refused after the driver's checks
    ("a380-engines-unread", "a380-engines-unread", JOBS, THREE),
    ("verify-a380-engines-unread", "a380-engines-unread", JOBS, {"failed": UNREAD}),
    (
        "pool-card-not-found",
        "three",
        [*JOBS[:2], {"pdev": "0000:0a:00.0", "device_id": "e223", "job": "llm"}],
        {
            "failed": "xe_driver_card_jobs[2].pdev is '0000:0a:00.0' (llm): no Intel display "
            "device at that address (found: 0000:03:00.0 (8086:e223), 0000:04:00.0 (8086:e223), "
            "0000:07:00.0 (8086:56a5)); give an address lspci -D -d 8086: lists, or seat and "
            "pass through the card"
        },
    ),
    (
        "card-in-two-jobs",
        "three",
        [*JOBS, {"pdev": B70_B, "device_id": "e223", "job": "transcode"}],
        {
            "failed": "xe_driver_card_jobs gives 0000:04:00.0 two jobs (xe_driver_card_jobs[1] "
            "llm, xe_driver_card_jobs[3] transcode): a card does one job; keep one entry for it "
            "(a host whose one card does every job needs no xe_driver_card_jobs at all)"
        },
    ),
    (
        "pool-memory-differs",
        "small-second-b70",
        JOBS,
        {
            "failed": "xe_driver_card_jobs: the llm pool's cards differ in memory (0000:03:00.0 "
            "32 GiB, 0000:04:00.0 24 GiB); vLLM splits the model evenly over its pool and "
            "applies one memory share to every card, so the smallest card would bound them "
            "all: pool cards of one model (two Arc Pro B70s), and give the other card another "
            "job"
        },
    ),
    (
        "transcode-card-without-media-engine",
        "a380-without-media",
        JOBS,
        {
            "failed": "xe_driver_card_jobs[2] (0000:07:00.0, 8086:56a5) takes transcodes but "
            "has no video engine (vcs; engines: bcs, ccs, rcs): give job transcode to a card "
            "with a media engine (an Arc A380 or a B-series card), or drop the entry so the "
            "pool's first card takes transcodes"
        },
    ),
]


@needs_mknod
def test_preflight_publishes_the_pool_or_refuses(tmp_path: Path) -> None:
    cases: dict[str, dict[str, Any]] = {}
    for name, tree, jobs, _outcome in CASES:
        base = tmp_path / name
        if tree == "one":
            sim = build_sim(base)
        else:
            sim = three_cards(
                base,
                b70_b_vram=24 * GIB if tree == "small-second-b70" else 32 * GIB,
                a380_engines=tree != "a380-without-media",
            )
        if tree == "a380-engines-unread":
            shutil.rmtree(sim.root / "sys/bus/pci/devices" / A380 / "tile0/gt0/engines")
        before = sorted(str(p) for p in sim.root.rglob("*"))
        cases[name] = {
            "xe_driver_host_root": str(sim.root),
            "xe_driver_modules_dir": str(sim.modules_dir),
            "xe_driver_card_jobs": jobs,
            "__cardshare_check_play": True,
            "case_tasks": "verify" if name.startswith("verify-") else "preflight",
            "__before": len(before),
        }
    outcomes = run_cases(tmp_path / "run", PLAYBOOK, cases)
    for name, _tree, _jobs, outcome in CASES:
        assert outcomes[name] == outcome, name
        # preflight changed nothing on the host
        after = sorted(str(p) for p in (tmp_path / name / "root").rglob("*"))
        assert len(after) == cases[name]["__before"], name
