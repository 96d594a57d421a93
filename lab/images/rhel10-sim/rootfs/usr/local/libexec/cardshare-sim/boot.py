#!/usr/bin/python3
"""SIMULATION: the lab host's simulated boot of the Arc card (cardshare lab only).

Runs once per (simulated) boot, before Docker starts.  It plays the part of the kernel:
- "boots" the newest installed kernel package (under Secure Boot, only a vendor-signed one,
  as the firmware would), writing its uname string to <root>/proc/sys/kernel/osrelease;
- draws a new boot id;
- probes the simulated PCI device 0000:03:00.0 (or every card SIM_CARDS lists): when the
  running kernel's real modules.alias (installed by a real RPM) lists the id for xe, binds it
  to xe and creates the DRM nodes and the debugfs firmware status; otherwise leaves it
  unbound.  A DG2 id (the A380's 56a5), which xe lists but drives only when force-probed,
  goes to xe only when /etc/modprobe.d says "options xe force_probe=" with it, else to i915;
- forgets every simulated DRM client (processes do not survive a boot).

Knobs: /etc/cardshare-sim/card.env (see lab/SIMULATION.md).
"""

import contextlib
import grp
import os
import re
import shutil
import stat
import subprocess
import uuid

import rpm

ROOT = os.environ.get("CARDSHARE_SIM_ROOT", "/srv/cardshare-sim")
KNOBS = "/etc/cardshare-sim/card.env"
BDF = "0000:03:00.0"
MODPROBE_D = "/etc/modprobe.d"
MODULES_DIR = "/lib/modules"
# Ids xe marks require_force_probe (DG2: Arc A380 56a5, A750/A770 56a1/56a0), with their memory
# and firmware; Battlemage's (the B70's e223) xe drives without it.
DG2_IDS = {"56a0": 16 << 30, "56a1": 8 << 30, "56a5": 6 << 30}
# Engine classes by GT, as xe publishes them (tile0/gt<N>/engines/<class>): a Battlemage card's
# media engines are on its media GT gt1, a DG2 card has one GT with all of them.
BMG_ENGINES = {"gt0": ("bcs", "ccs", "rcs"), "gt1": ("vcs", "vecs")}
DG2_ENGINES = {"gt0": ("bcs", "ccs", "rcs", "vcs", "vecs")}
TRUSTED_VENDORS = {"Red Hat, Inc."}
EFI_SB = "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"


