"""``kernel_info`` with a simulated root and a stubbed rpm."""

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
from ansible.module_utils import basic  # type: ignore[import-untyped]
from ansible_collections.cardshare.gpuhost.plugins.module_utils._kernel import RPM_QUERY_FORMAT
from ansible_collections.cardshare.gpuhost.plugins.modules import kernel_info
from gpuhost_sim import FIXTURES, NEW_KERNEL, OLD_KERNEL, FailJson, Sim

REPO = Path(__file__).resolve().parents[4]
RPM_OUT = (FIXTURES / "rpm_query.txt").read_text()
RH_ONLY = "".join(line + "\n" for line in RPM_OUT.splitlines() if "elrepo" not in line)
ML_MESSAGE = (
    "the newest installed kernel kernel-ml 6.17.8-1.el10.elrepo.x86_64 (vendor: The ELRepo "
    "Project) is not signed by the distribution vendor; under Secure Boot the firmware rejects "
    "it before userspace (a self-enrolled MOK did not help either); remove it or boot a vendor "
    "kernel"
)


@pytest.fixture
def rpm_stub(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[list[str]]]:
    """Make ``rpm`` answer with the given output; returns the list of commands run."""

    def install(stdout: str, rc: int = 0, stderr: str = "") -> list[list[str]]:
        calls: list[list[str]] = []

        def run_command(_self: Any, cmd: list[str], **_kwargs: Any) -> tuple[int, str, str]:
            calls.append(cmd)
            return rc, stdout, stderr

        monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)
        monkeypatch.setattr(
            basic.AnsibleModule, "get_bin_path", lambda _self, name, **_kw: f"/usr/bin/{name}"
        )
        return calls

    return install


def args_for(s: Sim, **extra: Any) -> dict[str, Any]:
    return {"host_root": str(s.root), **extra}


@pytest.mark.parametrize(
    ("running", "stdout", "secure_boot", "newest", "reboot", "problems"),
    [
        pytest.param(OLD_KERNEL, RH_ONLY, 1, NEW_KERNEL, True, [], id="update-installed"),
        pytest.param(NEW_KERNEL, RH_ONLY, 1, NEW_KERNEL, False, [], id="after-reboot"),
        pytest.param(
            NEW_KERNEL,
            RPM_OUT,
            1,
            "6.17.8-1.el10.elrepo.x86_64",
            True,
            [ML_MESSAGE],
            id="kernel-ml-under-secure-boot",
        ),
        pytest.param(
            NEW_KERNEL, RPM_OUT, 0, "6.17.8-1.el10.elrepo.x86_64", True, [], id="kernel-ml-no-sb"
        ),
    ],
)
def test_kernel_info(
    sim: Callable[..., Sim],
    run_module: Callable[..., dict[str, Any]],
    rpm_stub: Callable[..., list[list[str]]],
    running: str,
    stdout: str,
    secure_boot: int,
    newest: str,
    reboot: bool,
    problems: list[str],
) -> None:
    s = sim(running=running, secure_boot=secure_boot, devices=False)
    calls = rpm_stub(stdout, rc=1)
    result = run_module(kernel_info.main, args_for(s))
    assert calls == [
        [
            "/usr/bin/rpm",
            "-q",
            "--qf",
            RPM_QUERY_FORMAT,
            "kernel-core",
            "kernel-ml-core",
            "kernel-ml",
            "kernel-lt-core",
            "kernel-lt",
        ]
    ]
    assert result["changed"] is False
    assert result["running_kernel"] == running
    assert result["boot_id"] == "4f1c2a9e-0d1b-4a57-9a43-6c1f0e5b7d21"
    assert result["newest_kernel"] == newest
    assert result["reboot_needed"] is reboot
    assert result["running_is_newest"] is (not reboot)
    assert result["newest_trusted_kernel"] == NEW_KERNEL
    assert result["secure_boot"]["enabled"] is bool(secure_boot)
    assert result["problems"] == problems
    assert result["missing_packages"] == ["kernel-ml-core"]


