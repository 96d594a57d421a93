"""The arbiter role's optional Grafana dashboard (``arbiter_grafana_dashboard_dir``): the role's
preflight and its ``grafana.yml`` tasks run with ``ansible-playbook`` on localhost against a
directory made in the test's own directory. The dashboard lands there as the collection ships
it, mode 0644; a second run changes nothing; ``arbiter_state: absent`` removes it; a relative
path or a directory that does not exist is refused with the variable, its value and the fix."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from role_playbook import ROOT, WRITE_OUTCOMES, run_cases

DASHBOARD = ROOT / "extras" / "grafana" / "cardshare.json"

PLAYBOOK = (
    """\
---
- name: Install the arbiter's Grafana dashboard twice, then remove it twice
  hosts: all
  gather_facts: false
  tasks:
    - name: Run the role's tasks and keep what each run changed
      block:
        - name: Include the role's preflight
          ansible.builtin.include_role:
            name: cardshare.gpuhost.arbiter
            tasks_from: preflight

        - name: Install the dashboard
          ansible.builtin.include_role:
            name: cardshare.gpuhost.arbiter
            tasks_from: grafana

        - name: Keep the first run's change
          ansible.builtin.set_fact:
            case_first: "{{ __arbiter_grafana_copy.changed }}"

        - name: Install the dashboard again
          ansible.builtin.include_role:
            name: cardshare.gpuhost.arbiter
            tasks_from: grafana

        - name: Read the installed dashboard
          ansible.builtin.stat:
            path: "{{ arbiter_grafana_dashboard_dir }}/cardshare.json"
            checksum_algorithm: sha256
          register: case_installed

        - name: Keep the second run's change and the file
          ansible.builtin.set_fact:
            case_second: "{{ __arbiter_grafana_copy.changed }}"
            case_file: "{{ case_installed.stat }}"

        - name: Remove the dashboard
          ansible.builtin.include_role:
            name: cardshare.gpuhost.arbiter
            tasks_from: grafana
          vars:
            arbiter_state: absent

        - name: Keep the removal's change
          ansible.builtin.set_fact:
            case_removed: "{{ __arbiter_grafana_removed.changed }}"

        - name: Remove the dashboard again
          ansible.builtin.include_role:
            name: cardshare.gpuhost.arbiter
            tasks_from: grafana
          vars:
            arbiter_state: absent

        - name: Read the directory after the removal
          ansible.builtin.stat:
            path: "{{ arbiter_grafana_dashboard_dir }}/cardshare.json"
          register: case_after

        - name: Keep the outcome
          ansible.builtin.set_fact:
            case_outcome:
              first_changed: "{{ case_first }}"
              second_changed: "{{ case_second }}"
              mode: "{{ case_file.mode }}"
              sha256: "{{ case_file.checksum }}"
              removed_changed: "{{ case_removed }}"
              removed_again_changed: "{{ __arbiter_grafana_removed.changed }}"
              left: "{{ case_after.stat.exists }}"
      rescue:
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome:
              failed: "{{ ansible_failed_result.msg }}"

"""
    + WRITE_OUTCOMES
)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    work = tmp_path_factory.mktemp("arbiter-grafana")
    provider = work / "grafana" / "dashboards"
    trailing = work / "trailing" / "dashboards"  # each good case its own directory
    for made in (provider, trailing):
        made.mkdir(parents=True)
    cases = {
        "installs": {"arbiter_grafana_dashboard_dir": str(provider)},
        "with-a-trailing-slash": {"arbiter_grafana_dashboard_dir": f"{trailing}/"},
        "relative": {"arbiter_grafana_dashboard_dir": "grafana/dashboards"},
        "missing": {"arbiter_grafana_dashboard_dir": str(work / "no-grafana")},
    }
    return work, run_cases(work / "run", PLAYBOOK, cases)


@pytest.mark.parametrize("case", ["installs", "with-a-trailing-slash"])
def test_the_dashboard_lands_once_and_leaves_with_absent(
    outcomes: tuple[Path, dict[str, Any]], case: str
) -> None:
    _, got = outcomes
    assert got[case] == {
        "first_changed": True,
        "second_changed": False,
        "mode": "0644",
        "sha256": hashlib.sha256(DASHBOARD.read_bytes()).hexdigest(),
        "removed_changed": True,
        "removed_again_changed": False,
        "left": False,
    }


def test_a_relative_directory_is_refused_by_preflight(
    outcomes: tuple[Path, dict[str, Any]],
) -> None:
    _, got = outcomes
    message = got["relative"]["failed"]
    assert "arbiter_grafana_dashboard_dir is 'grafana/dashboards'" in message
    assert "give the absolute directory" in message


def test_a_directory_that_does_not_exist_is_refused_before_the_copy(
    outcomes: tuple[Path, dict[str, Any]],
) -> None:
    work, got = outcomes
    message = got["missing"]["failed"]
    assert f"arbiter_grafana_dashboard_dir is '{work / 'no-grafana'}'" in message
    assert "not a directory" in message and "install Grafana first" in message
    assert not (work / "no-grafana").exists()
