"""Issue 9 (naming): unresolved containers stay apart, root's podman socket, CRI cgroups."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cardshare.naming import (
    DEFAULT_RULES,
    CommandRule,
    ContainerRef,
    EngineApiResolver,
    client_name,
    container_from_cgroup,
    default_sockets,
    unresolved_name,
)
from cardshare.recorder import sample

CID = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
CID2 = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"
POD_UID = "2c48913c-b29f-11e7-9350-020968147796"
STATIC_UID = "33d556edd3ae8ef21980288cef77ae8b"
POD_UID_ = POD_UID.replace("-", "_")  # as systemd slice names write it


def _refused(socket_path: str, cid: str, timeout: float) -> object | None:
    raise ConnectionRefusedError(111, "Connection refused")


# --- 1. an unresolved container is named by its id, never merged ---------------------------


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        (ContainerRef("docker", CID), "docker:0123456789ab"),
        (ContainerRef("podman", CID2, uid=1000), "podman:fedcba987654"),
        (ContainerRef("cri", CID, pod_uid=POD_UID), "k8s/pod-2c48913c/0123456789ab"),
    ],
)
def test_unresolved_name(ref: ContainerRef, expected: str) -> None:
    assert unresolved_name(ref) == expected


# Grammars of the names a resolver gives: Docker/Podman container names, compose
# project/service, Kubernetes k8s/<ns>/<pod>/<container>; a comm is at most 15 bytes.
_CONTAINER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
_COMPOSE = re.compile(r"^[a-z0-9][a-z0-9_-]*/[a-zA-Z0-9._-]+$")
_K8S = re.compile(r"^k8s/[a-z0-9.-]+/[a-z0-9.-]+/[a-z0-9-]+$")


@pytest.mark.parametrize(
    "ref",
    [
        ContainerRef("docker", CID),
        ContainerRef("podman", CID),
        ContainerRef("cri", CID, pod_uid=POD_UID),
        ContainerRef("cri", CID, pod_uid=STATIC_UID),
    ],
)
def test_unresolved_name_cannot_be_a_resolved_name_or_a_comm(ref: ContainerRef) -> None:
    name = unresolved_name(ref)
    assert len(name) > 15
    for grammar in (_CONTAINER_NAME, _COMPOSE, _K8S):
        assert grammar.match(name) is None


def test_two_python3_containers_stay_two_clients() -> None:
    resolver = EngineApiResolver(default_sockets("/d.sock", "/p.sock"), fetch=_refused)
    names = {
        client_name(ContainerRef("docker", cid), "python3", "python3 -m x", DEFAULT_RULES, resolver)
        for cid in (CID, CID2)
    }
    assert names == {"docker:0123456789ab", "docker:fedcba987654"}
    assert resolver.errors == 2


def test_no_resolver_at_all_still_names_by_id() -> None:
    assert client_name(ContainerRef("podman", CID), "python3", "", (), None) == (
        "podman:0123456789ab"
    )


def test_a_rule_still_names_an_unresolved_container() -> None:
    rules = (CommandRule(re.compile(r"^python3$"), "llm", "comm"),)
    assert client_name(ContainerRef("docker", CID), "python3", "", rules, None) == "llm"


def test_a_host_process_keeps_its_comm() -> None:
    assert client_name(None, "python3", "python3 x.py", DEFAULT_RULES, None) == "python3"


def test_snapshot_keeps_unresolved_containers_apart(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str]
) -> None:
    """The reported case end to end: engine socket down, two ``python3`` containers."""
    t = rec_tree
    t.card("0000:03:00.0")
    t.boot_id("b1")
    t.process(300, comm="python3", cgroup=f"0::/system.slice/docker-{CID}.scope\n")
    t.drm_fd(300, 5, rec_make_fdinfo(3, vram="1 GiB"))
    t.process(301, comm="python3", cgroup=f"0::/system.slice/docker-{CID2}.scope\n")
    t.drm_fd(301, 5, rec_make_fdinfo(4, vram="2 GiB"))
    resolver = EngineApiResolver(default_sockets("/d.sock", "/p.sock"), fetch=_refused)

    snapshot, _ = sample(str(t.root), DEFAULT_RULES, resolver, None, 10**18, t.is_drm)

    clients = snapshot["cards"]["0000:03:00.0"]["clients"]
    assert [(c["name"], c["vram_bytes"], c["containers"]) for c in clients] == [
        ("docker:0123456789ab", 1024**3, [CID]),
        ("docker:fedcba987654", 2 * 1024**3, [CID2]),
    ]


# --- 2. root's podman is asked on the rootful socket -----------------------------------


def _recording() -> tuple[list[str], Callable[[str, str, float], object | None]]:
    asked: list[str] = []

    def fetch(socket_path: str, cid: str, timeout: float) -> object | None:
        asked.append(socket_path)
        return {"Name": "/web"}

    return asked, fetch


@pytest.mark.parametrize(
    ("root", "docker", "podman", "fixture", "expected"),
    [
        ("/", "/var/run/docker.sock", "/run/podman/podman.sock", "podman-root-session.txt",
         "/run/podman/podman.sock"),
        ("/host", "/host/var/run/docker.sock", "/host/run/podman/podman.sock",
         "podman-root-session.txt", "/host/run/podman/podman.sock"),
        ("/host", "/host/var/run/docker.sock", "/host/run/podman/podman.sock",
         "podman-rootless.txt", "/host/run/user/1000/podman/podman.sock"),
        ("/host/", "/host/var/run/docker.sock", "/host/run/podman/podman.sock",
         "docker-rootless.txt", "/host/run/user/1001/docker.sock"),
        ("/host", "/host/var/run/docker.sock", "/host/run/podman/podman.sock",
         "podman-rootful.txt", "/host/run/podman/podman.sock"),
    ],
)  # fmt: skip
def test_socket_chosen(
    rec_fixtures: Path, root: str, docker: str, podman: str, fixture: str, expected: str
) -> None:
    ref = container_from_cgroup((rec_fixtures / "cgroup" / fixture).read_text())
    assert ref is not None
    asked, fetch = _recording()
    resolver = EngineApiResolver(default_sockets(docker, podman, root=root), fetch=fetch)
    assert resolver.socket_for(ref) == expected
    assert resolver(ref) == "web"
    assert asked == [expected]


def test_root_session_container_is_uid_0(rec_fixtures: Path) -> None:
    text = (rec_fixtures / "cgroup" / "podman-root-session.txt").read_text()
    assert container_from_cgroup(text) == ContainerRef("podman", CID, uid=0)


def test_root_docker_in_a_session_uses_the_rootful_socket() -> None:
    ref = ContainerRef("docker", CID, uid=0)
    resolver = EngineApiResolver(default_sockets("/var/run/docker.sock", None))
    assert resolver.socket_for(ref) == "/var/run/docker.sock"


def test_uid_from_the_user_slice_when_no_user_manager() -> None:
    text = f"0::/user.slice/user-1000.slice/session-3.scope/libpod-{CID}.scope\n"
    assert container_from_cgroup(text) == ContainerRef("podman", CID, uid=1000)


def test_uid_is_taken_outside_the_container_only() -> None:
    # a user slice *inside* a container (systemd in a container) is not the engine's owner
    text = f"0::/system.slice/docker-{CID}.scope/user.slice/user-1000.slice/x.scope\n"
    assert container_from_cgroup(text) == ContainerRef("docker", CID)


# --- 3. Kubernetes CRI cgroup paths ------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("k8s-containerd-systemd-v2.txt", ContainerRef("cri", CID, pod_uid=POD_UID)),
        ("k8s-containerd-static-guaranteed.txt", ContainerRef("cri", CID, pod_uid=STATIC_UID)),
        ("k8s-cgroupfs-v1.txt", ContainerRef("cri", CID, pod_uid=POD_UID)),
        ("k8s-crio-systemd-v1.txt", ContainerRef("cri", CID, pod_uid=POD_UID)),
        ("k8s-containerd-colon.txt", ContainerRef("cri", CID, pod_uid=POD_UID)),
        ("k8s-kind-node.txt", ContainerRef("cri", CID, pod_uid=POD_UID)),
        ("k8s-crio-conmon.txt", None),
    ],
)
def test_cri_cgroup_fixtures(
    rec_fixtures: Path, fixture: str, expected: ContainerRef | None
) -> None:
    text = (rec_fixtures / "cgroup" / fixture).read_text()
    assert container_from_cgroup(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # guaranteed pod, cgroupfs driver: no QoS level
        (f"0::/kubepods/pod{POD_UID}/{CID}\n", ContainerRef("cri", CID, pod_uid=POD_UID)),
        # CRI-O with the cgroupfs driver: crio-<id> in the pod's cgroup (CRI-O's cgroupfs
        # manager, ContainerCgroupPath: filepath.Join(parent, "crio-"+id))
        (
            f"0::/kubepods/burstable/pod{POD_UID}/crio-{CID}\n",
            ContainerRef("cri", CID, pod_uid=POD_UID),
        ),
        (f"0::/kubepods/besteffort/pod{POD_UID}/crio-conmon-{CID}\n", None),
        # podman with the cgroupfs manager: /libpod_parent/libpod-<id>, no .scope (libpod's
        # cgroupfs path); conmon's own cgroup is not the container
        (f"0::/libpod_parent/libpod-{CID}\n", ContainerRef("podman", CID)),
        (f"0::/libpod_parent/libpod-{CID}/container\n", ContainerRef("podman", CID)),
        ("0::/libpod_parent/conmon\n", None),
        (f"0::/libpod_parent/libpod-conmon-{CID}\n", None),
        # the pod's own cgroup (no container) is not a container
        (f"0::/kubepods/burstable/pod{POD_UID}\n", None),
        (f"0::/kubepods.slice/kubepods-pod{POD_UID_}.slice\n", None),
        # a CRI scope without a pod slice is not taken for a pod
        (f"0::/system.slice/cri-containerd-{CID}.scope\n", None),
        # cri-dockerd: a Docker container in a pod slice stays Docker (its API names it)
        (
            f"0::/kubepods.slice/kubepods-pod{POD_UID_}.slice/docker-{CID}.scope\n",
            ContainerRef("docker", CID),
        ),
        # minikube's CRI-O node inside Docker (cgroupfs driver of the outer engine)
        (
            f"0::/docker/{CID2}/kubepods.slice/kubepods-besteffort.slice/"
            f"kubepods-besteffort-pod{POD_UID_}.slice/crio-{CID}.scope\n",
            ContainerRef("cri", CID, pod_uid=POD_UID),
        ),
    ],
)
def test_cri_cgroup_edges(text: str, expected: ContainerRef | None) -> None:
    assert container_from_cgroup(text) == expected


def test_unresolvable_cri_container_is_named_by_pod_and_id(tmp_path: Path) -> None:
    ref = ContainerRef("cri", CID, pod_uid=POD_UID)
    resolver = EngineApiResolver(default_sockets("/d.sock", "/p.sock"), root=str(tmp_path))
    assert client_name(ref, "python3", "", DEFAULT_RULES, resolver) == (
        "k8s/pod-2c48913c/0123456789ab"
    )
