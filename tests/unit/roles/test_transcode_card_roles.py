"""Plex and the re-encode campaign on the xe_driver role's transcode card (``xe_driver_jobs``).

On the one-card host (no facts, or ``declared`` false) both containers get the card's device
directory as ``/dev/dri``, as before. On the write-up's second machine (two Arc Pro B70s as the
LLM pool, an Arc A380 for transcodes) each gets the A380's render node by PCI path and nothing
else, never a pool card; the campaign's encoder (vainfo, ffmpeg's ``-vaapi_device``) opens the
node the container gives that card. Setting the device directory beside a declared transcode
card is refused before anything changes.

Each case runs both roles' preflights with ``ansible-playbook`` on localhost, one run for the
whole table, and keeps the compose definitions the roles would write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from role_playbook import WRITE_OUTCOMES, compose_refuses_devices, run_cases

PLAYBOOK = (
    """\
---
- name: Run the plex and transcode_campaign preflights and keep their definitions
  hosts: all
  gather_facts: false
  tasks:
    - name: Run plex's preflight and keep its devices
      block:
        - name: Include plex's preflight
          ansible.builtin.include_role:
            name: cardshare.gpuhost.plex
            tasks_from: preflight
            public: true

        - name: Keep plex's devices
          ansible.builtin.set_fact:
            case_plex: "{{ __plex_definition.services.plex.devices }}"
      rescue:
        - name: Keep plex's failure
          ansible.builtin.set_fact:
            case_plex: {failed: "{{ ansible_failed_result.msg }}"}

    - name: Run the campaign's preflight and keep its devices and its encoder's device
      block:
        - name: Include the campaign's preflight
          ansible.builtin.include_role:
            name: cardshare.gpuhost.transcode_campaign
            tasks_from: preflight
            public: true

        - name: Keep the campaign's devices
          ansible.builtin.set_fact:
            case_campaign:
              devices: "{{ __transcode_campaign_definition.services.encoder.devices }}"
              encoder_device: "{{ __transcode_campaign_config.device }}"
      rescue:
        - name: Keep the campaign's failure
          ansible.builtin.set_fact:
            case_campaign: {failed: "{{ ansible_failed_result.msg }}"}

    - name: Keep both
      ansible.builtin.set_fact:
        case_outcome: {plex: "{{ case_plex }}", campaign: "{{ case_campaign }}"}

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
A380_NODE = f"/dev/dri/by-path/pci-{A380}-render"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("transcode-card")
    media = work / "media"
    (media / "Films").mkdir(parents=True)
    common = {
        "docker_engine_render_gid": 105,
        "transcode_campaign_media_root": str(media),
        "transcode_campaign_libraries": [str(media / "Films")],
        "transcode_campaign_hold_dir": str(media / ".cardshare-held"),
        "__transcode_campaign_image": "cardshare/campaign:test",
    }
    three = {**common, "xe_driver_jobs": THREE_CARDS}
    cases = {
        "no-xe-driver-facts": common,
        "one-card": {**common, "xe_driver_jobs": ONE_CARD},
        "three-cards": three,
        "three-cards-in-the-lab": {**three, "cardshare_host_root": "/srv/sim"},
        "three-cards-node-named": {**three, "transcode_campaign_render_node": "renderD129"},
        "three-cards-plex-dri-set": {**three, "plex_dri_device": "/dev/dri/renderD129"},
        "three-cards-campaign-dri-set": {
            **three,
            "transcode_campaign_dri_device": "/dev/dri/renderD129",
        },
    }
    return run_cases(work / "run", PLAYBOOK, cases)


def test_the_one_card_host_keeps_the_device_directory(
    outcomes: dict[str, Any], tmp_path: Path
) -> None:
    for name in ("no-xe-driver-facts", "one-card"):
        assert outcomes[name] == {
            "plex": ["/dev/dri:/dev/dri"],
            "campaign": {"devices": ["/dev/dri:/dev/dri"], "encoder_device": "/dev/dri/renderD128"},
        }, name
    assert compose_refuses_devices(outcomes["one-card"]["plex"], tmp_path) == ""


def test_a_declared_transcode_card_is_all_they_get(
    outcomes: dict[str, Any], tmp_path: Path
) -> None:
    node = {"source": A380_NODE, "permissions": "rwm"}
    assert outcomes["three-cards"] == {
        "plex": [{**node, "target": "/dev/dri/renderD128"}],
        "campaign": {
            "devices": [{**node, "target": "/dev/dri/renderD128"}],
            # the encoder opens the node the container gives the A380
            "encoder_device": "/dev/dri/renderD128",
        },
    }
    # compose takes them (its short syntax would split the address's colons)
    assert compose_refuses_devices(outcomes["three-cards"]["plex"], tmp_path / "plex") == ""
    devices = outcomes["three-cards"]["campaign"]["devices"]
    assert compose_refuses_devices(devices, tmp_path / "campaign") == ""
    rendered = str(outcomes["three-cards"])
    assert B70_A not in rendered and B70_B not in rendered


def test_the_lab_root_and_a_named_node(outcomes: dict[str, Any]) -> None:
    lab = outcomes["three-cards-in-the-lab"]
    assert [d["source"] for d in lab["plex"]] == ["/srv/sim" + A380_NODE]
    assert [d["source"] for d in lab["campaign"]["devices"]] == ["/srv/sim" + A380_NODE]
    named = outcomes["three-cards-node-named"]["campaign"]
    assert named["devices"] == [
        {"source": A380_NODE, "target": "/dev/dri/renderD129", "permissions": "rwm"}
    ]
    assert named["encoder_device"] == "/dev/dri/renderD129"


def test_a_device_directory_beside_a_transcode_card_is_refused(outcomes: dict[str, Any]) -> None:
    plex = " ".join(outcomes["three-cards-plex-dri-set"]["plex"]["failed"].split())
    assert plex == (
        "plex_dri_device is '/dev/dri/renderD129', but xe_driver_card_jobs names the card that "
        f"takes transcodes ({A380}): Plex gets only its render node by PCI path ({A380_NODE}) and "
        "never a card of the LLM pool; leave plex_dri_device unset, and change the transcode "
        "card in xe_driver_card_jobs instead."
    )
    campaign = " ".join(outcomes["three-cards-campaign-dri-set"]["campaign"]["failed"].split())
    assert campaign == (
        "transcode_campaign_dri_device is '/dev/dri/renderD129', but xe_driver_card_jobs "
        f"names the card that takes transcodes ({A380}): the encoder gets only its render node "
        f"by PCI path ({A380_NODE}) and never a card of the LLM pool; leave "
        "transcode_campaign_dri_device unset, and change the transcode card in "
        "xe_driver_card_jobs instead."
    )
    # each refusal is its own role's: the other role passes
    assert "failed" not in outcomes["three-cards-plex-dri-set"]["campaign"]
    assert "failed" not in outcomes["three-cards-campaign-dri-set"]["plex"]
