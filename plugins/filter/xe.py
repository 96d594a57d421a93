"""Filters over the result of cardshare.gpuhost.xe_driver_info."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]


def xe_cards(info: Any, expected_ids: Any = None) -> list[dict[str, Any]]:
    """The cards the roles that follow use: one small dict per xe-bound device.

    With ``expected_ids``, only devices with one of those ids (lower-case hex) are kept.
    """
    if not isinstance(info, dict) or not isinstance(info.get("xe_devices"), list):
        raise AnsibleFilterError(
            f"xe_cards expects the registered result of cardshare.gpuhost.xe_driver_info, "
            f"got {type(info).__name__}"
        )
    wanted = {str(i).lower().removeprefix("0x") for i in expected_ids or []}
    cards = []
    for dev in info["xe_devices"]:
        if wanted and dev.get("device_id") not in wanted:
            continue
        if dev.get("driver") != "xe":
            continue
        cards.append(
            {
                "bdf": dev.get("bdf"),
                "device_id": dev.get("device_id"),
                "card": dev.get("card"),
                "render_node": dev.get("render_node"),
                "render_node_path": dev.get("render_node_path"),
                "vram_bytes": dev.get("vram_bytes"),
                "guc_status": (dev.get("guc") or {}).get("status"),
                "huc_status": (dev.get("huc") or {}).get("status"),
                "fdinfo_status": (dev.get("fdinfo") or {}).get("status"),
            }
        )
    return cards


class FilterModule:
    """cardshare.gpuhost xe filters."""

    def filters(self) -> dict[str, Any]:
        return {"xe_cards": xe_cards}
