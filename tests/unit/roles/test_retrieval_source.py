"""The retrieval role's reading of the export (``tasks/source.yml``) by ``ansible-playbook`` on
a copy of the lab's export (``lab/fixtures/ovms-export``) read in place
(``retrieval_repository_remote``): the servables of either list of ``config.json``, their
graphs where the server looks for them, each graph's settings and the rerank graph's guards.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from role_playbook import ROOT, WRITE_OUTCOMES, run_cases

EXPORT = ROOT / "lab" / "fixtures" / "ovms-export"
FIXTURES = ROOT / "tests" / "fixtures" / "ovms"
RERANK = "bge-reranker-v2-m3"

PLAYBOOK = (
    """\
---
- name: Read the export
  hosts: all
  gather_facts: false
  tasks:
    - name: Run source.yml, keeping its outcome or its failure
      block:
        - name: Run source.yml
          ansible.builtin.include_role:
            name: cardshare.gpuhost.retrieval
            tasks_from: source

        - name: Keep the outcome
          ansible.builtin.set_fact:
            case_outcome:
              servables: "{{ __retrieval_servables }}"
              overrides: "{{ __retrieval_overrides.keys() | list }}"
      rescue:
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome:
              # a looped assert fails with "One or more items failed": its items say why
              failed: >-
                {{ ansible_failed_result.results | default([]) | selectattr('failed', 'defined')
                   | selectattr('failed') | map(attribute='msg') | join(' ')
                   or ansible_failed_result.msg }}

"""
    + WRITE_OUTCOMES
)


def _mediapipe(tree: Path) -> None:
    shutil.copy(FIXTURES / "config.mediapipe.json", tree / "config.json")


def _graph_path(tree: Path) -> None:
    (tree / RERANK / "graph.pbtxt").rename(tree / RERANK / "rerank.pbtxt")
    document = json.loads((tree / "config.json").read_text())
    document["model_config_list"][1]["config"]["graph_path"] = "rerank.pbtxt"
    (tree / "config.json").write_text(json.dumps(document))


def _no_model_list(tree: Path) -> None:
    document = json.loads((FIXTURES / "config.mediapipe.json").read_text())
    del document["model_config_list"]
    (tree / "config.json").write_text(json.dumps(document))


def _not_a_graph(tree: Path) -> None:
    (tree / RERANK / "graph.pbtxt").unlink()


CHANGES = {
    "mediapipe": _mediapipe,
    "graph_path": _graph_path,
    "no_model_list": _no_model_list,
    "not_a_graph": _not_a_graph,
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("retrieval-source")
    hosts = {}
    for case, change in CHANGES.items():
        export = work / "exports" / case
        shutil.copytree(EXPORT, export)
        change(export / "gpu")
        hosts[case] = {
            "retrieval_repository_src": str(export),
            "retrieval_repository_remote": True,
            "retrieval_repository_revision": "test-r1",
            "retrieval_device": "card",
            "retrieval_data_dir": str(work / "data" / case),
        }
    return run_cases(work / "run", PLAYBOOK, hosts)


def test_a_config_with_only_the_mediapipe_list_is_read(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["mediapipe"]
    assert "failed" not in outcome, outcome
    assert sorted(outcome["servables"]) == ["bge-m3", RERANK]
    assert outcome["servables"][RERANK]["list"] == "mediapipe_config_list"
    assert outcome["overrides"] == [f"{RERANK}/graph.pbtxt"]


def test_a_graph_path_is_where_the_guards_go(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["graph_path"]
    assert "failed" not in outcome, outcome
    assert outcome["overrides"] == [f"{RERANK}/rerank.pbtxt"]


def test_a_config_the_server_refuses_is_refused_naming_it(outcomes: dict[str, Any]) -> None:
    failed = outcomes["no_model_list"].get("failed", "")
    assert "gpu/config.json has no model_config_list list (None)" in failed
    assert '"model_config_list": []' in failed


def test_a_servable_without_its_graph_is_named(outcomes: dict[str, Any]) -> None:
    failed = outcomes["not_a_graph"].get("failed", "")
    assert f"{RERANK}: config.json lists it (model_config_list)" in failed
    assert f"gpu/{RERANK}/graph.pbtxt cannot be read" in failed
