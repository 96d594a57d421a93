"""The retrieval tier's Kubernetes manifests (plugins/plugin_utils/_retrieval_k8s.py, the
filters retrieval_k8s_manifests and retrieval_k8s_claim_check).

What seed 000 ("Retrieval on the idle iGPUs") learned on a cluster, each a test here: the
manifests are valid for the official schemas of Kubernetes 1.34 and 1.35
(``kubernetes-validate``, offline, strict: an unknown field fails); the claim never asks for
memory (an iGPU publishes ``memory: "0"``), scanned in keys and in string values, CEL
expressions included; the claim is referenced at both levels; the seed container, the CPU arm
and the negative control hold none; probes ask the models; the seed script copies file by
file with a bare ``sync`` and writes its marker last, checked with its comments stripped (a
comment cannot satisfy a check) and run for real in busybox ``sh``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped,unused-ignore]
import pytest
from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.filter.retrieval import FilterModule
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_inputs import (
    RetrievalError,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_k8s import (
    claim_problems,
    k8s_manifests,
    seed_script,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_memory import (
    retrieval_memory_plan,
)

FILTERS = FilterModule().filters()
PLAN = retrieval_memory_plan()  # the role's defaults: 64 chunks, 640 positions, one stream
PARAMS: dict[str, Any] = {
    "name": "ovms-retrieval",
    "namespace": "retrieval",
    "device_class": "gpu.intel.com",
    "claim_request": {},
    "device": "igpu",
    "pci_bus_id": "any",  # the pin has tests of its own
    "render_gid": None,
    "image": "openvino/model_server:2026.2.1-gpu",
    "command": ["--config_path", "/models/config.json", "--rest_port", "8000"],
    "model_image": "registry.example/ovms-retrieval-models:2026.2.1-r3",
    "model_image_path": "/models-src",
    "revision": "2026.2.1-r3",
    "embedding_model": "bge-m3",
    "rerank_model": "bge-reranker-v2-m3",
    "memory_limit_bytes": PLAN["memory_limit_bytes"],
    "seed_memory_limit": "2Gi",
    "storage_size": "8Gi",
    "storage_class": None,
    "startup_seconds": 600,
    "node_name": None,
}
VERSIONS = ("1.34", "1.35")


def rendered(**changes: Any) -> dict[str, list[dict[str, Any]]]:
    return k8s_manifests({**PARAMS, **changes})


def every_doc(files: dict[str, list[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    for docs in files.values():
        yield from docs


def by_kind(files: dict[str, list[dict[str, Any]]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in every_doc(files) if d["kind"] == kind]
    return found


def walk(value: object) -> Iterator[tuple[str | None, object]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield str(key), item
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield None, item
            yield from walk(item)


# -- the official schemas ----------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"node_name": "node-a", "storage_class": "longhorn", "claim_request": {"tolerations": []}},
        {"pci_bus_id": "auto", "render_gid": 105},
        {"device": "card", "pci_bus_id": "auto", "claim_request": {"selectors": []}},
    ],
    ids=["defaults", "pinned", "igpu-pin-render-group", "card-pin"],
)
def test_every_manifest_is_valid_for_the_official_schema(
    version: str, changes: dict[str, Any]
) -> None:
    files = rendered(**changes)
    kinds = sorted(d["kind"] for d in every_doc(files))
    assert kinds == [
        "Deployment",
        "Namespace",
        "PersistentVolumeClaim",
        "Pod",
        "Pod",
        "ResourceClaimTemplate",
        "Service",
    ]
    for doc in every_doc(files):
        # strict: an unknown field (a typo, a field of another version) fails too; a kind the
        # schemas lack raises SchemaNotFoundError, which fails the test as well
        assert kubernetes_validate.validate(doc, version, strict=True) == version


def test_the_validator_refuses_what_the_api_server_would() -> None:
    claim = by_kind(rendered(), "ResourceClaimTemplate")
    claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(claim, "1.34", strict=True)
    deployment = by_kind(rendered(), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.35", strict=True)


# -- the claim -----------------------------------------------------------------------------


def test_no_capacity_anywhere_in_keys_or_values() -> None:
    files = rendered(claim_request={"tolerations": [{"operator": "Exists"}]})
    for doc in every_doc(files):
        for key, value in walk(doc):
            assert key is None or key.lower() != "capacity", doc["kind"]
            if isinstance(value, str):
                assert "capacity" not in value.lower(), (doc["kind"], value)
    claim = by_kind(files, "ResourceClaimTemplate")
    assert claim_problems(claim, "claim") == []
    (request,) = claim["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "gpu.intel.com"
    assert (request["exactly"]["allocationMode"], request["exactly"]["count"]) == ("ExactCount", 1)
    assert "selectors" not in request["exactly"]


CEL = 'device.capacity["gpu.intel.com"].memory.compareTo(quantity("2Gi")) >= 0'
CEL_INDEX = "device.capacity['gpu.intel.com']['memory'] > quantity('1Gi')"


@pytest.mark.parametrize(
    ("request_extra", "named"),
    [
        ({"capacity": {"requests": {"memory": "2Gi"}}}, "retrieval_k8s_claim_request.capacity"),
        ({"selectors": [{"cel": {"expression": CEL}}]}, "selectors[0].cel.expression"),
        (
            {"selectors": [{"cel": {"expression": 'device.attributes["x"].memory > 0'}}]},
            "selectors[0].cel.expression",
        ),
        (
            {
                "tolerations": [],
                "selectors": [{"cel": {"expression": CEL_INDEX}}],
            },
            "selectors[0].cel.expression",
        ),
    ],
    ids=["capacity-key", "cel-capacity", "cel-memory-attribute", "cel-index-form"],
)
def test_a_claim_on_memory_is_refused_naming_it(request_extra: Any, named: str) -> None:
    problems = FILTERS["retrieval_k8s_claim_check"](request_extra)
    assert problems and any(named in p for p in problems), problems
    assert all("Pending" in p for p in problems)
    with pytest.raises(RetrievalError, match=re.escape(named)):
        rendered(claim_request=request_extra)
    with pytest.raises(AnsibleFilterError, match="memory"):
        FILTERS["retrieval_k8s_manifests"]({**PARAMS, "claim_request": request_extra})


def test_a_selector_that_does_not_speak_of_memory_is_kept() -> None:
    extra = {"selectors": [{"cel": {"expression": 'device.driver == "gpu.intel.com"'}}]}
    assert claim_problems(extra) == []
    request = by_kind(rendered(claim_request=extra), "ResourceClaimTemplate")["spec"]["spec"][
        "devices"
    ]["requests"][0]
    assert request["exactly"]["selectors"] == extra["selectors"]


@pytest.mark.parametrize(
    "extra",
    [
        # the word alone filters on nothing: a toleration's key, a model's name, another capacity
        {"tolerations": [{"key": "example.com/memory-pressure", "operator": "Exists"}]},
        {
            "selectors": [
                {"cel": {"expression": 'device.attributes["gpu.intel.com"].model == "memory-x"'}}
            ]
        },
        {"capacity": {"requests": {"millicores": "500m"}}},
    ],
    ids=["toleration-key", "cel-string-literal", "capacity-millicores"],
)
def test_what_merely_says_memory_is_kept(extra: dict[str, Any]) -> None:
    assert claim_problems(extra) == []
    request = by_kind(rendered(claim_request=extra), "ResourceClaimTemplate")
    assert request["spec"]["spec"]["devices"]["requests"][0]["exactly"].items() >= extra.items()


# -- the pin -------------------------------------------------------------------------------

READ_BUS_ID = (
    '("pciBusID" in device.attributes["resource.kubernetes.io"] ? '
    'device.attributes["resource.kubernetes.io"].pciBusID : '
    'device.attributes["gpu.intel.com"].pciAddress)'
)


@pytest.mark.parametrize(
    ("device", "bus_id", "expression"),
    [
        ("igpu", "auto", READ_BUS_ID + ' == "0000:00:02.0"'),
        ("card", "auto", READ_BUS_ID + ' != "0000:00:02.0"'),
        ("card", "0000:03:00.0", READ_BUS_ID + ' == "0000:03:00.0"'),
        ("igpu", "0000:00:02.0", READ_BUS_ID + ' == "0000:00:02.0"'),
        ("card", "any", None),
    ],
)
def test_the_claim_is_pinned_by_pci_address(
    device: str, bus_id: str, expression: str | None
) -> None:
    user = {"cel": {"expression": 'device.attributes["gpu.intel.com"].family == "Arc"'}}
    claim = by_kind(
        rendered(device=device, pci_bus_id=bus_id, claim_request={"selectors": [user]}),
        "ResourceClaimTemplate",
    )
    selectors = claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
    assert selectors == [user] + ([{"cel": {"expression": expression}}] if expression else [])
    assert claim_problems(claim, "claim") == []


@pytest.mark.parametrize("bus_id", ["igpu", "00:02.0", "0000:00:02.8", None])
def test_a_bad_pin_names_the_variable(bus_id: object) -> None:
    with pytest.raises(RetrievalError, match="retrieval_k8s_pci_bus_id is"):
        rendered(pci_bus_id=bus_id)


def test_the_render_group_is_a_supplemental_group_of_the_pods_with_the_device() -> None:
    files = rendered(render_gid=105)
    server = by_kind(files, "Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert server["supplementalGroups"] == [105]
    assert (server["runAsUser"], server["runAsGroup"]) == (5000, 5000)
    pods = {d["metadata"]["name"]: d for d in files["cpu_arm"] + files["negative_control"]}
    assert pods["ovms-retrieval-negative-control"]["spec"]["securityContext"][
        "supplementalGroups"
    ] == [105]
    assert "supplementalGroups" not in pods["ovms-retrieval-cpu-arm"]["spec"]["securityContext"]
    none = by_kind(rendered(), "Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert "supplementalGroups" not in none


@pytest.mark.parametrize("gid", [0, -1, "render", True, 2**31])
def test_a_bad_render_group_names_the_variable(gid: object) -> None:
    with pytest.raises(RetrievalError, match="retrieval_k8s_render_gid is"):
        rendered(render_gid=gid)


@pytest.mark.parametrize("key", ["deviceClassName", "allocationMode", "count"])
def test_the_request_cannot_change_what_the_role_sets(key: str) -> None:
    with pytest.raises(RetrievalError, match=f"retrieval_k8s_claim_request.{key}"):
        rendered(claim_request={key: "x"})


def test_the_claim_is_referenced_at_both_levels() -> None:
    files = rendered()
    template = by_kind(files, "ResourceClaimTemplate")
    pod = by_kind(files, "Deployment")["spec"]["template"]["spec"]
    (pod_claim,) = pod["resourceClaims"]
    assert pod_claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    (server,) = pod["containers"]
    assert server["resources"]["claims"] == [{"name": pod_claim["name"]}]
    assert (
        template["metadata"]["namespace"] == by_kind(files, "Deployment")["metadata"]["namespace"]
    )


def test_the_seed_the_cpu_arm_and_the_negative_control_hold_no_claim() -> None:
    files = rendered(node_name="node-a")
    pod = by_kind(files, "Deployment")["spec"]["template"]["spec"]
    (seeder,) = pod["initContainers"]
    assert "claims" not in seeder["resources"]
    for name in ("cpu_arm", "negative_control"):
        (arm,) = files[name]
        spec = arm["spec"]
        assert "resourceClaims" not in spec, name
        assert spec["nodeName"] == "node-a", name
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert "claims" not in container.get("resources", {}), (name, container["name"])
    control = files["negative_control"][0]["spec"]["containers"][0]
    assert control["image"] == PARAMS["image"]
    assert control["command"][-1] == "ls -ln /dev/dri"
    # the same identity as the server: only the claim differs
    assert files["negative_control"][0]["spec"]["securityContext"] == pod["securityContext"]


def test_the_cpu_arm_seeds_the_cpu_tree_the_server_the_gpu_tree() -> None:
    files = rendered()
    server_seed = by_kind(files, "Deployment")["spec"]["template"]["spec"]["initContainers"][0]
    arm_seed = files["cpu_arm"][0]["spec"]["initContainers"][0]
    assert "src='/models-src/gpu'" in server_seed["command"][-1]
    assert "src='/models-src/cpu'" in arm_seed["command"][-1]
    assert files["cpu_arm"][0]["spec"]["containers"][0]["image"] == PARAMS["image"]


# -- the pod -------------------------------------------------------------------------------


def test_probes_ask_the_models_and_liveness_the_server() -> None:
    server = by_kind(rendered(), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports == {"http": 8000}
    startup, ready, live = (server[k] for k in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert startup["httpGet"] == {"path": "/v2/models/bge-m3/ready", "port": "http"}
    assert ready["httpGet"] == {"path": "/v2/models/bge-reranker-v2-m3/ready", "port": "http"}
    assert live["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    # minutes for the first boot's compilation: 600 s at one try every 10 s
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_the_memory_limit_is_the_shared_plans_and_the_uid_ovms() -> None:
    files = rendered()
    deployment = by_kind(files, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    server = spec["containers"][0]
    assert server["resources"]["limits"]["memory"] == str(PLAN["memory_limit_bytes"])
    assert server["resources"]["requests"]["memory"] == str(PLAN["memory_limit_bytes"])
    assert spec["securityContext"]["runAsUser"] == 5000
    assert spec["securityContext"]["fsGroup"] == 5000
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert spec["volumes"] == [
        {"name": "models", "persistentVolumeClaim": {"claimName": "ovms-retrieval-models"}}
    ]
    assert server["volumeMounts"] == [{"name": "models", "mountPath": "/models", "readOnly": True}]


def test_only_a_cluster_ip_service() -> None:
    files = rendered()
    service = by_kind(files, "Service")
    assert service["spec"]["type"] == "ClusterIP"
    assert (
        service["spec"]["selector"]
        == by_kind(files, "Deployment")["spec"]["selector"]["matchLabels"]
    )
    assert not [d for d in every_doc(files) if d["kind"] in ("Ingress", "Gateway", "HTTPRoute")]


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"model_image": ""}, "retrieval_k8s_model_image"),
        ({"model_image": "models:latest"}, "retrieval_k8s_model_image"),
        ({"namespace": "Retrieval"}, "retrieval_k8s_namespace"),
        ({"revision": "a b"}, "retrieval_repository_revision"),
        ({"seed_memory_limit": "lots"}, "retrieval_k8s_seed_memory_limit"),
        ({"startup_seconds": 0}, "retrieval_k8s_startup_seconds"),
        ({"claim_request": ["gpu"]}, "retrieval_k8s_claim_request"),
        ({"image": "openvino/model_server"}, "retrieval_image"),
    ],
)
def test_bad_input_names_the_variable(changes: dict[str, Any], named: str) -> None:
    with pytest.raises(RetrievalError, match=named):
        rendered(**changes)


# -- the seed script -----------------------------------------------------------------------


def script_lines(script: str) -> list[str]:
    """The script's commands: comments and blank lines removed (so a comment that mentions
    ``sync`` or ``cp`` cannot satisfy a check)."""
    lines = []
    for line in script.splitlines():
        code = re.sub(r"(^|\s)#.*$", "", line).strip()
        if code:
            lines.append(code)
    return lines


def test_the_seed_copies_file_by_file_with_a_bare_sync_and_the_marker_last() -> None:
    seeder = by_kind(rendered(), "Deployment")["spec"]["template"]["spec"]["initContainers"][0]
    assert seeder["command"][:2] == ["sh", "-c"]
    lines = script_lines(seeder["command"][2])
    copy = lines.index('cp "$file" "$dest/$file"')
    assert lines[copy - 1] == "find . -type f | while IFS= read -r file; do"
    assert lines[copy + 1] == "sync"  # after every file, before the next
    assert lines[copy + 2] == "done"
    # busybox's sync takes no operand: every sync is bare
    assert [line for line in lines if line.split()[0] == "sync"] == ["sync"] * 3
    assert not [line for line in lines if re.match(r"cp\s+-[a-zA-Z]*[rR]", line)]
    marker = lines.index('mv "$marker.tmp" "$marker"')
    assert marker > copy + 2 and lines[marker - 1] == "sync"


def test_a_comment_cannot_satisfy_the_seed_checks() -> None:
    # the checks above look at commands only: a script whose sync is commented out fails them
    script = seed_script("/models-src/gpu", "r1").replace("  sync\n", "  # sync\n", 1)
    lines = script_lines(script)
    copy = lines.index('cp "$file" "$dest/$file"')
    assert lines[copy + 1] == "done"


BUSYBOX = shutil.which("busybox")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    src = tmp_path / "models-src" / "gpu"
    (src / "bge-m3" / "1").mkdir(parents=True)
    (src / "bge-reranker-v2-m3").mkdir(parents=True)
    (src / "config.json").write_text('{"model_config_list": []}\n')
    (src / "bge-m3" / "1" / "openvino_model.bin").write_bytes(os.urandom(300_000))
    (src / "bge-reranker-v2-m3" / "graph.pbtxt").write_text("node {}\n")
    (src / "bge-reranker-v2-m3" / "with space.txt").write_text("x\n")
    (tmp_path / "models").mkdir()
    return tmp_path


def seed(tree: Path, revision: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    if BUSYBOX is None:
        pytest.skip("busybox is not installed (tools/deps.sh installs it)")
    script = seed_script(str(tree / "models-src" / "gpu"), revision, dest=str(tree / "models"))
    env = {**os.environ, "PATH": path or os.environ["PATH"]}
    return subprocess.run(
        [BUSYBOX, "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_the_seed_runs_in_busybox_and_a_new_revision_replaces_the_tree(tree: Path) -> None:
    src, dest = tree / "models-src" / "gpu", tree / "models"
    (dest / "stale-from-before.bin").write_text("old")
    first = seed(tree, "r1")
    assert first.returncode == 0, first.stderr
    copied = files_under(dest)
    assert copied.pop(".cardshare-seed") == b"r1\n"
    assert copied == files_under(src)  # the stale file is gone, every file is there
    again = seed(tree, "r1")
    assert again.returncode == 0 and "holds revision r1" in again.stdout, again
    (src / "bge-m3" / "1" / "openvino_model.bin").write_bytes(b"new weights")
    (src / "config.json").unlink()
    second = seed(tree, "r2")
    assert second.returncode == 0, second.stderr
    copied = files_under(dest)
    assert copied.pop(".cardshare-seed") == b"r2\n"
    assert copied == files_under(src)


def test_an_interrupted_seed_leaves_no_marker_and_runs_again(tree: Path) -> None:
    """The copy killed halfway (a cp that dies as the OOM killer's 137 on one file): no
    marker, so the next start seeds again; then it completes."""
    dest = tree / "models"
    assert seed(tree, "r1").returncode == 0
    killer = tree / "bin"
    killer.mkdir()
    real_cp = shutil.which("cp")
    (killer / "cp").write_text(
        f'#!/bin/sh\ncase "$1" in *graph.pbtxt) kill -9 $$;; esac\nexec {real_cp} "$@"\n'
    )
    (killer / "cp").chmod(0o755)
    failed = seed(tree, "r2", path=f"{killer}:{os.environ['PATH']}")
    assert failed.returncode != 0, failed
    assert not (dest / ".cardshare-seed").exists()  # never current after a partial copy
    rerun = seed(tree, "r2")
    assert rerun.returncode == 0, rerun.stderr
    assert (dest / ".cardshare-seed").read_text() == "r2\n"
    copied = files_under(dest)
    copied.pop(".cardshare-seed")
    assert copied == files_under(tree / "models-src" / "gpu")


# -- the wait ------------------------------------------------------------------------------


def _pod(
    phase: str = "Running",
    init: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    ready: bool = False,
    scheduled: dict[str, Any] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    """A pod as the API server lists it (the fields the verdict reads)."""
    metadata: dict[str, Any] = {"name": "ovms-retrieval-6b7f9c8d5-x2k4q"}
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-04T05:00:00Z"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            scheduled or {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if init is not None:
        status["initContainerStatuses"] = [
            {"name": "seed-models", "restartCount": 0, "state": init}
        ]
    if server is not None:
        status["containerStatuses"] = [{"name": "ovms", "restartCount": 2, "state": server}]
    return {"metadata": metadata, "spec": {"nodeName": "node-a"}, "status": status}


DONE = {"terminated": {"exitCode": 0, "reason": "Completed"}}
RUN = {"running": {"startedAt": "2026-12-04T05:01:00Z"}}
UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "message": "0/1 nodes are available: 1 cannot allocate all claims.",
}


@pytest.mark.parametrize(
    ("pods", "state", "said"),
    [
        ([], "waiting", "no pod of the server yet"),
        ([_pod(deleting=True, server=RUN)], "waiting", "(1 old one(s) still terminating)"),
        ([_pod("Pending", scheduled=UNSCHEDULABLE)], "waiting", "cannot allocate all claims"),
        ([_pod("Pending", init=RUN)], "waiting", "seed-models: running"),
        ([_pod(init=DONE, server=RUN)], "started", "ovms: running"),
        ([_pod(init=DONE, server=RUN, ready=True)], "ready", "ovms: running"),
        ([_pod(init=DONE, server=RUN), _pod(init=DONE, server=RUN)], "waiting", "2 pods"),
        (
            [_pod("Pending", init={"waiting": {"reason": "ImagePullBackOff", "message": "nope"}})],
            "failed",
            "seed-models: waiting ImagePullBackOff nope",
        ),
        (
            [_pod("Pending", init={"waiting": {"reason": "ErrImagePull"}})],
            "waiting",
            "ErrImagePull",
        ),
        (
            [
                _pod(
                    init=DONE,
                    server={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
                )
            ],
            "failed",
            "ovms: waiting CrashLoopBackOff back-off (restarts 2)",
        ),
        ([_pod("Failed", init=DONE)], "failed", "Failed"),
    ],
)
def test_the_pod_verdict(pods: list[dict[str, Any]], state: str, said: str) -> None:
    verdict = FILTERS["retrieval_k8s_pod_verdict"](pods)
    assert verdict["state"] == state, verdict
    assert said in verdict["text"], verdict


def test_a_crash_says_how_the_last_run_ended() -> None:
    server = {
        "name": "ovms",
        "restartCount": 3,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
    }
    server["lastState"] = {"terminated": {"exitCode": 1, "reason": "Error", "message": "bad cfg"}}
    pod = _pod(init=DONE)
    pod["status"]["containerStatuses"] = [server]
    verdict = FILTERS["retrieval_k8s_pod_verdict"]([pod])
    assert "last ended Error exit 1: bad cfg" in verdict["text"]
    with pytest.raises(AnsibleFilterError, match="expected k8s_info's resources"):
        FILTERS["retrieval_k8s_pod_verdict"]({"resources": []})


FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "ovms"
MODELS = ["bge-m3", "bge-reranker-v2-m3"]


def _reply(body: str, status: str = "200 OK") -> str:
    headers = f"Content-Type: application/json\r\nContent-Length: {len(body)}"
    return f"HTTP/1.1 {status}\r\n{headers}\r\n\r\n{body}"


@pytest.mark.parametrize(
    ("reply", "settled", "available", "said"),
    [
        ("", False, [], "/v1/config did not answer yet"),
        ("bash: connect: Connection refused", False, [], "did not answer yet"),
        (_reply("{}", "404 Not Found"), False, [], "/v1/config answered 'HTTP/1.1 404"),
        (_reply("<html>"), False, [], "/v1/config answered what is not JSON"),
        (
            _reply((FIXTURES / "v1-config.rerank-failed.json").read_text()),
            True,
            ["bge-m3"],
            "version 1 LOADING (FAILED_PRECONDITION)",
        ),
        (
            _reply((FIXTURES / "v1-config.two-versions.json").read_text()),
            True,
            MODELS,
            "bge-m3: serves version 2",
        ),
        (
            _reply(
                (FIXTURES / "v1-config.available.json")
                .read_text()
                .replace('"AVAILABLE"', '"LOADING"', 1)
            ),
            False,
            ["bge-reranker-v2-m3"],
            "bge-m3: no version AVAILABLE; version 1 LOADING (OK)",
        ),
    ],
    ids=["nothing", "refused", "404", "garbage", "failed", "served", "loading"],
)
def test_the_servers_answer_in_the_pod(
    reply: str, settled: bool, available: list[str], said: str
) -> None:
    states = FILTERS["retrieval_k8s_reply_states"](reply, MODELS)
    assert (states["settled"], states["available"]) == (settled, available), states
    assert said in states["text"]
