"""``xe_driver_info`` against simulated trees (layout of lab/SIMULATION.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.cardshare.gpuhost.plugins.module_utils._xe_gather import gather
from ansible_collections.cardshare.gpuhost.plugins.modules import xe_driver_info
from gpuhost_sim import BDF, NEW_KERNEL, OLD_KERNEL, FailJson, Sim, needs_mknod

REPO = Path(__file__).resolve().parents[4]


def args_for(s: Sim, **extra: Any) -> dict[str, Any]:
    return {
        "host_root": str(s.root),
        "modules_dir": str(s.modules_dir),
        "expected_ids": ["e223"],
        **extra,
    }


@needs_mknod
def test_healthy_card(sim: Callable[..., Sim], run_module: Callable[..., dict[str, Any]]) -> None:
    s = sim()
    result = run_module(xe_driver_info.main, args_for(s))
    assert result["changed"] is False
    assert result["problems"] == []
    assert result["ok"] is True
    assert result["running_kernel"] == NEW_KERNEL
    assert result["installed_kernels"] == [NEW_KERNEL, OLD_KERNEL]
    [dev] = result["xe_devices"]
    assert {k: dev[k] for k in ("bdf", "vendor", "device_id", "alias_id", "class")} == {
        "bdf": BDF,
        "vendor": "0x8086",
        "device_id": "e223",
        "alias_id": "E223",
        "class": "0x030000",
    }
    assert dev["modalias"] == "pci:v00008086d0000E223sv00008086sd00001114bc03sc00i00"
    assert (dev["driver"], dev["card"], dev["render_node"]) == ("xe", "card0", "renderD128")
    assert dev["render_node_path"] == "/dev/dri/renderD128"
    assert dev["render_node_exists"] is True
    assert dev["render_node_by_path_exists"] is True
    assert dev["vram_bytes"] == 34359738368
    assert (dev["guc"]["status"], dev["guc"]["firmware"], dev["guc"]["gt"]) == (
        "RUNNING",
        "xe/bmg_guc_70.bin",
        "gt0",
    )
    assert (dev["huc"]["status"], dev["huc"]["firmware"], dev["huc"]["gt"]) == (
        "RUNNING",
        "xe/bmg_huc.bin",
        "gt1",
    )
    assert dev["known_to_running_kernel"] is True
    assert dev["running_kernel_modules"] == ["xe"]
    assert dev["kernels_knowing_id"] == [NEW_KERNEL]
    assert dev["kernel_modules"] == {NEW_KERNEL: ["xe"], OLD_KERNEL: []}
    assert dev["fdinfo"] == {
        "status": "readable",
        "readable": True,
        "source": "clients",
        "clients": 1,
        "key_families": ["capacity", "cycles", "memory"],
        "driver": "xe",
        "reason": None,
    }


@needs_mknod
def test_check_mode_reports_the_same(
    sim: Callable[..., Sim], run_module: Callable[..., dict[str, Any]]
) -> None:
    s = sim()
    normal = run_module(xe_driver_info.main, args_for(s))
    checked = run_module(xe_driver_info.main, {**args_for(s), "_ansible_check_mode": True})
    assert checked["changed"] is False
    assert checked["xe_devices"] == normal["xe_devices"]


@pytest.mark.parametrize(
    ("knobs", "codes"),
    [
        pytest.param(
            {"running": OLD_KERNEL, "driver": None},
            ["id_unknown_running_known_installed"],
            id="seed-story-before-update",
        ),
        pytest.param(
            {"running": OLD_KERNEL, "kernels": (OLD_KERNEL,), "driver": None},
            ["id_unknown_everywhere"],
            id="no-kernel-knows-the-id",
        ),
        pytest.param({"driver": None}, ["not_bound"], id="unbound"),
        pytest.param({"driver": "i915", "client": None}, ["bound_other_driver"], id="i915"),
        pytest.param({"devices": False}, ["no_device"], id="no-device"),
    ],
)
def test_problem_scenarios(
    sim: Callable[..., Sim],
    run_module: Callable[..., dict[str, Any]],
    knobs: dict[str, Any],
    codes: list[str],
) -> None:
    s = sim(**knobs)
    result = run_module(xe_driver_info.main, args_for(s))
    assert [p["code"] for p in result["problems"]] == codes
    assert result["ok"] is False


def test_unknown_id_message_names_both_kernels(
    sim: Callable[..., Sim], run_module: Callable[..., dict[str, Any]]
) -> None:
    s = sim(running=OLD_KERNEL, driver=None)
    [problem] = run_module(xe_driver_info.main, args_for(s))["problems"]
    assert problem == {
        "code": "id_unknown_running_known_installed",
        "device": BDF,
        "message": f"PCI id E223 of {BDF} is unknown to the xe driver of the running kernel "
        f"{OLD_KERNEL} but known to installed kernel {NEW_KERNEL}",
        "fix": f"reboot into {NEW_KERNEL}, or set kernel_release_allow_reboot: true",
    }


def test_missing_device_still_reports_kernel_knowledge(
    sim: Callable[..., Sim], run_module: Callable[..., dict[str, Any]]
) -> None:
    s = sim(devices=False)
    result = run_module(xe_driver_info.main, args_for(s))
    assert result["xe_devices"] == []
    knows = result["id_knowledge"]["e223"]
    assert knows["modalias"] == "pci:v00008086d0000E223sv00000000sd00000000bc03sc00i00"
    assert knows["known_to_running_kernel"] is True
    assert knows["kernels_knowing_id"] == [NEW_KERNEL]


@needs_mknod
@pytest.mark.parametrize(
    ("knobs", "code", "status"),
    [
        ({"guc": "MISSING"}, "guc_not_running", "MISSING"),
        ({"guc": "LOAD FAIL"}, "guc_not_running", "LOAD FAIL"),
        ({"huc": "INIT FAIL"}, "huc_not_running", "INIT FAIL"),
        ({"huc": "ERROR"}, "huc_not_running", "ERROR"),
    ],
)
def test_firmware_scenarios(
    sim: Callable[..., Sim],
    run_module: Callable[..., dict[str, Any]],
    knobs: dict[str, Any],
    code: str,
    status: str,
) -> None:
    s = sim(**knobs)
    result = run_module(xe_driver_info.main, args_for(s))
    assert [p["code"] for p in result["problems"]] == [code]
    assert f"reports status {status}, not RUNNING" in result["problems"][0]["message"]
    relaxed = run_module(xe_driver_info.main, args_for(s, require_firmware=False))
    assert relaxed["problems"] == []


@needs_mknod
def test_debugfs_absent(sim: Callable[..., Sim]) -> None:
    s = sim()
    shutil.rmtree(s.root / "sys/kernel/debug")
    facts = gather(str(s.root), str(s.modules_dir), expected_ids=["e223"])
    guc = facts["xe_devices"][0]["guc"]
    assert guc["status"] is None
    assert guc["reason"] == f"no debugfs at {s.root}/sys/kernel/debug"
    (s.root / "sys/kernel/debug").mkdir()
    guc = gather(str(s.root), str(s.modules_dir))["xe_devices"][0]["guc"]
    assert guc["reason"] == f"no {s.root}/sys/kernel/debug/dri: debugfs is not mounted"


@needs_mknod
def test_debugfs_named_by_pci_address(sim: Callable[..., Sim]) -> None:
    s = sim()
    dri = s.root / "sys/kernel/debug/dri"
    (dri / "0").rename(dri / BDF)
    dev = gather(str(s.root), str(s.modules_dir))["xe_devices"][0]
    assert (dev["guc"]["status"], dev["huc"]["status"]) == ("RUNNING", "RUNNING")


@pytest.mark.parametrize(("vram", "expected"), [("0x800000000", 34359738368), (None, None)])
def test_vram_forms(sim: Callable[..., Sim], vram: str | None, expected: int | None) -> None:
    s = sim(vram=vram, driver=None)
    assert gather(str(s.root), str(s.modules_dir))["xe_devices"][0]["vram_bytes"] == expected


def test_pci_device_as_symlink(sim: Callable[..., Sim]) -> None:
    s = sim(pci_dir_is_link=True, driver=None)
    [dev] = gather(str(s.root), str(s.modules_dir))["xe_devices"]
    assert (dev["bdf"], dev["device_id"], dev["driver"]) == (BDF, "e223", None)


@needs_mknod
@pytest.mark.parametrize(
    ("client", "status", "problem"),
    [
        ("fdinfo.no_drm_keys.txt", "no-drm-keys", ["fdinfo_unreadable"]),
        (None, "no-clients", []),
    ],
)
def test_fdinfo_states(
    sim: Callable[..., Sim],
    run_module: Callable[..., dict[str, Any]],
    client: str | None,
    status: str,
    problem: list[str],
) -> None:
    s = sim(client=client)
    result = run_module(xe_driver_info.main, args_for(s))
    assert result["xe_devices"][0]["fdinfo"]["status"] == status
    assert [p["code"] for p in result["problems"]] == problem


@needs_mknod
def test_render_node_not_a_device(sim: Callable[..., Sim]) -> None:
    s = sim(client=None)
    node = s.root / "dev/dri/renderD128"
    node.unlink()
    node.write_text("")
    dev = gather(str(s.root), str(s.modules_dir))["xe_devices"][0]
    assert (dev["render_node_exists"], dev["render_node_by_path_exists"]) == (False, False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"expected_ids": ["8086:e223"]},
            "'8086:e223' is not a 4-digit hex PCI device id (e.g. e223)",
        ),
        ({"vendor_ids": ["8086"]}, "vendor_ids: expected a 0x-prefixed hex value, got '8086'"),
    ],
)
def test_bad_options_fail(
    sim: Callable[..., Sim],
    run_module: Callable[..., dict[str, Any]],
    args: dict[str, Any],
    message: str,
) -> None:
    s = sim(devices=False)
    with pytest.raises(FailJson) as err:
        run_module(xe_driver_info.main, {**args_for(s), **args})
    assert err.value.result["msg"] == message


def test_module_runs_as_a_program(sim: Callable[..., Sim], tmp_path: Path) -> None:
    """The module file itself, run the way Ansible runs it: JSON arguments in a file."""
    s = sim(running=OLD_KERNEL, driver=None)
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args_for(s)}))
    env = {**os.environ, "PYTHONPATH": str(REPO / ".cache" / "collections")}
    proc = subprocess.run(
        [sys.executable, str(REPO / "plugins/modules/xe_driver_info.py"), str(args)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["changed"] is False
    assert [p["code"] for p in result["problems"]] == ["id_unknown_running_known_installed"]


@needs_mknod
def test_fdinfo_denied(
    sim: Callable[..., Sim],
    run_module: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without ptrace-read permission the client's fd directory cannot be listed."""
    s = sim()
    real_listdir = os.listdir

    def listdir(path: Any) -> list[str]:
        if str(path).endswith("/proc/100001/fd"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    result = run_module(xe_driver_info.main, args_for(s))
    assert result["xe_devices"][0]["fdinfo"]["status"] == "unreadable"
    assert result["problems"] == [
        {
            "code": "fdinfo_unreadable",
            "device": BDF,
            "message": f"DRM fdinfo of {BDF} is not readable: descriptors of 1 process could "
            "not be read: reading other processes' fdinfo needs root or CAP_SYS_PTRACE",
            "fix": "read fdinfo as root (or with CAP_SYS_PTRACE) in the host's PID namespace",
        }
    ]
