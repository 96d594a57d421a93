"""The retrieval role's ``kubernetes`` entry point with ``retrieval_k8s_apply``, run by
``ansible-playbook`` against a SIMULATION of ``kubernetes.core``'s modules that answer from a
described cluster (``fake_kubernetes/README.md``): no cluster runs here.

The answers of the server inside the pod are OVMS's (``tests/fixtures/ovms``, see its README);
the pods are shaped as the API server returns them (``status.phase``, ``conditions``,
``initContainerStatuses``, ``containerStatuses``).

A reranker the server refuses (``LOADING`` with ``FAILED_PRECONDITION``) fails the run as soon
as ``/v1/config`` says so, with the server's own reason from its log, not at the apply's
timeout; a stuck image pull fails with the kubelet's reason; a render node the server's user
cannot open names ``retrieval_k8s_render_gid``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_graph import (
    retrieval_graph_guards,
)
from role_playbook import WRITE_OUTCOMES, run_cases

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake_kubernetes"
FIXTURES = HERE.parents[1] / "fixtures" / "ovms"
POD = "ovms-retrieval-6b7f9c8d5-x2k4q"
RERANK = "bge-reranker-v2-m3"

# one play per case: the entry point runs once per play, on the controller
PLAY = """\
- name: Apply the retrieval tier to a described cluster ({case})
  hosts: {case}
  gather_facts: false
  tasks:
    - name: Run the entry point, keeping its outcome or its failure
      block:
        - name: Run the kubernetes entry point with apply
          ansible.builtin.include_role:
            name: cardshare.gpuhost.retrieval
            tasks_from: kubernetes
          vars:
            __retrieval_k8s_poll_seconds: 0

        - name: Keep the outcome
          ansible.builtin.set_fact:
            case_outcome: {{applied: true}}
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

COMMON = {
    "retrieval_device": "igpu",
    "retrieval_repository_revision": "2026.2.1-r3",
    "retrieval_k8s_model_image": "registry.example/ovms-retrieval-models:2026.2.1-r3",
    "retrieval_max_allowed_chunks": 32,
    "retrieval_k8s_apply": True,
    "retrieval_k8s_negative_control": False,
}


def _pod(phase: str, init: dict[str, Any], server: dict[str, Any] | None, ready: bool) -> dict:
    """A pod of the server as the API server lists it."""
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": "True" if server else "False"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
        "initContainerStatuses": [{"name": "seed-models", "restartCount": 0, "state": init}],
    }
    if server is not None:
        status["containerStatuses"] = [
            {"name": "ovms", "restartCount": 0, "ready": ready, "state": server}
        ]
    return {
        "metadata": {"name": POD, "namespace": "retrieval"},
        "spec": {"nodeName": "node-a"},
        "status": status,
    }


SEEDING = _pod("Pending", {"running": {"startedAt": "2026-12-04T05:00:00Z"}}, None, False)
DONE = {"terminated": {"exitCode": 0, "reason": "Completed"}}
RUNNING = _pod("Running", DONE, {"running": {"startedAt": "2026-12-04T05:01:00Z"}}, False)
READY = _pod("Running", DONE, {"running": {"startedAt": "2026-12-04T05:01:00Z"}}, True)
PULL_STUCK = _pod(
    "Pending",
    {
        "waiting": {
            "reason": "ImagePullBackOff",
            "message": 'Back-off pulling image "registry.example/ovms-retrieval-models:r3"',
        }
    },
    None,
    False,
)


def _http(body: str, status: str = "200 OK") -> str:
    return f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n\r\n{body}"


REFUSED = (FIXTURES / "v1-config.rerank-failed.json").read_text()
TWO_VERSIONS = (FIXTURES / "v1-config.two-versions.json").read_text()
GRAPH = retrieval_graph_guards((FIXTURES / "rerank-graph.gpu.pbtxt").read_text(), 32, 640)
RANKING = json.dumps(
    {
        "results": [
            {"index": 0, "relevance_score": 0.97},
            {"index": 2, "relevance_score": 0.002},
            {"index": 1, "relevance_score": 0.001},
            {"index": 3, "relevance_score": 0.0004},
        ]
    }
)
# the stand-in's log of a refused reranker, in the shape of OVMS's spdlog lines
REFUSED_LOG = "\n".join(
    [
        "[2026-12-04 05:01:02.101][1][serving][info] OpenVINO Model Server 2026.2.1",
        "[2026-12-04 05:01:40.310][1][modelmanager][error] Mediapipe: bge-reranker-v2-m3 "
        "validation failed: Either openvino_tokenizer.xml was not provided or it was not "
        "loaded correctly",
        "[2026-12-04 05:01:40.311][1][modelmanager][info] Mediapipe: bge-reranker-v2-m3 state "
        "changed to: LOADING_PRECONDITION_FAILED after handling: ValidationFailedEvent: ",
    ]
)
DRI_OPEN = (
    "uid=5000 gid=5000 groups=5000,105\ntotal 0\n"
    "crw-rw---- 1 0 105 226, 128 Dec  4 05:00 renderD128\nopen: /dev/dri/renderD128\n"
)
DRI_DENIED = DRI_OPEN.replace("groups=5000,105", "groups=5000").replace("open:", "denied:")


