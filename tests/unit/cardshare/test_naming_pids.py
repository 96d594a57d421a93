"""Issue 9 (naming, from item 8): which process names a shared client; fd cache keys."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cardshare.naming import is_broker, naming_pid, primary_cgroup
from cardshare.recorder.scan import scan_proc


@dataclass(frozen=True)
class Proc:
    comm: str
    cgroup: str


def _cg(rec_fixtures: Path, name: str) -> str:
    return primary_cgroup((rec_fixtures / "cgroup" / name).read_text())


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("broker-logind.txt", "/system.slice/systemd-logind.service"),
        ("broker-logind-hybrid.txt", "/system.slice/systemd-logind.service"),
        ("docker-cgroupfs-v1.txt", "/docker/" + "0123456789abcdef" * 4),
        (
            "podman-rootful.txt",
            "/machine.slice/libpod-" + "0123456789abcdef" * 4 + ".scope/container",
        ),
        ("broker-pid1.txt", "/init.scope"),
    ],
)
def test_primary_cgroup(rec_fixtures: Path, fixture: str, expected: str) -> None:
    assert _cg(rec_fixtures, fixture) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", ""), ("garbage\n", ""), ("0::/\n", "/"), ("3:cpu:/a\n2:memory:/b\n", "/a")],
)
def test_primary_cgroup_edges(text: str, expected: str) -> None:
    assert primary_cgroup(text) == expected


@pytest.mark.parametrize(
    ("comm", "cgroup", "expected"),
    [
        ("systemd-logind", "/system.slice/systemd-logind.service", True),
        ("systemd", "/init.scope", True),
        ("systemd", "/user.slice/user-1000.slice/user@1000.service/init.scope", True),
        ("gdm-session-wor", "/user.slice/user-42.slice/session-c1.scope", True),
        ("seatd", "/system.slice/seatd.service", True),
        ("helper", "/system.slice/systemd-logind.service/", True),  # by its unit
        ("gnome-shell", "/user.slice/user-1000.slice/session-2.scope", False),
        ("Xorg", "/system.slice/lightdm.service", False),  # lightdm's X server is a client
        ("lightdm", "/system.slice/lightdm.service", True),
        ("python3", "/system.slice/docker-" + "a" * 64 + ".scope", False),
        ("systemd-x", "/", False),
    ],
)
def test_is_broker(comm: str, cgroup: str, expected: bool) -> None:
    assert is_broker(comm, cgroup) is expected


def test_logind_does_not_name_a_session_client(rec_fixtures: Path) -> None:
    """logind (pid 812) holds the DRM fd of GNOME Shell (pid 2301): the shell names it."""
    processes = {
        812: Proc("systemd-logind", _cg(rec_fixtures, "broker-logind.txt")),
        2301: Proc("gnome-shell", _cg(rec_fixtures, "gnome-shell.txt")),
    }
    assert naming_pid({812, 2301}, processes) == 2301


LOGIND = Proc("systemd-logind", "/system.slice/systemd-logind.service")
PID1 = Proc("systemd", "/init.scope")
XORG = Proc("Xorg", "/system.slice/lightdm.service")
SHELL = Proc("gnome-shell", "/user.slice/user-1000.slice/session-2.scope")
VLLM = Proc("python3", "/system.slice/docker-" + "a" * 64 + ".scope")
SEAT_BOX = "/system.slice/docker-" + "b" * 64 + ".scope"
SEATD = Proc("seatd", SEAT_BOX)  # a seat manager in a container
SEAT_LAUNCH = Proc("seatd-launch", SEAT_BOX)  # its launcher, not a broker by name


@pytest.mark.parametrize(
    ("pids", "processes", "expected"),
    [
        ({1, 812, 2301}, {1: PID1, 812: LOGIND, 2301: SHELL}, 2301),
        ({1, 5000}, {1: PID1, 5000: VLLM}, 5000),  # pid 1's fd store
        ({812}, {812: LOGIND}, 812),  # a broker alone is named after itself
        ({1, 812}, {1: PID1, 812: LOGIND}, 1),  # brokers only: the lowest pid
        # a process in a broker's cgroup (or container) is the broker's, whatever its comm
        ({30, 31, 2301}, {30: SEATD, 31: SEAT_LAUNCH, 2301: SHELL}, 2301),
        ({30, 31}, {30: SEATD, 31: SEAT_LAUNCH}, 31),  # else any non-broker
        ({100, 2301, 2400}, {100: LOGIND, 2301: SHELL, 2400: VLLM}, 2301),  # lowest of the rest
        ({100, 2301}, {2301: SHELL}, 2301),  # an unreadable pid is not chosen
        ({100, 2301}, {}, 100),  # nothing readable: the lowest pid
        ({7, 3}, {7: SHELL, 3: VLLM}, 3),  # no broker: the lowest pid, as before
        ({812, 900}, {812: LOGIND, 900: XORG}, 900),  # logind's copy of Xorg's master fd
    ],
)
def test_naming_pid(pids: set[int], processes: dict[int, Proc], expected: int) -> None:
    assert naming_pid(pids, processes) == expected


def test_naming_pid_needs_a_pid() -> None:
    with pytest.raises(ValueError) as info:
        naming_pid([], {})
    assert str(info.value) == "a DRM client without a pid"


# --- the fd-target cache key when /proc/<pid>/ns/mnt cannot be read -------------------------


def test_scan_with_the_key_does_not_share_unknown_namespaces(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """Two processes whose namespaces cannot be read show the same link text ``../gpu``
    for different files (as ``/dev/dri/renderD128`` in two containers may be): with one
    cache key for both, the first answer is reused for the second.  The scanner keys its
    cache on ``ns/mnt``, and where that cannot be read, on the process alone."""
    t = rec_tree
    for pid, drm in ((400, False), (401, True), (402, False)):
        base = t.process(pid, comm=f"p{pid}")
        (base / "gpu").symlink_to(t.node if drm else t.plain)
        (base / "fd" / "3").symlink_to("../gpu")  # relative: resolves per process
        (base / "fdinfo" / "3").write_text(
            rec_make_fdinfo(9) if drm else "pos:\t0\nflags:\t0100000\nmnt_id:\t1\nino:\t2\n"
        )
    assert not os.path.exists(base / "ns" / "mnt")

    scan = scan_proc(str(t.root), t.is_drm)

    assert [(k, c.pids) for k, c in scan.clients.items()] == [(("0000:03:00.0", 9), {401})]
    assert (scan.stats.drm_descriptors, scan.stats.not_clients) == (1, 0)
