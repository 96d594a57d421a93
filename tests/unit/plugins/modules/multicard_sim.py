"""A simulated three-card host: two Arc Pro B70s (the LLM pool) and an Arc A380 (transcodes).

SIMULATION, in the layout of ``lab/SIMULATION.md``: ``gpuhost_sim.build_sim`` makes the tree
and its first card (a B70 at 0000:03:00.0); :func:`add_card` adds more, each with its own
sysfs directory, render node (``renderD<128+n>``, its ``by-path`` link) and debugfs firmware
status.  Engine classes are directories ``tile0/gt<N>/engines/<class>``, as xe publishes them
(``drivers/gpu/drm/xe/xe_hw_engine_class_sysfs.c``): a Battlemage card's media engines are on
its media GT ``gt1``, a DG2 card (A380) has one GT with all of them.

The kernels' alias tables are the fixture ``modules.alias.el10_2`` plus lines for the A380's
id 56A5 (a DG2 G11 id of the kernel's ``include/drm/intel/pciids.h``), which real kernels list
for i915 and for xe (xe drives DG2 only when force-probed).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuhost_sim import FIXTURES, MKNOD, NEW_KERNEL, OLD_KERNEL, Sim, _write, build_sim

B70_A = "0000:03:00.0"
B70_B = "0000:04:00.0"
A380 = "0000:07:00.0"
GIB = 1024**3
BMG_ENGINES: dict[str, tuple[str, ...]] = {"gt0": ("bcs", "ccs", "rcs"), "gt1": ("vcs", "vecs")}
DG2_ENGINES: dict[str, tuple[str, ...]] = {"gt0": ("bcs", "ccs", "rcs", "vcs", "vecs")}
DG2_ALIASES = (
    "alias pci:v00008086d000056A5sv*sd*bc03sc*i* i915\n"
    "alias pci:v00008086d000056A5sv*sd*bc03sc*i* xe\n"
)


def add_engines(root: Path, bdf: str, engines: dict[str, tuple[str, ...]]) -> None:
    for gt, classes in engines.items():
        for name in classes:
            (root / "sys/bus/pci/devices" / bdf / "tile0" / gt / "engines" / name).mkdir(
                parents=True, exist_ok=True
            )


def add_card(
    sim: Sim,
    bdf: str,
    *,
    pci_id: str,
    minor: int,
    vram: int | None,
    engines: dict[str, tuple[str, ...]] | None,
    driver: str | None = "xe",
    guc_firmware: str = "xe/bmg_guc_70.bin",
    huc_firmware: str = "xe/bmg_huc.bin",
) -> None:
    """A card at ``bdf`` with DRM card minor ``minor`` (render node ``128 + minor``)."""
    root = sim.root
    dev = root / "sys/bus/pci/devices" / bdf
    _write(dev / "vendor", "0x8086\n")
    _write(dev / "device", f"0x{pci_id}\n")
    _write(dev / "class", "0x030000\n")
    _write(dev / "subsystem_vendor", "0x8086\n")
    _write(dev / "subsystem_device", "0x1114\n")
    if vram is not None:
        _write(dev / "tile0/physical_vram_size_bytes", hex(vram) + "\n")
    if driver is None:
        return
    (dev / "driver").symlink_to(f"../../../bus/pci/drivers/{driver}")
    render = f"renderD{128 + minor}"
    (dev / "drm" / f"card{minor}").mkdir(parents=True)
    (dev / "drm" / render).mkdir(parents=True)
    dri = root / "dev/dri"
    if MKNOD:
        os.mknod(dri / render, stat.S_IFCHR | 0o666, os.makedev(226, 128 + minor))
        os.mknod(dri / f"card{minor}", stat.S_IFCHR | 0o660, os.makedev(226, minor))
    (dri / "by-path" / f"pci-{bdf}-render").symlink_to(f"../{render}")
    debug = root / "sys/kernel/debug/dri" / str(minor)
    _write(debug / "gt0/uc/guc_info", f"GuC firmware: {guc_firmware}\n\tstatus: RUNNING\n")
    _write(debug / "gt0/uc/huc_info", f"HuC firmware: {huc_firmware}\n\tstatus: RUNNING\n")
    if engines is not None:
        add_engines(root, bdf, engines)


def three_cards(base: Path, *, b70_b_vram: int = 32 * GIB, a380_engines: bool = True) -> Sim:
    """Two B70s (32 GiB each unless told) and an A380 (6 GiB) on xe, healthy."""
    sim = build_sim(base, client=None)
    for kver in (OLD_KERNEL, NEW_KERNEL):
        table = "modules.alias.el10_0" if kver == OLD_KERNEL else "modules.alias.el10_2"
        _write(
            sim.modules_dir / kver / "modules.alias", (FIXTURES / table).read_text() + DG2_ALIASES
        )
    add_engines(sim.root, B70_A, BMG_ENGINES)
    add_card(sim, B70_B, pci_id="e223", minor=1, vram=b70_b_vram, engines=BMG_ENGINES)
    add_card(
        sim,
        A380,
        pci_id="56a5",
        minor=2,
        vram=6 * GIB,
        engines=DG2_ENGINES if a380_engines else {"gt0": ("bcs", "ccs", "rcs")},
        guc_firmware="xe/dg2_guc_70.bin",
        huc_firmware="xe/dg2_huc_gsc.bin",
    )
    return sim
