"""The recorder role's choice of interpreter (roles/recorder/tasks/interpreter.yml).

Every case runs the role's own task file with ``ansible-playbook`` on localhost (one run for
the whole table, a case per inventory host), against fake interpreters in a directory of its
own: shell scripts that print a version, as ``python -c "print('%d.%d' % sys.version_info[:2])"``
does, standing for the default ``recorder_python_candidates`` (``/usr/bin/python3``,
``python3.13``, ``python3.12``, ``python3.11``). The choice changes nothing on the host, so the
cases that need a package show the package the install phase would install, uninstalled.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from role_playbook import ROOT, WRITE_OUTCOMES, run_cases

# The names of the default candidates, in their order.
CANDIDATES = ["python3", "python3.13", "python3.12", "python3.11"]

PLAYBOOK = (
    """\
---
- name: Run a part of the recorder role and write what it decided
  hosts: all
  gather_facts: false
  tasks:
    - name: Give the case the os_family a gathering would give
      ansible.builtin.set_fact:
        os_family: "{{ case_os_family }}"
        cacheable: true
      when: case_os_family is defined

    - name: Run the role's tasks and keep the decision or the failure
      block:
        # an include for each tasks file: one templated tasks_from would give every host the file
        # of the host whose result Ansible processed first
        - name: Include the role's interpreter tasks
          ansible.builtin.include_role:
            name: cardshare.gpuhost.recorder
            tasks_from: interpreter
          when: case_entry is not defined

        - name: Include the role's preflight
          ansible.builtin.include_role:
            name: cardshare.gpuhost.recorder
            tasks_from: preflight
          when: case_entry is defined

        - name: Keep the decision
          ansible.builtin.set_fact:
            case_outcome:
              resolved: "{{ __recorder_python_resolved }}"
              install: "{{ __recorder_python_install }}"
      rescue:
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome:
              failed: "{{ ansible_failed_result.msg }}"

