"""Issue 9 (naming): CRI containers named ``k8s/<namespace>/<pod>/<container>`` from files.

The trees follow the kubelet's layouts (``pkg/kubelet/kuberuntime`` helpers: pod log
directory ``/var/log/pods/<namespace>_<pod>_<uid>/<container>/<restart>.log``, container log
symlink ``/var/log/containers/<pod>_<namespace>_<container>-<id>.log``) and containerd's
task bundle (``/run/containerd/io.containerd.runtime.v2.task/k8s.io/<id>/config.json``,
annotations ``io.kubernetes.cri.sandbox-namespace``, ``-sandbox-name``, ``-container-name``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cardshare.naming import (
    DEFAULT_RULES,
    ContainerRef,
    EngineApiResolver,
    KubeletFilesResolver,
    client_name,
    container_from_cgroup,
    default_sockets,
)

CID = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"
POD_UID = "2c48913c-b29f-11e7-9350-020968147796"
REF = ContainerRef("cri", CID, pod_uid=POD_UID)


def _pod_dir(root: Path, namespace: str, pod: str, uid: str, *containers: str) -> Path:
    base = root / "var" / "log" / "pods" / f"{namespace}_{pod}_{uid}"
    for container in containers:
        (base / container).mkdir(parents=True)
        (base / container / "0.log").write_text("")
    base.mkdir(parents=True, exist_ok=True)
    return base


def _log_link(root: Path, namespace: str, pod: str, uid: str, container: str, cid: str) -> None:
    links = root / "var" / "log" / "containers"
    links.mkdir(parents=True, exist_ok=True)
    target = f"/var/log/pods/{namespace}_{pod}_{uid}/{container}/0.log"  # absolute, as on a node
    (links / f"{pod}_{namespace}_{container}-{cid}.log").symlink_to(target)


def _bundle(root: Path, cid: str, annotations: dict[str, str], k3s: bool = False) -> None:
    run = root / "run" / ("k3s/containerd" if k3s else "containerd")
    base = run / "io.containerd.runtime.v2.task" / "k8s.io" / cid
    base.mkdir(parents=True)
    (base / "config.json").write_text(
        json.dumps({"ociVersion": "1.1.0", "annotations": annotations})
    )


CRI_NOTES = {
    "io.kubernetes.cri.container-type": "container",
    "io.kubernetes.cri.sandbox-namespace": "ai",
    "io.kubernetes.cri.sandbox-name": "vllm-7d9c6b-x2k4p",
    "io.kubernetes.cri.container-name": "vllm",
    "io.kubernetes.cri.sandbox-uid": POD_UID,
}


def test_log_symlink_names_the_container(tmp_path: Path) -> None:
    _pod_dir(tmp_path, "ai", "vllm-7d9c6b-x2k4p", POD_UID, "vllm", "metrics-sidecar")
    _log_link(tmp_path, "ai", "vllm-7d9c6b-x2k4p", POD_UID, "vllm", CID)
    _log_link(tmp_path, "ai", "vllm-7d9c6b-x2k4p", POD_UID, "metrics-sidecar", OTHER)
    resolver = KubeletFilesResolver(str(tmp_path))
    assert resolver(REF) == "k8s/ai/vllm-7d9c6b-x2k4p/vllm"
    assert resolver(ContainerRef("cri", OTHER, pod_uid=POD_UID)) == (
        "k8s/ai/vllm-7d9c6b-x2k4p/metrics-sidecar"
    )


@pytest.mark.parametrize("k3s", [False, True])
def test_containerd_bundle_names_the_container(tmp_path: Path, k3s: bool) -> None:
    _bundle(tmp_path, CID, CRI_NOTES, k3s=k3s)
    assert KubeletFilesResolver(str(tmp_path))(REF) == "k8s/ai/vllm-7d9c6b-x2k4p/vllm"


@pytest.mark.parametrize(
    "notes",
    [
        {},
        {**CRI_NOTES, "io.kubernetes.cri.container-name": ""},
        {**CRI_NOTES, "io.kubernetes.cri.sandbox-name": "a/b"},  # never a name with a slash
    ],
)
def test_bad_bundle_is_not_used(tmp_path: Path, notes: dict[str, str]) -> None:
    _bundle(tmp_path, CID, notes)
    assert KubeletFilesResolver(str(tmp_path))(REF) is None


def test_pod_directory_with_one_container(tmp_path: Path) -> None:
    _pod_dir(tmp_path, "media", "comfyui-0", POD_UID, "comfyui")
    assert KubeletFilesResolver(str(tmp_path))(REF) == "k8s/media/comfyui-0/comfyui"


def test_pod_directory_with_several_containers_names_the_pod_only(tmp_path: Path) -> None:
    _pod_dir(tmp_path, "media", "comfyui-0", POD_UID, "init-models", "comfyui")
    assert KubeletFilesResolver(str(tmp_path))(REF) == "k8s/media/comfyui-0:0123456789ab"


def test_other_pods_do_not_match(tmp_path: Path) -> None:
    _pod_dir(tmp_path, "media", "other-0", "11111111-2222-3333-4444-555555555555", "c")
    _log_link(tmp_path, "media", "other-0", "11111111-2222-3333-4444-555555555555", "c", OTHER)
    assert KubeletFilesResolver(str(tmp_path))(REF) is None


def test_docker_refs_are_not_for_the_kubelet(tmp_path: Path) -> None:
    _log_link(tmp_path, "ai", "p", POD_UID, "c", CID)
    assert KubeletFilesResolver(str(tmp_path))(ContainerRef("docker", CID)) is None


def test_from_cgroup_to_name_under_the_host_root(rec_fixtures: Path, tmp_path: Path) -> None:
    """systemd-driver cgroup (underscored UID) to the dashed UID of the kubelet's files."""
    host = tmp_path / "host"
    _pod_dir(host, "ai", "vllm-0", POD_UID, "vllm", "proxy")
    _log_link(host, "ai", "vllm-0", POD_UID, "vllm", CID)
    asked: list[str] = []

    def fetch(socket_path: str, cid: str, timeout: float) -> object | None:
        asked.append(socket_path)
        return None

    resolver = EngineApiResolver(
        default_sockets("/d.sock", "/p.sock", root=str(host)), fetch=fetch, root=str(host)
    )
    for fixture in (
        "k8s-containerd-systemd-v2.txt",
        "k8s-cgroupfs-v1.txt",
        "k8s-crio-systemd-v1.txt",
        "k8s-containerd-colon.txt",
        "k8s-kind-node.txt",
    ):
        ref = container_from_cgroup((rec_fixtures / "cgroup" / fixture).read_text())
        assert client_name(ref, "python3", "", DEFAULT_RULES, resolver) == "k8s/ai/vllm-0/vllm"
    assert asked == []  # no engine socket is asked about a CRI container


def test_listings_are_read_once_per_resolver(tmp_path: Path) -> None:
    resolver = KubeletFilesResolver(str(tmp_path))
    assert resolver(REF) is None
    _log_link(tmp_path, "ai", "p", POD_UID, "c", CID)  # appears after the first look
    assert resolver(REF) is None
    assert KubeletFilesResolver(str(tmp_path))(REF) == "k8s/ai/p/c"