def test_package_alias_and_trusted_vendors(
    sim: Callable[..., Sim],
    run_module: Callable[..., dict[str, Any]],
    rpm_stub: Callable[..., list[list[str]]],
) -> None:
    s = sim(secure_boot=1, devices=False)
    calls = rpm_stub(RPM_OUT)
    result = run_module(
        kernel_info.main,
        args_for(s, package=["kernel-core", "kernel-ml"], trusted_vendors=["The ELRepo Project"]),
    )
    assert calls[0][4:] == ["kernel-core", "kernel-ml"]
    assert result["problems"] == []
    assert [k["vendor"] for k in result["untrusted_kernels"]] == ["Red Hat, Inc.", "Red Hat, Inc."]


def test_legacy_boot(
    sim: Callable[..., Sim],
    run_module: Callable[..., dict[str, Any]],
    rpm_stub: Callable[..., list[list[str]]],
) -> None:
    s = sim(secure_boot=None, devices=False)
    rpm_stub(RPM_OUT)
    result = run_module(kernel_info.main, args_for(s))
    assert result["secure_boot"] == {
        "enabled": False,
        "efi": False,
        "detail": "no efivars: legacy BIOS boot, Secure Boot is not available (disabled)",
    }
    assert result["problems"] == []


@pytest.mark.parametrize(
    ("stdout", "rc", "stderr", "remove", "message"),
    [
        (
            "",
            1,
            "error: cannot open Packages database in /var/lib/rpm\n",
            None,
            "rpm -q failed (rc=1): error: cannot open Packages database in /var/lib/rpm",
        ),
        (
            "kernel-core 6.12.0\n",
            0,
            "",
            None,
            "rpm query line 1: expected 7 tab-separated fields, got 1: 'kernel-core 6.12.0'",
        ),
        (
            RPM_OUT,
            0,
            "",
            "proc/sys/kernel/osrelease",
            "cannot read the running kernel from {root}/proc/sys/kernel/osrelease",
        ),
    ],
)
def test_failures(
    sim: Callable[..., Sim],
    run_module: Callable[..., dict[str, Any]],
    rpm_stub: Callable[..., list[list[str]]],
    stdout: str,
    rc: int,
    stderr: str,
    remove: str | None,
    message: str,
) -> None:
    s = sim(devices=False)
    if remove:
        (s.root / remove).unlink()
    rpm_stub(stdout, rc=rc, stderr=stderr)
    with pytest.raises(FailJson) as err:
        run_module(kernel_info.main, args_for(s))
    assert err.value.result["msg"] == message.format(root=s.root)


def test_bad_secure_boot_variable_fails(
    sim: Callable[..., Sim],
    run_module: Callable[..., dict[str, Any]],
    rpm_stub: Callable[..., list[list[str]]],
) -> None:
    s = sim(devices=False)
    var = s.root / "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
    var.write_bytes(b"\x06\x00")
    rpm_stub(RPM_OUT)
    with pytest.raises(FailJson) as err:
        run_module(kernel_info.main, args_for(s))
    assert err.value.result["msg"] == (
        "SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c: expected 4 attribute bytes and "
        "1 data byte, got 2 bytes"
    )


def test_module_runs_as_a_program(sim: Callable[..., Sim], tmp_path: Path) -> None:
    """The module file run as Ansible runs it, with an ``rpm`` on PATH that prints a fixture."""
    s = sim(running=OLD_KERNEL, secure_boot=1, devices=False)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shutil.copy(FIXTURES / "rpm_query.txt", tmp_path / "rpm.out")
    rpm = bindir / "rpm"
    rpm.write_text(f"#!/bin/sh\ncat '{tmp_path / 'rpm.out'}'\nexit 1\n")
    rpm.chmod(0o755)
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args_for(s)}))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / ".cache" / "collections"),
        "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
    }
    proc = subprocess.run(
        [sys.executable, str(REPO / "plugins/modules/kernel_info.py"), str(args)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["reboot_needed"] is True
    assert result["problems"] == [ML_MESSAGE]
