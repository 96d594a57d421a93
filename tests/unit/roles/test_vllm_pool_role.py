"""The vllm role over the xe_driver role's cards (``xe_driver_jobs``): the one-card host's
container and arguments as before, the write-up's second machine (two Arc Pro B70s as the
pool, an Arc A380 for transcodes) with --tensor-parallel-size 2, the tightest card's share
and exactly the pool's render nodes by PCI path; and its refusals.

Each case runs the role's preflight (which computes the plan) with ``ansible-playbook`` on
localhost, one run for the whole table; the cards are the facts the xe_driver role publishes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.module_utils._cards import (
    parse_card_jobs,
    resolve_card_jobs,
)
from role_playbook import ROOT, WRITE_OUTCOMES, compose_refuses_devices, run_cases

PLAYBOOK = (
    """\
---
- name: Run the vllm role's preflight and write what it computed
  hosts: all
  gather_facts: false
  tasks:
    - name: Run the preflight and keep the outcome
      block:
        - name: Include the role's preflight
          ansible.builtin.include_role:
            name: cardshare.gpuhost.vllm
            tasks_from: preflight
            public: true

        - name: Keep what the role computed
          ansible.builtin.set_fact:
            case_outcome:
              devices: "{{ __vllm_devices }}"
              args: "{{ __vllm_plan.args }}"
              ladder_tp: >-
                {{ __vllm_ladder | map(attribute='args')
                   | map('select', 'eq', '--tensor-parallel-size') | map('length') | list }}
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
    return {"bdf": bdf, "device_id": "e223", "vram_bytes": vram}


ONE_CARD = {
    "xe_driver_cards": [_card(B70_A)],
    "xe_driver_jobs": {"declared": False, "llm": [_card(B70_A)], "transcode": _card(B70_A)},
}
THREE_CARDS = {
    "xe_driver_cards": [_card(B70_A), _card(B70_B), _card(A380, 6 * GIB)],
    "xe_driver_jobs": {
        "declared": True,
        "llm": [_card(B70_A), _card(B70_B)],
        "transcode": _card(A380, 6 * GIB),
    },
    # Plex (no pdev) is on the A380; the retrieval tier on the first B70, a desktop on the second
    "vllm_reservations": [
        {"name": "plex-4k-hdr-transcode", "bytes": "2GiB", "count": 2},
        {"name": "retrieval", "bytes": "3GiB", "pdev": B70_A},
        {"name": "desktop", "bytes": "1GiB", "pdev": B70_B},
    ],
}


PLEX = {"name": "plex-4k-hdr-transcode", "bytes": "2GiB", "count": 2}
DESKTOPS = [
    {"name": "desktop", "bytes": "1GiB", "pdev": B70_A},
    {"name": "desktop", "bytes": "1GiB", "pdev": B70_B},
]