"""
    + WRITE_OUTCOMES
)

# (case id, fake interpreters {name: printed version, "exit 1" or "noexec"},
#  role variables ("{bin}" is the fakes' directory), os_family (None: facts not gathered),
#  expected decision)
CHOICE_CASES: list[tuple[str, dict[str, str], dict[str, Any], str | None, dict[str, str]]] = [
    (
        "el9-python3-is-3.9-and-3.12-installed",
        {"python3": "3.9", "python3.12": "3.12"},
        {},
        "RedHat",
        {"resolved": "{bin}/python3.12", "install": ""},
    ),
    (
        "python3-is-3.11",
        {"python3": "3.11", "python3.12": "3.12"},
        {},
        "RedHat",
        {"resolved": "{bin}/python3", "install": ""},
    ),
    (
        "el10-python3-is-3.12",
        {"python3": "3.12"},
        {},
        "RedHat",
        {"resolved": "{bin}/python3", "install": ""},
    ),
    (
        "first-new-enough-in-order",
        {"python3": "3.9", "python3.13": "3.13", "python3.12": "3.12", "python3.11": "3.11"},
        {},
        "RedHat",
        {"resolved": "{bin}/python3.13", "install": ""},
    ),
    (
        "a-candidate-that-fails-is-passed-over",
        {"python3": "exit 1", "python3.11": "3.11"},
        {},
        "Debian",
        {"resolved": "{bin}/python3.11", "install": ""},
    ),
    (
        "none-new-enough-on-redhat-installs-the-package",
        {"python3": "3.9"},
        {},
        "RedHat",
        {"resolved": "/usr/bin/python3.12", "install": "python3.12"},
    ),
    (
        "none-at-all-on-redhat-installs-the-package",
        {},
        {},
        "RedHat",
        {"resolved": "/usr/bin/python3.12", "install": "python3.12"},
    ),
    (
        "the-package-is-a-variable",
        {"python3": "3.9"},
        {"recorder_python_package": "python3.11"},
        "RedHat",
        {"resolved": "/usr/bin/python3.11", "install": "python3.11"},
    ),
    (
        "an-explicit-path-is-used-as-it-is",
        {"python3": "3.9", "python3.12": "3.12", "mine": "3.11"},
        {"recorder_python": "{bin}/mine"},
        "RedHat",
        {"resolved": "{bin}/mine", "install": ""},
    ),
]

# (case id, fake interpreters, role variables, os_family, the exact failure message)
FAILURE_CASES: list[tuple[str, dict[str, str], dict[str, Any], str | None, str]] = [
    (
        "explicit-path-too-old",
        {"python3": "3.9", "python3.12": "3.12"},
        {"recorder_python": "{bin}/python3"},
        "RedHat",
        "recorder_python is '{bin}/python3', which is Python 3.9: the recorder needs Python 3.11"
        " or newer (set recorder_python to auto, or point it at one).",
    ),
    (
        "explicit-path-fails",
        {"python3": "exit 1"},
        {"recorder_python": "{bin}/python3"},
        "RedHat",
        "recorder_python is '{bin}/python3', which does not run: boom: the recorder needs Python"
        " 3.11 or newer (set recorder_python to auto, or point it at one).",
    ),
    (
        "explicit-path-missing",
        {"python3.12": "3.12"},
        {"recorder_python": "{bin}/python2.7"},
        "RedHat",
        "recorder_python is '{bin}/python2.7', which is missing: the recorder needs Python 3.11"
        " or newer (set recorder_python to auto, or point it at one).",
    ),
    (
        "none-new-enough-elsewhere",
        {"python3": "3.9", "python3.12": "noexec", "python3.11": "exit 1"},
        {},
        "Debian",
        "recorder_python is 'auto', but no interpreter of recorder_python_candidates is Python"
        " 3.11 or newer ({bin}/python3 is Python 3.9, {bin}/python3.13 is missing, {bin}/python3.12"
        " is not executable, {bin}/python3.11 does not run: boom), and"
        " the role installs recorder_python_package only on RedHat-family hosts (this one is"
        " Debian): install Python 3.11 or newer and set recorder_python to its path (or add it to"
        " recorder_python_candidates).",
    ),
    (
        "none-new-enough-without-facts",
        {"python3": "3.9"},
        {"recorder_python_candidates": ["{bin}/python3"]},
        None,
        "recorder_python is 'auto', but no interpreter of recorder_python_candidates is Python"
        " 3.11 or newer ({bin}/python3 is Python 3.9), and the role installs"
        " recorder_python_package only on RedHat-family hosts (this one is unknown: facts not"
        " gathered): install Python 3.11 or newer and set recorder_python to its path (or add it"
        " to recorder_python_candidates).",
    ),
    (
        "relative-path",
        {},
        {"recorder_python": "python3"},
        "RedHat",
        "recorder_python is 'python3': give auto (the role finds Python 3.11 or newer, or installs"
        " recorder_python_package) or an absolute path without spaces, quotes, '%', '$', ';', '`'"
        " or backslashes.",
    ),
    (
        "package-too-old",
        {"python3": "3.9"},
        {"recorder_python_package": "python3.9"},
        "RedHat",
        "recorder_python_package is 'python3.9': give the package that installs"
        " /usr/bin/python3.N for a Python 3.11 or newer, such as python3.12 (EL 9 AppStream), or"
        " set recorder_python to the path of an interpreter.",
    ),
    (
        "package-not-a-python3.N",
        {"python3": "3.9"},
        {"recorder_python_package": "rh-python38"},
        "RedHat",
        "recorder_python_package is 'rh-python38': give the package that installs"
        " /usr/bin/python3.N for a Python 3.11 or newer, such as python3.12 (EL 9 AppStream), or"
        " set recorder_python to the path of an interpreter.",
    ),
    (
        "candidate-not-absolute",
        {"python3": "3.12"},
        {"recorder_python_candidates": ["{bin}/python3", "python3.12"]},
        "RedHat",
        "recorder_python_candidates is ['{bin}/python3', 'python3.12']: give a list of absolute"
        " paths without spaces, quotes, '%', '$', ';', '`' or backslashes, such as"
        " ['/usr/bin/python3', '/usr/bin/python3.12'].",
    ),
]


def fake_interpreters(directory: Path, versions: dict[str, str]) -> list[str]:
    """Write ``directory/<name>`` for each name of ``versions``: a script that prints the
    version, or that prints ``boom`` to stderr and exits 1 (``"exit 1"``), or a file without
    the executable bit (``"noexec"``). Returns the paths of the default
    candidates' names in ``directory``, in order, the missing ones included."""
    directory.mkdir(parents=True)
    for name, version in versions.items():
        body = "echo boom >&2; exit 1" if version == "exit 1" else f"echo {version}"
        script = directory / name
        script.write_text(f"#!/bin/sh\n{body}\n", encoding="utf-8")
        script.chmod(0o644 if version == "noexec" else 0o755)
    return [str(directory / name) for name in CANDIDATES]


