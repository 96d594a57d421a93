"""What a user of kernel_release cares about, read on the lab host after converge."""

import json

ROOT = "/srv/cardshare-sim"


def newest_installed(host):
    out = host.check_output(
        "rpm -q kernel-core --qf '%{VERSION}-%{RELEASE}.%{ARCH}\\n' | sort -V | tail -n 1"
    )
    return out.strip()


def test_release_is_pinned_to_target(host):
    assert host.check_output("subscription-manager release --show") == "Release: 10.2"
    state = json.loads(host.file("/var/lib/rhsm/cache/releasever.json").content_string)
    assert state["releaseVer"] == "10.2"


def test_kernel_from_10_2_is_installed_beside_the_old_one(host):
    kernels = host.check_output("rpm -q kernel-core").splitlines()
    assert "kernel-core-6.12.0-211.5.1.el10_2.x86_64" in kernels
    assert "kernel-core-6.12.0-55.9.1.el10_0.x86_64" in kernels


def test_newest_installed_kernel_is_running(host):
    running = host.file(f"{ROOT}/proc/sys/kernel/osrelease").content_string.strip()
    assert running == newest_installed(host) == "6.12.0-211.5.1.el10_2.x86_64"


def test_new_kernel_knows_the_card(host):
    alias = host.file("/lib/modules/6.12.0-211.5.1.el10_2.x86_64/modules.alias")
    assert "alias pci:v00008086d0000E223sv*sd*bc03sc*i* xe" in alias.content_string


def test_the_simulated_boot_bound_the_card_to_xe(host):
    # the lab's boot (SIMULATION) binds the card when the running kernel's alias table lists it
    log = host.check_output("journalctl -b -u cardshare-sim-boot --no-pager -o cat")
    assert "booted 6.12.0-211.5.1.el10_2.x86_64" in log
    assert "driver=xe" in log


def test_the_whole_system_moved_and_the_host_reports_the_release(host):
    # kernel_release_update_scope defaults to all: the release package moved with the kernel
    assert host.package("redhat-release").version == "10.2"
    assert 'VERSION_ID="10.2"' in host.file("/etc/os-release").content_string.splitlines()
    assert host.file("/etc/redhat-release").content_string.startswith(
        "Red Hat Enterprise Linux release 10.2"
    )
    assert (
        host.ansible("setup", "filter=ansible_distribution_version")["ansible_facts"][
            "ansible_distribution_version"
        ]
        == "10.2"
    )
