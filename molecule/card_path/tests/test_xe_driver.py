"""What a user of xe_driver cares about, read on the lab host after converge."""

import json

ROOT = "/srv/cardshare-sim"


def test_published_cards_match_the_simulated_card(host):
    cards = json.loads(host.file("/root/xe_driver_cards.json").content_string)
    assert cards == [
        {
            "bdf": "0000:03:00.0",
            "device_id": "e223",
            "card": "card0",
            "render_node": "renderD128",
            "render_node_path": "/dev/dri/renderD128",
            "vram_bytes": int(
                host.file(
                    f"{ROOT}/sys/bus/pci/devices/0000:03:00.0/tile0/physical_vram_size_bytes"
                ).content_string.strip(),
                16,
            ),
            "guc_status": "RUNNING",
            "huc_status": "RUNNING",
            "fdinfo_status": "no-clients",
        }
    ]


def test_card_is_bound_to_xe_under_the_running_kernel(host):
    link = host.file(f"{ROOT}/sys/bus/pci/devices/0000:03:00.0/driver")
    assert link.is_symlink and link.linked_to.endswith("/drivers/xe")
    running = host.file(f"{ROOT}/proc/sys/kernel/osrelease").content_string.strip()
    alias = host.file(f"/lib/modules/{running}/modules.alias").content_string
    assert "alias pci:v00008086d0000E223sv*sd*bc03sc*i* xe" in alias


def test_force_probe_options_are_written_with_header(host):
    conf = host.file("/etc/modprobe.d/cardshare-xe.conf")
    assert conf.mode == 0o644
    text = conf.content_string
    assert "Ansible managed" in text
    assert "options xe force_probe=e223" in text
    assert "options i915 force_probe=!e223" in text