def knobs():
    values = {
        "SIM_PCI_ID": "e223",
        "SIM_DRIVER": "auto",
        "SIM_GUC_STATUS": "RUNNING",
        "SIM_HUC_STATUS": "RUNNING",
        "SIM_SECURE_BOOT": "1",
        "SIM_VRAM_BYTES": str(32 << 30),
        # the cards by PCI address, "<address>=<id>" separated by spaces; empty: the one card
        # at 0000:03:00.0 with SIM_PCI_ID and SIM_VRAM_BYTES.  The write-up's second machine:
        # "0000:03:00.0=e223 0000:04:00.0=e223 0000:07:00.0=56a5"
        "SIM_CARDS": "",
    }
    with open(KNOBS, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                key, _, value = line.partition("=")
                values[key.strip()] = value.strip().strip('"')
    return values


def write(rel, text, mode=0o644):
    path = os.path.join(ROOT, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as fh:
        fh.write(text if isinstance(text, bytes) else text.encode())
    os.chmod(path + ".tmp", mode)
    os.replace(path + ".tmp", path)


def installed_kernels():
    out = subprocess.run(
        [
            "rpm",
            "-qa",
            "--qf",
            "%{NAME}\t%{EPOCHNUM}\t%{VERSION}\t%{RELEASE}\t%{ARCH}\t%{VENDOR}\n",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    kernels = []
    for line in out.splitlines():
        name, epoch, ver, rel, arch, vendor = line.split("\t")
        if name in ("kernel-core", "kernel-ml-core"):
            kernels.append(
                {"evr": (epoch, ver, rel), "uname": f"{ver}-{rel}.{arch}", "vendor": vendor}
            )
    return kernels


def choose_kernel(kernels, secure_boot):
    bootable = [k for k in kernels if not secure_boot or k["vendor"] in TRUSTED_VENDORS]
    if not bootable:
        raise SystemExit("SIMULATION: no bootable kernel installed")
    best = bootable[0]
    for k in bootable[1:]:
        if rpm.labelCompare(k["evr"], best["evr"]) > 0:
            best = k
    return best["uname"]


def alias_drivers(uname, pci_id):
    """The drivers the kernel's alias table lists for the id, in its order."""
    needle = f"pci:v00008086d0000{pci_id.upper()}sv*sd*bc03sc*i*"
    found = []
    try:
        with open(f"{MODULES_DIR}/{uname}/modules.alias", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 3 and parts[0] == "alias" and parts[1] == needle:
                    found.append(parts[2])
    except FileNotFoundError:
        pass
    return found


def alias_driver(uname, pci_id):
    drivers = alias_drivers(uname, pci_id)
    return drivers[0] if drivers else None


def uc_info(kind, firmware, status):
    lines = [f"{kind} firmware: {firmware}", f"\tstatus: {status}"]
    if status == "RUNNING":
        lines += [
            "\tversion: wanted 70.44.1, found 70.44.1"
            if kind == "GuC"
            else "\tversion: found 8.2.10",
            "\tuCode: 335872 bytes",
            "\tRSA: 384 bytes",
        ]
    return "\n".join(lines) + "\n"


def mknod(rel, minor, group):
    path = os.path.join(ROOT, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    os.mknod(path, 0o660 | stat.S_IFCHR, os.makedev(226, minor))
    os.chmod(path, 0o660)
    with contextlib.suppress(KeyError):  # owned by the group udev gives DRM nodes on a real host
        os.chown(path, 0, grp.getgrnam(group).gr_gid)


def parse_cards(k):
    """[(address, id, VRAM bytes)]; the one card of SIM_PCI_ID when SIM_CARDS is empty."""
    text = k["SIM_CARDS"].strip()
    if not text:
        return [(BDF, k["SIM_PCI_ID"].lower(), int(k["SIM_VRAM_BYTES"]))]
    cards = []
    for item in text.split():
        bdf, sep, pci_id = item.partition("=")
        if (
            not sep
            or not re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", bdf)
            or not re.fullmatch(r"[0-9a-f]{4}", pci_id.lower())
        ):
            raise SystemExit(
                f"SIMULATION: SIM_CARDS item {item!r} is not <address>=<id>, "
                "such as 0000:07:00.0=56a5"
            )
        cards.append((bdf, pci_id.lower(), DG2_IDS.get(pci_id.lower(), int(k["SIM_VRAM_BYTES"]))))
    if len({c[0] for c in cards}) != len(cards):
        raise SystemExit(f"SIMULATION: SIM_CARDS lists an address twice: {text!r}")
    return cards


def xe_force_probe():
    """The ids of "options xe force_probe=..." in modprobe.d, as the kernel reads them at boot."""
    ids = set()
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(MODPROBE_D)):
            if not name.endswith(".conf"):
                continue
            with open(os.path.join(MODPROBE_D, name), encoding="utf-8") as fh:
                for line in fh:
                    words = line.split()
                    if len(words) >= 3 and words[:2] == ["options", "xe"]:
                        for word in words[2:]:
                            key, _, value = word.partition("=")
                            if key == "force_probe":
                                ids.update(v.strip().lower() for v in value.split(",") if v.strip())
    return ids


def probe_driver(uname, pci_id, forced):
    """The driver the kernel binds: the alias table's, but xe takes a DG2 id only forced."""
    if pci_id not in DG2_IDS:
        return alias_driver(uname, pci_id)
    drivers = alias_drivers(uname, pci_id)
    if "xe" in drivers and pci_id in forced:
        return "xe"
    return "i915" if "i915" in drivers else None


def make_card(index, bdf, pci_id, vram, driver, k, engines):
    """One card's sysfs, DRM nodes (card<index>, renderD<128+index>), by-path links, debugfs
    firmware status and, when asked, its engine classes."""
    dev = f"sys/bus/pci/devices/{bdf}"
    write(f"{dev}/vendor", "0x8086\n")
    write(f"{dev}/device", f"0x{pci_id}\n")
    write(f"{dev}/class", "0x030000\n")
    write(f"{dev}/subsystem_vendor", "0x8086\n")
    write(f"{dev}/subsystem_device", "0x1114\n")
    if not driver:
        return
    card, render = f"card{index}", f"renderD{128 + index}"
    os.symlink(f"../../drivers/{driver}", os.path.join(ROOT, dev, "driver"))
    for node in (card, render):
        os.makedirs(os.path.join(ROOT, dev, "drm", node), exist_ok=True)
    mknod(f"dev/dri/{card}", index, "video")
    mknod(f"dev/dri/{render}", 128 + index, "render")
    os.makedirs(os.path.join(ROOT, "dev/dri/by-path"), exist_ok=True)
    os.symlink(f"../{render}", os.path.join(ROOT, f"dev/dri/by-path/pci-{bdf}-render"))
    os.symlink(f"../{card}", os.path.join(ROOT, f"dev/dri/by-path/pci-{bdf}-card"))
    if driver != "xe":
        return
    dg2 = pci_id in DG2_IDS
    write(f"{dev}/tile0/physical_vram_size_bytes", hex(vram) + "\n")
    guc, huc, huc_gt = (
        ("xe/dg2_guc_70.bin", "xe/dg2_huc_gsc.bin", "gt0")
        if dg2
        else ("xe/bmg_guc_70.bin", "xe/bmg_huc.bin", "gt1")
    )
    debug = f"sys/kernel/debug/dri/{index}"
    write(f"{debug}/gt0/uc/guc_info", uc_info("GuC", guc, k["SIM_GUC_STATUS"]))
    write(f"{debug}/{huc_gt}/uc/huc_info", uc_info("HuC", huc, k["SIM_HUC_STATUS"]))
    if engines:
        for gt, classes in (DG2_ENGINES if dg2 else BMG_ENGINES).items():
            for name in classes:
                os.makedirs(os.path.join(ROOT, dev, "tile0", gt, "engines", name), exist_ok=True)


def main():
    k = knobs()
    secure_boot = k["SIM_SECURE_BOOT"] == "1"
    uname = choose_kernel(installed_kernels(), secure_boot)
    for rel in ("sys", "dev", "proc"):
        shutil.rmtree(os.path.join(ROOT, rel), ignore_errors=True)
    write("proc/sys/kernel/osrelease", uname + "\n")
    write("proc/sys/kernel/random/boot_id", str(uuid.uuid4()) + "\n")
    write(EFI_SB, b"\x06\x00\x00\x00" + (b"\x01" if secure_boot else b"\x00"))
    write("SIMULATION", "Everything under this directory is the cardshare lab's simulated card.\n")

    for drv in ("xe", "i915"):
        os.makedirs(os.path.join(ROOT, "sys/bus/pci/drivers", drv), exist_ok=True)
    cards = parse_cards(k)
    several = bool(k["SIM_CARDS"].strip())
    forced = xe_force_probe()
    for index, (bdf, pci_id, vram) in enumerate(cards):
        driver = (
            probe_driver(uname, pci_id, forced)
            if k["SIM_DRIVER"] == "auto"
            else {"none": None}.get(k["SIM_DRIVER"], k["SIM_DRIVER"])
        )
        # the one-card lab keeps its tree as it was: no engines directories
        make_card(index, bdf, pci_id, vram, driver, k, engines=several)
        print(
            f"SIMULATION: booted {uname}; card {bdf} (8086:{pci_id}) driver={driver or 'none'} "
            f"secure_boot={int(secure_boot)}"
        )


if __name__ == "__main__":
    main()