def _after(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_one_card_and_the_pool(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "Qwen2.5-7B-Instruct").mkdir(parents=True)
    (models / "Qwen2.5-7B-Instruct" / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "max_position_embeddings": 32768, "rope_theta": 1e6})
    )
    common = {"docker_engine_render_gid": 105, "vllm_model_dir": str(models)}
    cases = {
        "no-xe-driver-facts": {**common, "xe_driver_cards": [_card(B70_A)]},
        "one-card": {**common, **ONE_CARD},
        "three-cards": {**common, **THREE_CARDS},
        "three-cards-devices-set": {**common, **THREE_CARDS, "vllm_devices": ["/dev/dri"]},
        "three-cards-with-mask": {**common, **THREE_CARDS, "vllm_ze_affinity_mask": "0"},
        # a transcode on the A380 (no pdev) leaves the pool's plan: the share is the pool's
        # without it (a desktop on each B70 keeps the share under the ceiling)
        "three-cards-plex-on-the-a380": {
            **common,
            **THREE_CARDS,
            "vllm_reservations": [PLEX, *DESKTOPS],
        },
        "three-cards-without-plex": {**common, **THREE_CARDS, "vllm_reservations": DESKTOPS},
        "three-cards-plex-on-a-pool-card": {
            **common,
            **THREE_CARDS,
            "vllm_reservations": [{**PLEX, "pdev": B70_B}, *DESKTOPS],
        },
        "three-cards-devices-changed": {
            **common,
            **THREE_CARDS,
            "vllm_devices": ["/dev/dri/renderD128"],
        },
    }
    out = run_cases(tmp_path / "run", PLAYBOOK, cases)

    # the one-card host: /dev/dri, no TP flag, the share of the card with Plex on it (0.85)
    for name in ("no-xe-driver-facts", "one-card"):
        assert out[name]["devices"] == ["/dev/dri:/dev/dri"], name
        assert "--tensor-parallel-size" not in out[name]["args"], name
        assert _after(out[name]["args"], "--gpu-memory-utilization") == "0.85", name
    assert out["no-xe-driver-facts"] == out["one-card"]

    # the pool: TP 2, the tightest card (the retrieval tier's: (32 - 3 - 0.8) / 32) and the
    # two B70s' render nodes by PCI path, the A380's not among them
    pool = out["three-cards"]
    # in compose's long syntax: its short one splits on the address's colons
    assert pool["devices"] == [
        {"source": node, "target": node, "permissions": "rwm"}
        for node in (f"/dev/dri/by-path/pci-{B70_A}-render", f"/dev/dri/by-path/pci-{B70_B}-render")
    ]
    assert compose_refuses_devices(pool["devices"], tmp_path / "compose") == ""
    assert _after(pool["args"], "--tensor-parallel-size") == "2"
    assert _after(pool["args"], "--gpu-memory-utilization") == "0.88"
    assert pool["ladder_tp"] and set(pool["ladder_tp"]) == {1}
    assert out["three-cards-devices-set"] == pool

    # Plex's reservation without pdev is on the A380: vLLM's share is the pool's without it,
    # (32 - 1 - 0.8) / 32 rounded down; moved onto a pool card it shrinks the share
    def share(name: str) -> str | None:
        return _after(out[name]["args"], "--gpu-memory-utilization")

    assert share("three-cards-plex-on-the-a380") == share("three-cards-without-plex") == "0.94"
    # (32 - 4 - 1 - 0.8) / 32
    assert share("three-cards-plex-on-a-pool-card") == "0.81"

    expected = (
        "vllm_devices is {devices} and vllm_ze_affinity_mask is {mask}, but xe_driver_card_jobs "
        "names the LLM pool (0000:03:00.0, 0000:04:00.0): the container gets exactly the "
        "pool's render nodes by PCI path and vLLM uses every one of them; leave vllm_devices "
        "at [/dev/dri] and vllm_ze_affinity_mask at null, and change the pool in "
        "xe_driver_card_jobs instead."
    )
    assert out["three-cards-with-mask"] == {
        "failed": expected.format(devices="['/dev/dri']", mask='"0"')
    }
    assert out["three-cards-devices-changed"] == {
        "failed": expected.format(devices="['/dev/dri/renderD128']", mask="null")
    }


def test_the_example_inventorys_second_host(tmp_path: Path) -> None:
    """inventories/example's poolbox (README.md, "Two cards and more"): its cards parse, and
    the vllm role plans TP=2 over the two B70s with Plex's default reservation on the A380."""
    example = yaml.safe_load(
        (ROOT / "inventories" / "example" / "host_vars" / "poolbox.yml").read_text("utf-8")
    )
    jobs = parse_card_jobs(example["xe_driver_card_jobs"])
    assert [(j.pdev, j.job) for j in jobs] == [(B70_A, "llm"), (B70_B, "llm"), (A380, "transcode")]
    cards = [_card(B70_A), _card(B70_B), {**_card(A380, 6 * GIB), "device_id": "56a5"}]
    models = tmp_path / "models"
    (models / example["vllm_model"]).mkdir(parents=True)
    (models / example["vllm_model"] / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "max_position_embeddings": 40960,
                "rope_scaling": None,
                "rope_theta": 1000000.0,
            }
        )
    )
    role_vars = {k: v for k, v in example.items() if k.startswith("vllm_")}
    host = {
        **role_vars,
        "vllm_model_dir": str(models),
        "docker_engine_render_gid": 105,
        "xe_driver_cards": cards,
        "xe_driver_jobs": resolve_card_jobs(jobs, cards),
    }
    out = run_cases(tmp_path / "run", PLAYBOOK, {"poolbox": host})["poolbox"]
    assert "failed" not in out, out
    assert _after(out["args"], "--tensor-parallel-size") == "2"
    assert _after(out["args"], "--gpu-memory-utilization") == "0.97"
    assert [d["source"] for d in out["devices"]] == [
        f"/dev/dri/by-path/pci-{B70_A}-render",
        f"/dev/dri/by-path/pci-{B70_B}-render",
    ]
