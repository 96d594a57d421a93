#!/usr/bin/python3
"""SIMULATION: the lab host's simulated boot of the Arc card (cardshare lab only).

Runs once per (simulated) boot, before Docker starts.  It plays the part of the kernel:
- "boots" the newest installed kernel package (under Secure Boot, only a vendor-signed one,
  as the firmware would), writing its uname string to <root>/proc/sys/kernel/osrelease;
- draws a new boot id;
- probes the simulated PCI device 0000:03:00.0: when the running kernel's real
  modules.alias (installed by a real RPM) lists the id for xe, binds it to xe and creates
  the DRM nodes and the debugfs firmware status; otherwise leaves it unbound;
- forgets every simulated DRM client (processes do not survive a boot).

Knobs: /etc/cardshare-sim/card.env (see lab/SIMULATION.md).
"""

import contextlib
import grp
import os
import shutil
import stat
import subprocess
import uuid

import rpm

ROOT = os.environ.get("CARDSHARE_SIM_ROOT", "/srv/cardshare-sim")
KNOBS = "/etc/cardshare-sim/card.env"
BDF = "0000:03:00.0"
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


def alias_driver(uname, pci_id):
    needle = f"pci:v00008086d0000{pci_id.upper()}sv*sd*bc03sc*i*"
    try:
        with open(f"/lib/modules/{uname}/modules.alias", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 3 and parts[0] == "alias" and parts[1] == needle:
                    return parts[2]
    except FileNotFoundError:
        pass
    return None


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

    dev = f"sys/bus/pci/devices/{BDF}"
    pci_id = k["SIM_PCI_ID"].lower()
    write(f"{dev}/vendor", "0x8086\n")
    write(f"{dev}/device", f"0x{pci_id}\n")
    write(f"{dev}/class", "0x030000\n")
    write(f"{dev}/subsystem_vendor", "0x8086\n")
    write(f"{dev}/subsystem_device", "0x1114\n")
    for drv in ("xe", "i915"):
        os.makedirs(os.path.join(ROOT, "sys/bus/pci/drivers", drv), exist_ok=True)

    driver = {"auto": alias_driver(uname, pci_id), "none": None}.get(
        k["SIM_DRIVER"], k["SIM_DRIVER"]
    )
    if driver:
        os.symlink(f"../../drivers/{driver}", os.path.join(ROOT, dev, "driver"))
        for node in ("card0", "renderD128"):
            os.makedirs(os.path.join(ROOT, dev, "drm", node), exist_ok=True)
        mknod("dev/dri/card0", 0, "video")
        mknod("dev/dri/renderD128", 128, "render")
        os.makedirs(os.path.join(ROOT, "dev/dri/by-path"), exist_ok=True)
        os.symlink("../renderD128", os.path.join(ROOT, f"dev/dri/by-path/pci-{BDF}-render"))
        os.symlink("../card0", os.path.join(ROOT, f"dev/dri/by-path/pci-{BDF}-card"))
        if driver == "xe":
            write(f"{dev}/tile0/physical_vram_size_bytes", hex(int(k["SIM_VRAM_BYTES"])) + "\n")
            write(
                "sys/kernel/debug/dri/0/gt0/uc/guc_info",
                uc_info("GuC", "xe/bmg_guc_70.bin", k["SIM_GUC_STATUS"]),
            )
            write(
                "sys/kernel/debug/dri/0/gt1/uc/huc_info",
                uc_info("HuC", "xe/bmg_huc.bin", k["SIM_HUC_STATUS"]),
            )
    print(
        f"SIMULATION: booted {uname}; card {BDF} (8086:{pci_id}) driver={driver or 'none'} "
        f"secure_boot={int(secure_boot)}"
    )


if __name__ == "__main__":
    main()