def _served(dri: str) -> dict[str, Any]:
    return {
        "rollout": False,
        "pods": [[], [SEEDING], [RUNNING], [RUNNING], [READY]],
        "exec": [
            {
                "match": "/v1/config",
                "replies": [
                    {"stdout": "", "stderr": "connection refused", "rc": 1},
                    {"stdout": _http(TWO_VERSIONS)},
                ],
            },
            {"match": "/v3/rerank", "replies": [{"stdout": _http(RANKING)}]},
            {"match": f"cat /models/{RERANK}/graph.pbtxt", "replies": [{"stdout": GRAPH}]},
            {"match": "/dev/dri", "replies": [{"stdout": dri}]},
        ],
    }


CLUSTERS: dict[str, dict[str, Any]] = {
    "refused": {
        "rollout": False,
        "pods": [[], [SEEDING], [RUNNING]],
        "exec": [
            {
                "match": "/v1/config",
                "replies": [
                    {"fail": "(400) container ovms is not valid for pod"},
                    {"stdout": "", "stderr": "connection refused", "rc": 1},
                    {"stdout": _http(REFUSED)},
                ],
            }
        ],
        "log": REFUSED_LOG,
    },
    "pull_stuck": {"rollout": False, "pods": [[], [SEEDING], [PULL_STUCK]], "exec": []},
    "served": _served(DRI_OPEN),
    "denied": _served(DRI_DENIED),
}
VALUES: dict[str, dict[str, Any]] = {
    "served": {"retrieval_k8s_render_gid": 105},
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    work = tmp_path_factory.mktemp("retrieval-kubernetes-apply")
    hosts = {}
    for case, cluster in CLUSTERS.items():
        kubeconfig = work / f"{case}.cluster.json"
        kubeconfig.write_text(json.dumps(cluster))
        hosts[case] = {
            **COMMON,
            **VALUES.get(case, {}),
            "retrieval_k8s_kubeconfig": str(kubeconfig),
            "retrieval_k8s_render_dir": str(work / "rendered" / case),
        }
    playbook = "---\n" + "".join(PLAY.format(case=c) for c in CLUSTERS) + FINAL + WRITE_OUTCOMES
    found = run_cases(work / "run", playbook, hosts, collections_before=[FAKE])
    return {case: (found[case], work / f"{case}.cluster.json.calls") for case in CLUSTERS}


def _calls(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_refused_reranker_fails_at_once_with_the_servers_reason(
    outcomes: dict[str, tuple[Any, Path]],
) -> None:
    outcome, calls = outcomes["refused"]
    failed = str(outcome.get("failed"))
    assert f"Not every model is served in {POD}:" in failed, outcome
    assert (
        "bge-reranker-v2-m3: no version AVAILABLE; version 1 LOADING (FAILED_PRECONDITION)"
        in failed
    )
    assert (
        "The server said: modelmanager: Mediapipe: bge-reranker-v2-m3 validation failed: Either "
        "openvino_tokenizer.xml was not provided or it was not loaded correctly." in failed
    )
    assert "Timed out" not in failed
    # the third look at /v1/config said it: no more looks, no wait for the timeout
    looks = [c for c in _calls(calls) if c["module"] == "k8s_exec:/v1/config"]
    assert len(looks) == 3


def test_a_stuck_image_pull_fails_with_the_kubelets_reason(
    outcomes: dict[str, tuple[Any, Path]],
) -> None:
    outcome, calls = outcomes["pull_stuck"]
    failed = str(outcome.get("failed"))
    said = f"The server's pod failed: pod {POD} Pending; seed-models: waiting ImagePullBackOff"
    assert said in failed, outcome
    assert len([c for c in _calls(calls) if c["module"] == "k8s_info"]) == 3


def test_a_served_tier_passes_and_carries_the_render_group_and_the_pin(
    outcomes: dict[str, tuple[Any, Path]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    outcome, calls = outcomes["served"]
    assert outcome == {"applied": True}, outcome
    applied = [c["params"]["definition"] for c in _calls(calls) if c["module"] == "k8s"]
    (deployment,) = [d for d in applied if d["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["securityContext"]["supplementalGroups"] == [105]
    (template,) = [d for d in applied if d["kind"] == "ResourceClaimTemplate"]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    (selector,) = request["exactly"]["selectors"]
    assert selector["cel"]["expression"].endswith(' == "0000:00:02.0"')
    # the Deployment is applied without the wait that would end in a bare timeout
    (apply,) = [
        c["params"]
        for c in _calls(calls)
        if c["module"] == "k8s" and c["params"]["definition"]["kind"] == "Deployment"
    ]
    assert apply["wait"] is False


def test_a_render_node_the_server_cannot_open_names_the_variable(
    outcomes: dict[str, tuple[Any, Path]],
) -> None:
    outcome, _calls_path = outcomes["denied"]
    failed = str(outcome.get("failed"))
    assert f"{POD} holds the claim but cannot open its render node" in failed, outcome
    assert "set retrieval_k8s_render_gid" in failed
    assert "fsGroup does not change a device node's group" in failed


def test_the_rendered_manifest_is_what_was_applied(outcomes: dict[str, tuple[Any, Path]]) -> None:
    _outcome, calls = outcomes["served"]
    render = calls.parent / "rendered" / "served" / "retrieval.yaml"
    docs = [d for d in yaml.safe_load_all(render.read_text()) if d is not None]
    applied = [c["params"]["definition"] for c in _calls(calls) if c["module"] == "k8s"]
    assert docs == applied
