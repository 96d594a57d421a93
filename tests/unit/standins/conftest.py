"""Fixtures for the lab stand-ins (``lab/standins``): a simulated card under a tmp root.

The stand-ins are scripts, not a package: their directory is put on ``sys.path``.  The card
tree follows ``lab/SIMULATION.md``; the render node is a real character device when the
test may create one, else a regular file (registration never needs the node itself).
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

STANDINS = Path(__file__).resolve().parents[3] / "lab" / "standins"
if str(STANDINS) not in sys.path:
    sys.path.insert(0, str(STANDINS))

from standin_testlib import PDEV  # noqa: E402 - needs the path above


def make_card(root: Path, vram_text: str = "0x800000000") -> Path:
    """Build the simulated card's sysfs and dev nodes under ``root``."""
    device = root / "sys" / "bus" / "pci" / "devices" / PDEV
    (device / "tile0").mkdir(parents=True)
    (device / "tile0" / "physical_vram_size_bytes").write_text(vram_text + "\n")
    (device / "vendor").write_text("0x8086\n")
    (device / "device").write_text("0xe223\n")
    dri = root / "dev" / "dri"
    dri.mkdir(parents=True)
    try:
        os.mknod(dri / "renderD128", 0o660 | stat.S_IFCHR, os.makedev(226, 128))
    except (PermissionError, OSError):
        (dri / "renderD128").write_text("")
    (root / "proc").mkdir()
    return root


@pytest.fixture
def card_root(tmp_path: Path) -> Path:
    return make_card(tmp_path / "sim")


@pytest.fixture
def sim_env(card_root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("CARDSHARE_SIM_ROOT", str(card_root))
    monkeypatch.delenv("CONTAINER_ID", raising=False)
    yield card_root
