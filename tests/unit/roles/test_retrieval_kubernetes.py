"""The retrieval role's ``kubernetes`` entry point, run by ``ansible-playbook`` on the
controller with ``retrieval_k8s_apply`` false (no cluster runs here): the files it writes
are the manifests, valid for the official schemas of Kubernetes 1.34 and 1.35, carrying the
single-box path's memory limit and command; a claim on memory is refused before anything
is written, naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped,unused-ignore]
import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_memory import (
    retrieval_memory_plan,
)
from role_playbook import WRITE_OUTCOMES, run_cases

# one play per case: the entry point runs once per play, on the controller
PLAY = """\
- name: Render the retrieval tier for Kubernetes ({case})
  hosts: {case}
  gather_facts: false
  tasks:
    - name: Run the entry point, keeping its outcome or its failure
      block:
        - name: Run the kubernetes entry point
          ansible.builtin.include_role:
            name: cardshare.gpuhost.retrieval
            tasks_from: kubernetes

        - name: Keep the outcome
          ansible.builtin.set_fact:
            case_outcome: {{rendered: true}}
      rescue:
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome:
              failed: "{{{{ ansible_failed_result.msg | default(ansible_failed_result) }}}}"

"""
FINAL = """\
- name: Collect the outcomes
  hosts: all
  gather_facts: false
  tasks:
"""

CEL = 'device.capacity["gpu.intel.com"].memory.compareTo(quantity("2Gi")) >= 0'
COMMON = {
    "retrieval_repository_revision": "2026.2.1-r3",
    "retrieval_k8s_model_image": "registry.example/ovms-retrieval-models:2026.2.1-r3",
    "retrieval_max_allowed_chunks": 32,
}


CEL_REQUEST = {"selectors": [{"cel": {"expression": CEL}}]}
CASES: dict[str, dict[str, Any]] = {
    "lab": {"retrieval_k8s_storage_class": "longhorn"},
    "cel": {"retrieval_k8s_claim_request": CEL_REQUEST},
    "capacity": {"retrieval_k8s_claim_request": {"capacity": {"requests": {"memory": "2Gi"}}}},
    "no_model_image": {"retrieval_k8s_model_image": ""},
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    work = tmp_path_factory.mktemp("retrieval-kubernetes")
    playbook = "---\n" + "".join(PLAY.format(case=c) for c in CASES) + FINAL + WRITE_OUTCOMES
    cases = {
        name: {**COMMON, **values, "retrieval_k8s_render_dir": str(work / "rendered" / name)}
        for name, values in CASES.items()
    }
    found = run_cases(work / "run", playbook, cases)
    return {name: (found[name], work / "rendered" / name) for name in CASES}


def test_the_entry_point_writes_valid_manifests(outcomes: dict[str, tuple[Any, Path]]) -> None:
    outcome, render = outcomes["lab"]
    assert outcome == {"rendered": True}, outcome
    files = {p.name: list(yaml.safe_load_all(p.read_text())) for p in render.glob("*.yaml")}
    assert sorted(files) == ["cpu-arm.yaml", "negative-control.yaml", "retrieval.yaml"]
    docs = [d for docs in files.values() for d in docs if d is not None]
    assert len(docs) == 7
    for version in ("1.34", "1.35"):
        for doc in docs:
            assert kubernetes_validate.validate(doc, version, strict=True) == version
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    server = deployment["spec"]["template"]["spec"]["containers"][0]
    # the shared memory plan of the single-box path, with the inventory's guards
    plan = retrieval_memory_plan(32)
    assert server["resources"]["limits"]["memory"] == str(plan["memory_limit_bytes"])
    assert server["args"][:2] == ["--config_path", "/models/config.json"]
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["storageClassName"] == "longhorn"
    text = (render / "retrieval.yaml").read_text()
    assert text.startswith("# Rendered by the cardshare.gpuhost.retrieval role")


@pytest.mark.parametrize(
    ("case", "named"),
    [("cel", "selectors[0].cel.expression"), ("capacity", "retrieval_k8s_claim_request.capacity")],
)
def test_a_claim_on_memory_is_refused_before_anything_is_written(
    outcomes: dict[str, tuple[Any, Path]], case: str, named: str
) -> None:
    outcome, render = outcomes[case]
    assert named in str(outcome.get("failed")), outcome
    assert "Pending with no event" in str(outcome["failed"])
    assert not render.exists()


def test_a_missing_model_image_is_named(outcomes: dict[str, tuple[Any, Path]]) -> None:
    outcome, render = outcomes["no_model_image"]
    assert "retrieval_k8s_model_image is ''" in str(outcome.get("failed")), outcome
    assert not render.exists()