def with_bin(value: Any, bindir: Path) -> Any:
    """``value`` with ``{bin}`` replaced by ``bindir`` in its strings."""
    if isinstance(value, str):
        return value.replace("{bin}", str(bindir))
    if isinstance(value, list):
        return [with_bin(v, bindir) for v in value]
    if isinstance(value, dict):
        return {k: with_bin(v, bindir) for k, v in value.items()}
    return value


def host_vars(
    bindir: Path, versions: dict[str, str], role_vars: dict[str, Any], os_family: str | None
) -> dict[str, Any]:
    """A case's host variables: the fakes as candidates (unless the case gives its own), the
    case's role variables and its os_family."""
    case: dict[str, Any] = {
        "recorder_python_candidates": fake_interpreters(bindir, versions),
        **with_bin(role_vars, bindir),
    }
    if os_family is not None:
        case["case_os_family"] = os_family
    return case


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Every case of the two tables (and the preflight one), run once: {case id: (the fakes'
    directory, what the playbook wrote)}."""
    base = tmp_path_factory.mktemp("recorder-python")
    cases: dict[str, dict[str, Any]] = {}
    bindirs: dict[str, Path] = {}
    for i, (case_id, versions, role_vars, os_family, _) in enumerate(CHOICE_CASES + FAILURE_CASES):
        bindirs[case_id] = base / f"case{i}"
        cases[case_id] = host_vars(bindirs[case_id], versions, role_vars, os_family)
    if shutil.which("systemd-analyze") is not None:
        # the whole preflight entry point, argument spec included, on an EL 9 host
        bindirs["preflight"] = base / "preflight"
        cases["preflight"] = {
            **host_vars(bindirs["preflight"], {"python3": "3.9"}, {}, "RedHat"),
            "case_entry": "preflight",
        }
    got = run_cases(base / "run", PLAYBOOK, cases)
    return {case_id: (bindirs[case_id], got[case_id]) for case_id in cases}


@pytest.mark.parametrize(
    ("case_id", "expected"),
    [(case[0], case[4]) for case in CHOICE_CASES],
    ids=[case[0] for case in CHOICE_CASES],
)
def test_choice(
    outcomes: dict[str, tuple[Path, Any]], case_id: str, expected: dict[str, str]
) -> None:
    bindir, got = outcomes[case_id]
    assert got == with_bin(expected, bindir)


@pytest.mark.parametrize(
    ("case_id", "message"),
    [(case[0], case[4]) for case in FAILURE_CASES],
    ids=[case[0] for case in FAILURE_CASES],
)
def test_failure(outcomes: dict[str, tuple[Path, Any]], case_id: str, message: str) -> None:
    bindir, got = outcomes[case_id]
    assert got == {"failed": with_bin(message, bindir)}


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="the preflight entry point checks the timer's calendar with systemd-analyze",
)
def test_preflight_entry_point_decides_the_package(
    outcomes: dict[str, tuple[Path, Any]],
) -> None:
    """The whole preflight entry point (argument spec included) accepts the defaults and, on
    an EL 9 host whose python3 is 3.9, decides on the package; preflight installs nothing."""
    _, got = outcomes["preflight"]
    assert got == {"resolved": "/usr/bin/python3.12", "install": "python3.12"}


def test_the_host_runs_the_decision() -> None:
    """What runs on the host is the decided interpreter, never recorder_python itself (the
    unit's ExecStart, the command, the rules' validation), and the install phase installs the
    decided package with dnf, on RedHat-family hosts only."""
    role = ROOT / "roles" / "recorder"
    uses = {
        "templates/cardshare-recorder.service.j2": "ExecStart={{ __recorder_python_resolved }} ",
        "templates/cardshare.sh.j2": "exec {{ __recorder_python_resolved | quote }} ",
        "tasks/configure.yml": "{{ __recorder_python_resolved }} -c ",
    }
    for path, use in uses.items():
        text = (role / path).read_text(encoding="utf-8")
        assert use in text, path
        assert "{{ recorder_python" not in text, path
    install = yaml.safe_load((role / "tasks" / "install.yml").read_text(encoding="utf-8"))
    assert install[0]["when"] == "__recorder_python_install | length > 0"
    dnf = [task for task in install[0]["block"] if "ansible.builtin.dnf" in task]
    assert dnf == [
        {
            "name": "Install the package {{ __recorder_python_install }}",
            "ansible.builtin.dnf": {"name": "{{ __recorder_python_install }}", "state": "present"},
            "when": "ansible_facts['os_family'] == 'RedHat'",
        }
    ]
