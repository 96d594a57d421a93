"""The lab host's simulated boot (SIMULATION, ``cardshare-sim/boot.py``): one card by default,
the write-up's second machine (two Arc Pro B70s, an Arc A380) with ``SIM_CARDS``.

The script runs on the lab host; here it is loaded as a module with its root, knobs, kernel
list, alias tables and modprobe.d under tmp_path. ``rpm`` (the lab host's RPM bindings) is
replaced by a comparison of version tuples; ``mknod`` by a file that names the device, so the
tests need no privilege.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest

BOOT = (
    Path(__file__).parents[3]
    / "lab/images/rhel10-sim/rootfs/usr/local/libexec/cardshare-sim/boot.py"
)
UNAME = "6.12.0-124.el10_1.x86_64"
B70_A, B70_B, A380 = "0000:03:00.0", "0000:04:00.0", "0000:07:00.0"
THREE = f"{B70_A}=e223 {B70_B}=e223 {A380}=56a5"
# alias lines as el10's kernels print them: the B70's id for xe, the A380's for i915 and xe
ALIASES = (
    "alias pci:v00008086d0000E223sv*sd*bc03sc*i* xe\n"
    "alias pci:v00008086d000056A5sv*sd*bc03sc*i* i915\n"
    "alias pci:v00008086d000056A5sv*sd*bc03sc*i* xe\n"
)


def _boot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, knobs: str, force: str = "") -> Path:
    monkeypatch.setitem(
        sys.modules, "rpm", types.SimpleNamespace(labelCompare=lambda a, b: (a > b) - (a < b))
    )
    spec = importlib.util.spec_from_file_location("cardshare_sim_boot", BOOT)
    assert spec is not None and spec.loader is not None
    boot: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(boot)
    root = tmp_path / "sim"
    (tmp_path / "modules" / UNAME).mkdir(parents=True)
    (tmp_path / "modules" / UNAME / "modules.alias").write_text(ALIASES)
    (tmp_path / "modprobe.d").mkdir()
    if force:
        (tmp_path / "modprobe.d" / "cardshare-xe.conf").write_text(force)
    (tmp_path / "card.env").write_text(knobs)
    monkeypatch.setattr(boot, "ROOT", str(root))
    monkeypatch.setattr(boot, "KNOBS", str(tmp_path / "card.env"))
    monkeypatch.setattr(boot, "MODULES_DIR", str(tmp_path / "modules"))
    monkeypatch.setattr(boot, "MODPROBE_D", str(tmp_path / "modprobe.d"))
    kernel = {"evr": ("0", "6.12.0", "124.el10_1"), "uname": UNAME, "vendor": "Red Hat, Inc."}
    monkeypatch.setattr(boot, "installed_kernels", lambda: [kernel])
    monkeypatch.setattr(boot, "mknod", lambda rel, minor, group: boot.write(rel, f"226:{minor}"))
    boot.main()
    return root


def _driver(root: Path, bdf: str) -> str | None:
    link = root / "sys/bus/pci/devices" / bdf / "driver"
    return Path(str(link.readlink())).name if link.is_symlink() else None


def _engines(root: Path, bdf: str) -> dict[str, list[str]]:
    tile = root / "sys/bus/pci/devices" / bdf / "tile0"
    return {
        gt.name: sorted(e.name for e in (gt / "engines").iterdir())
        for gt in sorted(tile.glob("gt*"))
        if (gt / "engines").is_dir()
    }


def test_one_card_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _boot(tmp_path, monkeypatch, "SIM_PCI_ID=e223\n")
    assert sorted(p.name for p in (root / "sys/bus/pci/devices").iterdir()) == [B70_A]
    assert _driver(root, B70_A) == "xe"
    assert sorted(p.name for p in (root / "dev/dri").iterdir()) == [
        "by-path",
        "card0",
        "renderD128",
    ]
    assert (root / "dev/dri/by-path" / f"pci-{B70_A}-render").readlink() == Path("../renderD128")
    assert "bmg_huc.bin" in (root / "sys/kernel/debug/dri/0/gt1/uc/huc_info").read_text()
    # as before SIM_CARDS: no engines directories
    assert _engines(root, B70_A) == {}


def test_three_cards_each_with_its_own_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _boot(tmp_path, monkeypatch, f"SIM_CARDS={THREE}\n", "options xe force_probe=56a5\n")
    dri = root / "dev/dri"
    for minor, bdf in enumerate((B70_A, B70_B, A380)):
        assert _driver(root, bdf) == "xe", bdf
        render = f"renderD{128 + minor}"
        assert (dri / render).read_text() == f"226:{128 + minor}"
        assert (dri / "by-path" / f"pci-{bdf}-render").readlink() == Path(f"../{render}")
        assert (root / "sys/bus/pci/devices" / bdf / "drm" / render).is_dir()
        assert (root / f"sys/kernel/debug/dri/{minor}/gt0/uc/guc_info").is_file()
    vram = "sys/bus/pci/devices/{}/tile0/physical_vram_size_bytes"
    assert [(root / vram.format(b)).read_text().strip() for b in (B70_A, B70_B, A380)] == [
        hex(32 << 30),
        hex(32 << 30),
        hex(6 << 30),
    ]
    # a Battlemage card's media engines on its media GT, the DG2 card's all on gt0
    assert _engines(root, B70_B) == {"gt0": ["bcs", "ccs", "rcs"], "gt1": ["vcs", "vecs"]}
    assert _engines(root, A380) == {"gt0": ["bcs", "ccs", "rcs", "vcs", "vecs"]}
    huc = (root / "sys/kernel/debug/dri/2/gt0/uc/huc_info").read_text()
    assert huc.startswith("HuC firmware: xe/dg2_huc_gsc.bin\n\tstatus: RUNNING\n")


def test_the_a380_stays_on_i915_unless_force_probed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _boot(tmp_path, monkeypatch, f"SIM_CARDS={THREE}\n")
    assert [_driver(root, b) for b in (B70_A, B70_B, A380)] == ["xe", "xe", "i915"]
    # i915 binds it: DRM nodes, but none of xe's sysfs (memory, engines)
    assert (root / "dev/dri/by-path" / f"pci-{A380}-render").readlink() == Path("../renderD130")
    assert not (root / "sys/bus/pci/devices" / A380 / "tile0").exists()


@pytest.mark.parametrize(
    ("cards", "message"),
    [
        ("0000:07:00.0", "SIM_CARDS item '0000:07:00.0' is not <address>=<id>"),
        ("07:00.0=56a5", "SIM_CARDS item '07:00.0=56a5' is not <address>=<id>"),
        (f"{A380}=56a5 {A380}=56a5", "SIM_CARDS lists an address twice"),
    ],
)
def test_bad_cards_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cards: str, message: str
) -> None:
    with pytest.raises(SystemExit, match=message):
        _boot(tmp_path, monkeypatch, f"SIM_CARDS={cards}\n")
